//! The host's memory as a new CPU buffer meets it: what the machine, the memory cgroup, the
//! address-space limit and the kernel's commit limit each still allow, read from `/proc` and
//! `/sys` at the moment of asking, with no state kept between calls.
//!
//! Policy (why these four and no other): a buffer the host cannot give ends the process in one
//! of four ways, and each has its own figure. The machine's RAM: past `MemAvailable` (free memory
//! plus what the kernel can reclaim without swapping) the kernel swaps or its OOM killer ends a
//! process when the pages are touched. A memory cgroup (containers, Slurm, systemd): past its
//! limit less its working set the cgroup's OOM killer ends it. `ulimit -v` (RLIMIT_AS) and strict
//! overcommit (`vm.overcommit_memory=2`): `malloc` returns null, and Rust's allocation-failure
//! handler aborts. Swap is not counted: a tensor that only fits by swapping is a step that takes
//! minutes, which a memory-first engine refuses rather than starts.

use crate::cgroup::{own_limited_cgroup, CgroupMemory};
use crate::format::format_bytes;

/// What limits a new allocation the most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The machine's available memory (`MemAvailable`).
    Machine,
    /// The memory cgroup's limit less its working set.
    Cgroup,
    /// The address-space limit (`ulimit -v`, RLIMIT_AS) less what the process maps.
    AddressSpace,
    /// The kernel's commit limit under strict overcommit, less what is committed.
    CommitLimit,
}

/// How much a new allocation can have now, and the limit that sets it, with that limit's own
/// figures: `bytes` is `limit` less `used`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// Bytes.
    pub bytes: usize,
    /// The tightest of the limits.
    pub bound: Bound,
    /// The limit's size: `MemTotal` (the machine), the cgroup's limit, `ulimit -v`, `CommitLimit`.
    pub limit: usize,
    /// What counts against it: all processes' and the kernel's use (`MemTotal` less
    /// `MemAvailable`), the cgroup's working set, this process's mappings, `Committed_AS`.
    pub used: usize,
}

/// The host's memory figures at one moment, each `None` where the system does not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostMemory {
    /// The machine's RAM (`MemTotal`).
    pub total: Option<usize>,
    /// RAM free or reclaimable without swapping (`MemAvailable`).
    pub available: Option<usize>,
    /// This process's memory cgroup.
    pub cgroup: Option<CgroupMemory>,
    /// (the soft address-space limit, the bytes this process maps), when a limit is set.
    pub address_space: Option<(usize, usize)>,
    /// (`CommitLimit`, `Committed_AS`), under strict overcommit only.
    pub commit: Option<(usize, usize)>,
    /// This process's resident set ([`process_resident`]), read for a refusal's text only.
    pub resident: Option<usize>,
}

impl HostMemory {
    /// The figures a check needs, now: `/proc/meminfo`, the strict-overcommit setting, the
    /// address-space limit (and with one, what the process maps), the cgroup's figures when it
    /// has a limit. About 30 microseconds; `resident` is left for [`HostMemory::with_resident`].
    pub fn read() -> Self {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let address_space = address_space_limit().and_then(|limit| Some((limit, statm_bytes(0)?)));
        Self::from_meminfo(&meminfo, strict_overcommit(), address_space, own_limited_cgroup())
    }

    /// These figures with this process's resident set read now (for a refusal's text).
    pub fn with_resident(self) -> Self {
        HostMemory { resident: process_resident(), ..self }
    }

    /// The figures from a `/proc/meminfo` text (the commit figures only under `strict`
    /// overcommit), the address-space limit with the bytes mapped, and the cgroup's figures.
    pub fn from_meminfo(
        meminfo: &str,
        strict: bool,
        address_space: Option<(usize, usize)>,
        cgroup: Option<CgroupMemory>,
    ) -> Self {
        let field = |key| meminfo_field(meminfo, key);
        HostMemory {
            total: field("MemTotal"),
            available: field("MemAvailable"),
            cgroup,
            address_space,
            commit: strict.then(|| field("CommitLimit").zip(field("Committed_AS"))).flatten(),
            resident: None,
        }
    }

    /// The bytes a new allocation can have now: the tightest of the limits that are known;
    /// `None` when none is (no `/proc`: nothing to check against).
    pub fn room(&self) -> Option<Room> {
        let room = |bound, limit: usize, used: usize| Room { bytes: limit.saturating_sub(used), bound, limit, used };
        let machine = self.available.map(|a| {
            let total = self.total.unwrap_or(a);
            Room { bytes: a, bound: Bound::Machine, limit: total, used: total.saturating_sub(a) }
        });
        let cgroup = self.cgroup.and_then(|c| Some(room(Bound::Cgroup, c.limit?, c.working_set())));
        let address = self.address_space.map(|(limit, mapped)| room(Bound::AddressSpace, limit, mapped));
        let commit = self.commit.map(|(limit, committed)| room(Bound::CommitLimit, limit, committed));
        [machine, cgroup, address, commit].into_iter().flatten().min_by_key(|r| r.bytes)
    }

