//! What the GPUs are doing, from the driver: NVIDIA's management library (NVML, through the
//! `nvml-wrapper` crate), loaded at run time. A machine without the driver gets a
//! [`GpuState::NoDriver`] report that says why, never an error or a link failure; this works in
//! builds with and without wick's `cuda` feature (a build without it can list GPUs but not use
//! them, and says so).

use std::ffi::OsStr;

use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

/// The library the driver installs (Linux).
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";

/// Whether the driver answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuState {
    /// The driver answered and lists at least one device.
    Ok,
    /// No NVIDIA driver here (the library is missing or the driver is not loaded).
    NoDriver,
    /// The driver runs but lists no device.
    NoDevice,
}

/// One process on a GPU, as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuProcess {
    /// Its process id (in the driver's namespace: a container may see other ids).
    pub pid: u32,
    /// The device memory it holds, when the driver says.
    pub used_bytes: Option<u64>,
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuInfo {
    /// Its index (CUDA's order when `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    pub index: u32,
    /// Its name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Installed device memory.
    pub total_bytes: u64,
    /// Memory in use (every process, and the driver's own reserve).
    pub used_bytes: u64,
    /// Memory free.
    pub free_bytes: u64,
    /// CUDA compute capability, `major.minor`.
    pub compute_capability: Option<String>,
    /// Share of the last sample period with a kernel running, percent.
    pub utilization_percent: Option<u32>,
    /// Compute processes on it, where visible.
    pub processes: Vec<GpuProcess>,
}

/// The GPUs of this machine and the driver's versions.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuReport {
    /// Whether the driver answered.
    pub state: GpuState,
    /// Why not, when it did not (the loader's or driver's words).
    pub detail: Option<String>,
    /// The driver's version, e.g. `550.54.15`.
    pub driver_version: Option<String>,
    /// The newest CUDA version the driver supports, e.g. `12.4`.
    pub cuda_driver_version: Option<String>,
    /// Whether this wick was built with the `cuda` feature (it can run on them).
    pub built_with_cuda: bool,
    /// The devices.
    pub devices: Vec<GpuInfo>,
}

/// A session with the driver, opened once and asked as often as needed (`wick monitor` asks
/// every refresh; starting NVML each time would load the library and initialise the driver's
/// state again).
pub struct Gpus {
    nvml: Result<Nvml, String>,
}

impl Gpus {
    /// Opens NVML from the driver's library.
    pub fn open() -> Self {
        Self::open_library(OsStr::new(NVML_LIBRARY))
    }

    /// Opens NVML from `library` (a path or a name the dynamic loader resolves).
    pub fn open_library(library: &OsStr) -> Self {
        Gpus { nvml: Nvml::builder().lib_path(library).init().map_err(|e| no_driver_reason(&e, library)) }
    }

    /// What the driver says now.
    pub fn report(&self) -> GpuReport {
        let built_with_cuda = cfg!(feature = "cuda");
        let nvml = match &self.nvml {
            Ok(nvml) => nvml,
            Err(reason) => {
                return GpuReport {
                    state: GpuState::NoDriver,
                    detail: Some(reason.clone()),
                    driver_version: None,
                    cuda_driver_version: None,
                    built_with_cuda,
                    devices: Vec::new(),
                }
            }
        };
        let driver_version = nvml.sys_driver_version().ok();
        let cuda_driver_version =
            nvml.sys_cuda_driver_version().ok().map(|v| format!("{}.{}", v / 1000, v % 1000 / 10));
        let count = nvml.device_count();
        let devices: Vec<GpuInfo> = (0..*count.as_ref().unwrap_or(&0)).filter_map(|i| device_info(nvml, i)).collect();
        let (state, detail) = match (&count, devices.is_empty()) {
            (Err(e), _) => (GpuState::NoDevice, Some(format!("the driver could not count devices: {e}"))),
            (Ok(0), _) => (GpuState::NoDevice, Some("the driver lists no device".into())),
            (Ok(n), true) => (GpuState::NoDevice, Some(format!("the driver lists {n} devices but none answered"))),
            (Ok(_), false) => (GpuState::Ok, None),
        };
        GpuReport { state, detail, driver_version, cuda_driver_version, built_with_cuda, devices }
    }
}

