//! What this machine offers a run, in one report ([`MachineInfo`], `wick info`): the CPU, host
//! memory as the process sees it (MemTotal and MemAvailable, the cgroup's usage and the tightest
//! limit along the process's own cgroup path, `/dev/shm`, where data-loader workers share
//! memory), the GPUs and driver ([`crate::gpu`]), the allocator policy the environment sets
//! (`WICK_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`), and how candle was built.

use std::fmt;

use wick_memory::{alloc_conf_env, format_bytes, meminfo_bytes, AllocatorConfig};

use crate::gpu::GpuReport;

/// The CPU.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CpuInfo {
    /// Its model name (`/proc/cpuinfo`), when known.
    pub model: Option<String>,
    /// Logical processors the machine has.
    pub logical_cores: usize,
    /// Logical processors this process may use (affinity and cgroup quota).
    pub usable_cores: usize,
    /// The threads candle's CPU kernels use.
    pub candle_threads: usize,
    /// Vector extensions the kernels can use (`avx2`, `fma`, `avx512f`, ...).
    pub features: Vec<String>,
}

/// Host memory as this process sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HostInfo {
    /// `MemTotal`.
    pub total_bytes: Option<u64>,
    /// `MemAvailable`: what can be allocated without swapping.
    pub available_bytes: Option<u64>,
    /// The memory cgroup's usage, when one is mounted.
    pub cgroup_usage_bytes: Option<u64>,
    /// The tightest cgroup limit from the process's cgroup up to the root (v1 or v2).
    pub cgroup_limit_bytes: Option<u64>,
    /// `/dev/shm`'s size and free space (data-loader workers in other processes pass batches
    /// through it; Docker's default is 64 MiB).
    pub shm_total_bytes: Option<u64>,
    /// Free space in `/dev/shm`.
    pub shm_free_bytes: Option<u64>,
    /// The budget wick's host pre-flight checks use: the cgroup limit when set, else MemTotal.
    pub budget_bytes: u64,
}

/// The allocator policy the environment sets.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AllocatorSettings {
    /// The variable it came from (`WICK_ALLOC_CONF` or `PYTORCH_CUDA_ALLOC_CONF`), or `None`:
    /// wick's defaults.
    pub variable: Option<String>,
    /// Its text.
    pub text: Option<String>,
    /// The policy as it will be applied, or why the text is refused.
    pub policy: Result<String, String>,
}

/// How candle (the tensor library under wick) was built.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CandleBuild {
    /// CUDA support compiled in (wick's `cuda` feature).
    pub cuda: bool,
    /// Metal support compiled in.
    pub metal: bool,
    /// Intel MKL for CPU matrix products.
    pub mkl: bool,
    /// Apple Accelerate.
    pub accelerate: bool,
    /// AVX kernels compiled in.
    pub avx: bool,
    /// F16C conversions compiled in.
    pub f16c: bool,
    /// wick's patched candle-core (`vendor/`): gradients stored instead of added into zeros,
    /// over-memory CPU tensors as `Err` (`crate::host_memory::candle_checks_cpu_allocations`).
    #[serde(default)]
    pub patched: bool,
}

/// Everything `wick info` reports.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MachineInfo {
    /// wick's version.
    pub wick_version: String,
    /// The CPU.
    pub cpu: CpuInfo,
    /// Host memory.
    pub host: HostInfo,
    /// GPUs and driver.
    pub gpus: GpuReport,
    /// The allocator policy.
    pub allocator: AllocatorSettings,
    /// candle's build.
    pub candle: CandleBuild,
}

impl MachineInfo {
    /// Reads everything now (a few files and, when the driver is here, NVML).
    pub fn probe() -> Self {
        MachineInfo {
            wick_version: env!("CARGO_PKG_VERSION").to_string(),
            cpu: cpu_info(),
            host: HostInfo::probe(),
            gpus: GpuReport::probe(),
            allocator: allocator_settings(),
            candle: CandleBuild {
                cuda: candle_core::utils::cuda_is_available(),
                metal: candle_core::utils::metal_is_available(),
                mkl: candle_core::utils::has_mkl(),
                accelerate: candle_core::utils::has_accelerate(),
                avx: candle_core::utils::with_avx(),
                f16c: candle_core::utils::with_f16c(),
                patched: crate::host_memory::candle_checks_cpu_allocations(),
            },
        }
    }
}