    /// The refusal of `bytes` for `what` (e.g. `a candle CPU tensor`) when `room` is all the host
    /// allows and this process's heap still holds `freed` for reuse (blocks it could not return:
    /// not counted as room, a new buffer fits them only by chance): every figure says whose
    /// memory it is, and the advice fits the limit that refused.
    pub fn refusal(&self, what: &str, bytes: usize, freed: usize, room: Room) -> String {
        let b = |n: usize| format_bytes(n as u64);
        let resident = self.resident.map_or_else(String::new, |r| format!("; this process holds {} resident", b(r)));
        let held = if freed > 0 { format!(" and its heap {} freed for reuse", b(freed)) } else { String::new() };
        let (limit, advice) = match room.bound {
            Bound::Machine => (
                format!(
                    "the machine has {} available (MemAvailable) of {}{resident}{held}, other processes \
                     and the kernel the rest of what is in use",
                    b(room.bytes),
                    self.total.map_or_else(|| "an unknown total".into(), b)
                ),
                "make it smaller (a smaller batch or shape), drop tensors you no longer need, or free \
                 memory elsewhere on the machine",
            ),
            Bound::Cgroup => (
                format!(
                    "this process's memory cgroup (its container or job) is limited to {} and its \
                     processes use {} of it (without reclaimable file cache){resident}{held}",
                    b(room.limit),
                    b(room.used)
                ),
                "make it smaller (a smaller batch or shape), drop tensors you no longer need, or \
                 give the job a higher memory limit",
            ),
            Bound::AddressSpace => (
                format!(
                    "the address-space limit (ulimit -v) is {} and this process maps {} already{resident}",
                    b(room.limit),
                    b(room.used)
                ),
                "make it smaller or raise the limit (`ulimit -v`)",
            ),
            Bound::CommitLimit => (
                format!(
                    "the kernel's commit limit (vm.overcommit_memory=2) is {} and {} is committed by \
                     all processes{resident}",
                    b(room.limit),
                    b(room.used)
                ),
                "make it smaller, or ask the machine's administrator for more swap or a higher \
                 vm.overcommit_ratio",
            ),
        };
        format!(
            "out of memory on cpu ({what}): tried to allocate {}, and at most {} can be had now: {limit}. \
             Advice: {advice}.",
            b(bytes),
            b(room.bytes)
        )
    }
}

/// A `/proc/meminfo` field (`MemTotal`, `MemAvailable`, ...) in bytes, when the file has it.
pub fn meminfo_bytes(key: &str) -> Option<usize> {
    meminfo_field(&std::fs::read_to_string("/proc/meminfo").ok()?, key)
}