impl GpuReport {
    /// Asks the driver now (one-off; to ask repeatedly, keep a [`Gpus`]).
    pub fn probe() -> Self {
        Gpus::open().report()
    }

    /// [`GpuReport::probe`] with NVML loaded from `library` (a path or a name the dynamic
    /// loader resolves).
    pub fn probe_library(library: &OsStr) -> Self {
        Gpus::open_library(library).report()
    }

    /// One line: what is here, or why nothing is.
    pub fn summary(&self) -> String {
        let build = if self.built_with_cuda { "" } else { " (this wick was built without CUDA: feature `cuda`)" };
        match self.state {
            GpuState::Ok => format!(
                "{} GPU(s), driver {}, CUDA {}{build}",
                self.devices.len(),
                self.driver_version.as_deref().unwrap_or("?"),
                self.cuda_driver_version.as_deref().unwrap_or("?")
            ),
            GpuState::NoDriver => {
                format!("no driver: {}{build}", self.detail.as_deref().unwrap_or("NVML did not start"))
            }
            GpuState::NoDevice => format!("no device: {}{build}", self.detail.as_deref().unwrap_or("none listed")),
        }
    }
}

fn no_driver_reason(e: &NvmlError, library: &OsStr) -> String {
    match e {
        NvmlError::LibloadingError(l) => {
            format!("{} cannot be loaded ({l}); no NVIDIA driver is installed here", library.to_string_lossy())
        }
        NvmlError::DriverNotLoaded => "the NVIDIA driver is installed but not loaded".into(),
        NvmlError::NoPermission => "no permission to talk to the NVIDIA driver".into(),
        other => format!("NVML did not start: {other}"),
    }
}

fn device_info(nvml: &Nvml, index: u32) -> Option<GpuInfo> {
    let device = nvml.device_by_index(index).ok()?;
    let name = device.name().unwrap_or_else(|_| match device.brand() {
        Ok(Brand::Unknown) | Err(_) => "unknown GPU".into(),
        Ok(brand) => format!("{brand:?}"),
    });
    let memory = device.memory_info().ok();
    let processes = device
        .running_compute_processes()
        .map(|ps| {
            ps.into_iter()
                .map(|p| GpuProcess {
                    pid: p.pid,
                    used_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect()
        })
        .unwrap_or_default();
    Some(GpuInfo {
        index,
        name,
        total_bytes: memory.as_ref().map_or(0, |m| m.total),
        used_bytes: memory.as_ref().map_or(0, |m| m.used),
        free_bytes: memory.as_ref().map_or(0, |m| m.free),
        compute_capability: device.cuda_compute_capability().ok().map(|c| format!("{}.{}", c.major, c.minor)),
        utilization_percent: device.utilization_rates().ok().map(|u| u.gpu),
        processes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_no_driver_report_with_the_reason() {
        let r = GpuReport::probe_library(OsStr::new("/nonexistent/libnvidia-ml.so.1"));
        assert_eq!(r.state, GpuState::NoDriver);
        assert!(r.devices.is_empty() && r.driver_version.is_none());
        let line = r.summary();
        assert!(line.starts_with("no driver: /nonexistent/libnvidia-ml.so.1 cannot be loaded"), "{line}");
        assert_eq!(line.contains("built without CUDA"), !cfg!(feature = "cuda"), "{line}");
    }

    #[test]
    fn a_library_that_is_not_nvml_is_no_driver_too() {
        // libc loads, but has no nvmlInit_v2.
        let r = GpuReport::probe_library(OsStr::new("libc.so.6"));
        assert_eq!(r.state, GpuState::NoDriver, "{r:?}");
        assert!(r.detail.is_some());
    }
}