fn cpu_info() -> CpuInfo {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string());
    let listed = cpuinfo.lines().filter(|l| l.starts_with("processor")).count();
    let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
    CpuInfo {
        model,
        logical_cores: listed.max(usable),
        usable_cores: usable,
        candle_threads: candle_core::utils::get_num_threads(),
        features: cpu_features(),
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_features() -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! probe {
        ($($f:tt),*) => {$(
            if std::arch::is_x86_feature_detected!($f) {
                out.push($f.to_string());
            }
        )*};
    }
    probe!("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl");
    out
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_features() -> Vec<String> {
    Vec::new()
}

/// (size, bytes an unprivileged process may still write) of the file system holding `path`;
/// `None` when it cannot be read.
pub fn filesystem_space(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut s = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `s` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), s.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs succeeded and filled it.
    let s = unsafe { s.assume_init() };
    let block: u64 = s.f_frsize;
    Some((block.checked_mul(s.f_blocks)?, block.checked_mul(s.f_bavail)?))
}

impl HostInfo {
    /// Reads the host's memory figures now (a few small files; cheap enough to poll).
    pub fn probe() -> Self {
        let cgroup = crate::host_memory::cgroup_memory();
        let shm = filesystem_space(std::path::Path::new("/dev/shm"));
        HostInfo {
            total_bytes: meminfo_bytes("MemTotal").map(|b| b as u64),
            available_bytes: meminfo_bytes("MemAvailable").map(|b| b as u64),
            cgroup_usage_bytes: cgroup.map(|(usage, _)| usage as u64),
            cgroup_limit_bytes: cgroup.and_then(|(_, limit)| limit).map(|l| l as u64),
            shm_total_bytes: shm.map(|s| s.0),
            shm_free_bytes: shm.map(|s| s.1),
            budget_bytes: crate::host_memory::host_budget().0 as u64,
        }
    }
}

/// How [`policy_line`] names wick's default policy.
pub const DEFAULT_POLICY: &str = "wick's defaults (PyTorch's policy with expandable segments)";

/// The policy in words, only what differs from wick's defaults ([`AllocatorConfig::default`]:
/// PyTorch's with expandable segments), [`DEFAULT_POLICY`] when nothing does.
pub fn policy_line(c: &AllocatorConfig) -> String {
    let d = AllocatorConfig::default();
    let mut parts = Vec::new();
    if c.max_split_size != d.max_split_size {
        parts.push(format!("max_split_size {}", format_bytes(c.max_split_size as u64)));
    }
    if c.max_non_split_rounding != d.max_non_split_rounding {
        parts.push(format!("max_non_split_rounding {}", format_bytes(c.max_non_split_rounding as u64)));
    }
    if c.roundup_power2_divisions != d.roundup_power2_divisions {
        parts.push(format!("roundup_power2_divisions {:?}", c.roundup_power2_divisions));
    }
    if let Some(t) = c.garbage_collection_threshold {
        parts.push(format!("garbage_collection_threshold {t}"));
    }
    match c.limit {
        Some(wick_memory::MemoryLimit::Bytes(b)) => parts.push(format!("limit {}", format_bytes(b as u64))),
        Some(wick_memory::MemoryLimit::Fraction(f)) => parts.push(format!("limit {f} of the device")),
        None => {}
    }
    if !c.expandable_segments {
        parts.push("classic segments (expandable_segments off)".into());
    }
    if parts.is_empty() {
        DEFAULT_POLICY.into()
    } else {
        parts.join(", ")
    }
}

fn allocator_settings() -> AllocatorSettings {
    let (variable, text) = alloc_conf_env().map_or((None, None), |(v, t)| (Some(v.to_string()), Some(t)));
    let policy = match &text {
        Some(t) => AllocatorConfig::parse(t).map(|c| policy_line(&c)).map_err(|e| e.to_string()),
        None => Ok(policy_line(&AllocatorConfig::default())),
    };
    AllocatorSettings { variable, text, policy }
}

