//! The memory cgroup this process is charged to: its usage and the tightest limit that applies.
//!
//! Containers and job schedulers (Docker, Kubernetes, systemd, Slurm) put a process in a
//! cgroup that is not necessarily the root, and limits set on any ancestor apply to it. The
//! process's own cgroup comes from `/proc/self/cgroup` (`0::/path` on v2; `N:memory:/path` on
//! v1); the limit is the smallest `memory.max` (v2) or `memory.limit_in_bytes` (v1) from that
//! cgroup up to the root of the mounted hierarchy. Inside a cgroup namespace the path is `/` and
//! the mount's root is the process's own cgroup, so the same walk is right there too.

use std::path::{Path, PathBuf};

/// v1 reports "no limit" as a page-rounded `i64::MAX`; anything this large is no limit.
const V1_UNLIMITED: usize = 1 << 60;

/// The memory cgroup a process is charged to, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupMemory {
    /// What the cgroup is charged now (`memory.current`, v1 `memory.usage_in_bytes`): every
    /// process in it, and the page cache of the files they read.
    pub usage: usize,
    /// The tightest limit from the process's cgroup up to the root; `None` when none is set.
    pub limit: Option<usize>,
    /// The part of `usage` that is inactive file cache (`memory.stat`'s `inactive_file`, v1
    /// `total_inactive_file`), which the kernel reclaims before it refuses the cgroup memory.
    pub inactive_file: usize,
}

impl CgroupMemory {
    /// `usage` less the inactive file cache: the "working set" that container runtimes
    /// (Kubernetes, `docker stats`) compare with the limit.
    pub fn working_set(&self) -> usize {
        self.usage.saturating_sub(self.inactive_file)
    }
}

/// The process's cgroup (usage, limit) in bytes; the limit is `None` when nothing along the path
/// sets one. `None` when no memory cgroup is mounted at `/sys/fs/cgroup`.
pub fn cgroup_memory() -> Option<(usize, Option<usize>)> {
    own_cgroup().map(|c| (c.usage, c.limit))
}

/// [`cgroup_memory`] for a hierarchy mounted at `root` and the contents of `/proc/self/cgroup`.
pub fn cgroup_memory_in(root: &Path, membership: &str) -> Option<(usize, Option<usize>)> {
    cgroup_in(root, membership).map(|c| (c.usage, c.limit))
}

/// This process's [`CgroupMemory`], or `None` when no memory cgroup is mounted at
/// `/sys/fs/cgroup`.
pub fn own_cgroup() -> Option<CgroupMemory> {
    own_location()?.figures()
}

/// This process's [`CgroupMemory`] when a limit applies to it, `None` otherwise: the usage and
/// the file cache are read only then (the check of a CPU buffer asks this at every large one).
pub fn own_limited_cgroup() -> Option<CgroupMemory> {
    let location = own_location()?;
    let limit = location.limit()?;
    location.figures_with(Some(limit))
}

/// [`own_cgroup`] for a hierarchy mounted at `root` and the contents of `/proc/self/cgroup`.
pub fn cgroup_in(root: &Path, membership: &str) -> Option<CgroupMemory> {
    Location::find(root, membership)?.figures()
}

/// Where the process's cgroup lives, found once per process (per copy of this crate): a process
/// is placed in its cgroup when it starts, and finding it is most of the cost of reading it.
fn own_location() -> Option<&'static Location> {
    static OWN: std::sync::OnceLock<Option<Location>> = std::sync::OnceLock::new();
    OWN.get_or_init(|| {
        let membership = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Location::find(Path::new("/sys/fs/cgroup"), &membership)
    })
    .as_ref()
}

/// A memory cgroup's files: v2 (`memory.current`, `memory.max`, `inactive_file`) or v1
/// (`memory.usage_in_bytes`, `memory.limit_in_bytes`, `total_inactive_file`).
struct Location {
    /// The hierarchy's mount (the walk for limits stops there).
    mount: PathBuf,
    /// The process's own cgroup directory (the mount itself when it is not visible).
    own: PathBuf,
    /// Where the usage is read: `own`, or the mount when `own` has no usage file.
    usage_dir: PathBuf,
    usage_file: &'static str,
    limit_file: &'static str,
    unlimited: usize,
    inactive_key: &'static str,
}