/// The field `key` of a `/proc/meminfo` or `/proc/self/status` text, in bytes (the files say
/// kB).
pub fn meminfo_field(text: &str, key: &str) -> Option<usize> {
    let line = text.lines().find(|l| l.split(':').next() == Some(key))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// This process's soft address-space limit (`ulimit -v`), when one is set.
#[cfg(unix)]
fn address_space_limit() -> Option<usize> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` through a valid pointer.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } == 0;
    (ok && limit.rlim_cur != libc::RLIM_INFINITY).then(|| usize::try_from(limit.rlim_cur).ok()).flatten()
}

#[cfg(not(unix))]
fn address_space_limit() -> Option<usize> {
    None
}

/// This process's resident set (`/proc/self/statm`), in bytes.
pub fn process_resident() -> Option<usize> {
    statm_bytes(1)
}

/// Field `index` of `/proc/self/statm` (0: the mapped size, 1: the resident set), in bytes. Read
/// into the stack, not a `String`: the resident set is taken while heaps are measured (timeline
/// marks, an engine's status publisher), and taking it must not move them.
fn statm_bytes(index: usize) -> Option<usize> {
    use std::io::Read;
    let mut buf = [0u8; 256];
    let mut file = std::fs::File::open("/proc/self/statm").ok()?;
    let mut len = 0;
    while len < buf.len() {
        match file.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(_) => return None,
        }
    }
    let statm = std::str::from_utf8(&buf[..len]).ok()?;
    let pages: usize = statm.split_whitespace().nth(index)?.parse().ok()?;
    pages.checked_mul(page_size())
}

#[cfg(unix)]
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

#[cfg(not(unix))]
fn page_size() -> usize {
    4096
}

/// True under strict overcommit (`vm.overcommit_memory=2`), read once per process: an
/// administrator's setting, and a file read at every large buffer otherwise.
fn strict_overcommit() -> bool {
    static STRICT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STRICT
        .get_or_init(|| std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|mode| mode.trim() == "2"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       16384 kB\nMemFree:  10 kB\nMemAvailable:   8192 kB\n\
                           CommitLimit:     4096 kB\nCommitted_AS:    3072 kB\n";
    const STATUS: &str = "Name:\ttest\nVmSize:\t    2048 kB\nVmRSS:\t     512 kB\n";

    #[test]
    fn meminfo_fields_are_bytes_and_missing_ones_none() {
        assert_eq!(meminfo_field(MEMINFO, "MemTotal"), Some(16384 * 1024));
        assert_eq!(meminfo_field(MEMINFO, "MemAvailable"), Some(8192 * 1024));
        assert_eq!(meminfo_field(MEMINFO, "Mem"), None);
        assert_eq!(meminfo_field("MemTotal: lots kB", "MemTotal"), None);
        assert_eq!(meminfo_field("MemTotal: 99999999999999999999 kB", "MemTotal"), None);
        assert_eq!(meminfo_field(STATUS, "VmRSS"), Some(512 * 1024));
    }

    #[test]
    fn the_tightest_known_limit_binds() {
        let kib = 1024;
        let room = |bytes, bound, limit, used| Some(Room { bytes, bound, limit, used });
        // Only the machine: MemAvailable, of MemTotal.
        let host = HostMemory::from_meminfo(MEMINFO, false, None, None);
        assert_eq!(host.room(), room(8192 * kib, Bound::Machine, 16384 * kib, 8192 * kib));
        assert_eq!((host.commit, host.address_space, host.resident), (None, None, None));
        // Strict overcommit: CommitLimit - Committed_AS = 1 MiB.
        let host = HostMemory::from_meminfo(MEMINFO, true, None, None);
        assert_eq!(host.room(), room(1024 * kib, Bound::CommitLimit, 4096 * kib, 3072 * kib));
        // ulimit -v of 2.5 MiB with 2 MiB mapped: 0.5 MiB.
        let host = HostMemory::from_meminfo(MEMINFO, true, Some((2560 * kib, 2048 * kib)), None);
        assert_eq!(host.room(), room(512 * kib, Bound::AddressSpace, 2560 * kib, 2048 * kib));
        // A cgroup limited to 300 KiB whose working set is 200 KiB (250 charged, 50 inactive cache).
        let cgroup = CgroupMemory { usage: 250 * kib, limit: Some(300 * kib), inactive_file: 50 * kib };
        let host = HostMemory::from_meminfo(MEMINFO, true, Some((2560 * kib, 2048 * kib)), Some(cgroup));
        assert_eq!(host.room(), room(100 * kib, Bound::Cgroup, 300 * kib, 200 * kib));
        // A cgroup without a limit does not bind; nothing known is no room figure at all.
        let unlimited = CgroupMemory { limit: None, ..cgroup };
        let host = HostMemory::from_meminfo(MEMINFO, false, None, Some(unlimited));
        assert_eq!(host.room().map(|r| r.bound), Some(Bound::Machine));
        assert_eq!(HostMemory::from_meminfo("", false, None, None).room(), None);
        // The live figures: this process's own resident set and a machine to check against.
        assert!(process_resident().is_some_and(|r| r > 0));
        assert!(HostMemory::read().room().is_some());
    }

    #[test]
    fn a_refusal_names_whose_memory_each_figure_is() {
        let resident = meminfo_field(STATUS, "VmRSS");
        let host = HostMemory { resident, ..HostMemory::from_meminfo(MEMINFO, false, None, None) };
        let room = host.room().unwrap();
        let text = host.refusal("a candle CPU tensor", 1 << 40, 0, room);
        assert!(text.starts_with("out of memory on cpu (a candle CPU tensor): tried to allocate 1.00 TiB"), "{text}");
        assert!(text.contains("8.00 MiB available (MemAvailable) of 16.00 MiB"), "{text}");
        assert!(text.contains("this process holds 512.00 KiB resident"), "{text}");
        assert!(text.contains("other processes and the kernel"), "{text}");
        assert!(!text.contains("wick"), "no figure is wick's: {text}");
        let text = host.refusal("a candle CPU tensor", 1 << 40, 3 << 20, room);
        assert!(text.contains("at most 8.00 MiB can be had") && text.contains("3.00 MiB freed for reuse"), "{text}");
        let cgroup = CgroupMemory { usage: 250 << 10, limit: Some(300 << 10), inactive_file: 50 << 10 };
        let host = HostMemory::from_meminfo(MEMINFO, false, None, Some(cgroup));
        let text = host.refusal("x", 1 << 30, 0, host.room().unwrap());
        assert!(text.contains("limited to 300.00 KiB and its processes use 200.00 KiB"), "{text}");
        assert!(text.contains("higher memory limit"), "{text}");
    }
}