impl fmt::Display for MachineInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = |n: Option<u64>| n.map_or_else(|| "unknown".to_string(), format_bytes);
        let (c, h) = (&self.cpu, &self.host);
        writeln!(f, "wick {}", self.wick_version)?;
        writeln!(f, "CPU      {}", c.model.as_deref().unwrap_or("unknown model"))?;
        writeln!(
            f,
            "         {} logical cores, {} usable by this process, candle uses {} threads; {}",
            c.logical_cores,
            c.usable_cores,
            c.candle_threads,
            if c.features.is_empty() { "no vector extensions detected".into() } else { c.features.join(" ") }
        )?;
        writeln!(f, "memory   MemTotal {}, MemAvailable {}", b(h.total_bytes), b(h.available_bytes))?;
        match (h.cgroup_usage_bytes, h.cgroup_limit_bytes) {
            (None, _) => writeln!(f, "cgroup   no memory cgroup mounted")?,
            (Some(u), None) => writeln!(f, "cgroup   using {}, no limit along this process's cgroup path", b(Some(u)))?,
            (Some(u), Some(l)) => writeln!(f, "cgroup   using {} of a {} limit", b(Some(u)), b(Some(l)))?,
        }
        writeln!(f, "         host budget for pre-flight checks: {}", b(Some(h.budget_bytes)))?;
        match (h.shm_total_bytes, h.shm_free_bytes) {
            (Some(t), Some(free)) => {
                let small = if t < 1 << 30 { " (small: multi-process data loaders may fail)" } else { "" };
                writeln!(f, "/dev/shm {} ({} free){small}", b(Some(t)), b(Some(free)))?
            }
            _ => writeln!(f, "/dev/shm not mounted")?,
        }
        writeln!(f, "GPUs     {}", self.gpus.summary())?;
        for g in &self.gpus.devices {
            writeln!(
                f,
                "  [{}] {}: {} total, {} used, {} free; compute capability {}; {} process(es)",
                g.index,
                g.name,
                b(Some(g.total_bytes)),
                b(Some(g.used_bytes)),
                b(Some(g.free_bytes)),
                g.compute_capability.as_deref().unwrap_or("?"),
                g.processes.len()
            )?;
        }
        let a = &self.allocator;
        match (&a.variable, &a.policy) {
            (None, Ok(p)) => writeln!(f, "allocator {p} (neither WICK_ALLOC_CONF nor PYTORCH_CUDA_ALLOC_CONF is set)")?,
            (Some(v), Ok(p)) => writeln!(f, "allocator {p} (from {v}={})", a.text.as_deref().unwrap_or(""))?,
            (v, Err(e)) => writeln!(
                f,
                "allocator refused {}={}: {e}; wick's defaults apply",
                v.as_deref().unwrap_or("?"),
                a.text.as_deref().unwrap_or("")
            )?,
        }
        let k = &self.candle;
        let on: Vec<&str> = [
            ("cuda", k.cuda),
            ("metal", k.metal),
            ("mkl", k.mkl),
            ("accelerate", k.accelerate),
            ("avx", k.avx),
            ("f16c", k.f16c),
        ]
        .iter()
        .filter_map(|(n, v)| v.then_some(*n))
        .collect();
        write!(
            f,
            "candle   built with: {}",
            if on.is_empty() { "no optional features".into() } else { on.join(", ") }
        )?;
        if k.patched {
            write!(f, "; wick's patched candle-core (faster backward, over-memory CPU tensors are errors)")
        } else {
            write!(f, "; the published candle-core: add the README's [patch] line for a faster backward and over-memory CPU tensors as errors")
        }
    }
}

/// The start time of process `pid` (field 22 of `/proc/PID/stat`) and whether it is a zombie.
pub fn proc_stat(pid: u32) -> Option<(u64, bool)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: fields start after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some((fields.get(19)?.parse().ok()?, fields.first() == Some(&"Z")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_line_names_what_differs_from_the_defaults() {
        assert_eq!(policy_line(&AllocatorConfig::default()), DEFAULT_POLICY);
        assert_eq!(policy_line(&AllocatorConfig::pytorch()), "classic segments (expandable_segments off)");
        let c = AllocatorConfig::parse("max_split_size_mb:128,expandable_segments:True").unwrap();
        assert_eq!(policy_line(&c), "max_split_size 128.00 MiB");
        let c = AllocatorConfig::parse("max_split_size_mb:128,expandable_segments:False").unwrap();
        assert_eq!(policy_line(&c), "max_split_size 128.00 MiB, classic segments (expandable_segments off)");
    }

    #[test]
    fn the_machine_report_matches_the_kernel_s_own_figures() {
        let m = MachineInfo::probe();
        // Independent truth: sysconf's page counts.
        // SAFETY: sysconf has no preconditions.
        let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        assert_eq!(m.host.total_bytes, Some(pages as u64 * page as u64));
        assert!(m.host.available_bytes.is_some_and(|a| a <= pages as u64 * page as u64));
        assert!(m.cpu.usable_cores >= 1 && m.cpu.logical_cores >= m.cpu.usable_cores);
        assert_eq!(m.candle.cuda, cfg!(feature = "cuda"));
        // The workspace builds wick's patched candle-core (its `[patch]`).
        assert!(m.candle.patched);
        let text = m.to_string();
        for line in ["CPU ", "memory ", "cgroup ", "/dev/shm", "GPUs ", "allocator ", "candle "] {
            assert!(text.contains(line), "no `{line}` in\n{text}");
        }
        let json = serde_json::to_value(&m).unwrap();
        let back: MachineInfo = serde_json::from_value(json).unwrap();
        assert_eq!(back, m);
    }
}