impl Location {
    fn find(root: &Path, membership: &str) -> Option<Location> {
        let v2_path = membership.lines().find_map(|l| l.strip_prefix("0::"));
        let v2 =
            root.join("cgroup.controllers").is_file() || (v2_path.is_some() && root.join("memory.current").is_file());
        let (mount, path, usage_file, limit_file, unlimited, inactive_key) = if v2 {
            (root.to_path_buf(), v2_path.unwrap_or("/"), "memory.current", "memory.max", usize::MAX, "inactive_file")
        } else {
            let v1_path = membership.lines().find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                controllers.split(',').any(|c| c == "memory").then_some(path)
            });
            let mount = root.join("memory");
            (
                mount,
                v1_path.unwrap_or("/"),
                "memory.usage_in_bytes",
                "memory.limit_in_bytes",
                V1_UNLIMITED,
                "total_inactive_file",
            )
        };
        let own = own_dir(&mount, path);
        let usage_dir = [&own, &mount].into_iter().find(|d| d.join(usage_file).is_file())?.clone();
        Some(Location { mount, own, usage_dir, usage_file, limit_file, unlimited, inactive_key })
    }

    /// The smallest limit from the process's cgroup up to the mount (values at or above
    /// `unlimited`, or `max`, are no limit).
    fn limit(&self) -> Option<usize> {
        let mut limit: Option<usize> = None;
        for dir in self.own.ancestors() {
            if let Some(l) = read_number(&dir.join(self.limit_file)).filter(|l| *l < self.unlimited) {
                limit = Some(limit.map_or(l, |m| m.min(l)));
            }
            if dir == self.mount {
                break;
            }
        }
        limit
    }

    fn figures(&self) -> Option<CgroupMemory> {
        self.figures_with(self.limit())
    }

    fn figures_with(&self, limit: Option<usize>) -> Option<CgroupMemory> {
        Some(CgroupMemory {
            usage: read_number(&self.usage_dir.join(self.usage_file))?,
            limit,
            inactive_file: stat_field(&self.usage_dir.join("memory.stat"), self.inactive_key).unwrap_or(0),
        })
    }
}

/// A `key value` line of a cgroup's `memory.stat`.
fn stat_field(path: &Path, key: &str) -> Option<usize> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The process's cgroup directory under a hierarchy's mount, or the mount itself when that path
/// is not visible (a cgroup namespace shows the process's cgroup as the root).
fn own_dir(mount: &Path, path: &str) -> PathBuf {
    let dir = mount.join(path.trim_start_matches('/'));
    // `..` in a crafted path must not walk out of the mount.
    if path.split('/').any(|c| c == "..") || !dir.is_dir() {
        mount.to_path_buf()
    } else {
        dir
    }
}

fn read_number(path: &Path) -> Option<usize> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let root = std::env::temp_dir().join(format!("wick-cgroup-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, content) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, content).unwrap();
        }
        root
    }

    #[test]
    fn v2_takes_the_smallest_limit_along_the_process_path() {
        // A job's limit on a parent (4 GiB) binds although its own cgroup says "max" and the
        // root has none: reading only the root's `memory.max` missed it.
        let root = tree(&[
            ("cgroup.controllers", "memory"),
            ("memory.current", "999999"),
            ("job/memory.max", "4294967296"),
            ("job/step/memory.max", "max"),
            ("job/step/memory.current", "12345"),
            ("other/memory.max", "1000"),
        ]);
        assert_eq!(cgroup_memory_in(&root, "0::/job/step\n"), Some((12345, Some(4 << 30))));
        // A tighter limit lower down wins.
        std::fs::write(root.join("job/step/memory.max"), "2147483648").unwrap();
        assert_eq!(cgroup_memory_in(&root, "0::/job/step\n"), Some((12345, Some(2 << 30))));
        // Inside a cgroup namespace the path is `/`: the mount is the process's cgroup.
        assert_eq!(cgroup_memory_in(&root, "0::/\n"), Some((999999, None)));
        // A path that escapes the mount is not followed.
        assert_eq!(cgroup_memory_in(&root, "0::/../../etc\n"), Some((999999, None)));
        // The inactive file cache comes from the same cgroup as the usage.
        std::fs::write(root.join("job/step/memory.stat"), "anon 10000\nfile 2000\ninactive_file 345\n").unwrap();
        let own = cgroup_in(&root, "0::/job/step\n").unwrap();
        assert_eq!((own.usage, own.inactive_file, own.working_set()), (12345, 345, 12000));
        assert_eq!(cgroup_in(&root, "0::/\n").unwrap().inactive_file, 0);
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn v1_reads_the_memory_controller_path_and_ignores_unlimited() {
        let root = tree(&[
            ("memory/memory.usage_in_bytes", "5"),
            ("memory/memory.limit_in_bytes", "9223372036854771712"),
            ("memory/docker/abc/memory.usage_in_bytes", "777"),
            ("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712"),
            ("memory/docker/memory.limit_in_bytes", "3000000000"),
        ]);
        let membership = "12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n9:memory:/docker/abc\n";
        assert_eq!(cgroup_memory_in(&root, membership), Some((777, Some(3_000_000_000))));
        std::fs::write(root.join("memory/docker/memory.limit_in_bytes"), "9223372036854771712").unwrap();
        assert_eq!(cgroup_memory_in(&root, membership), Some((777, None)));
        // v1 names the hierarchical figure `total_inactive_file`.
        std::fs::write(root.join("memory/docker/abc/memory.stat"), "inactive_file 1\ntotal_inactive_file 700\n")
            .unwrap();
        assert_eq!(cgroup_in(&root, membership).unwrap().working_set(), 77);
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn no_cgroup_mounted_is_none() {
        let root = tree(&[("unrelated", "")]);
        assert_eq!(cgroup_memory_in(&root, ""), None);
        std::fs::remove_dir_all(&root).ok();
    }
}
