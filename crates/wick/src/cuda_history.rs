//! The allocation history of candle's CUDA buffers (PyTorch's `_record_memory_history` on a
//! device): CUPTI's callback API on the driver's stream-ordered allocation calls
//! (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`, `cuMemFreeAsync` and their per-thread-stream
//! variants), which are how candle allocates every buffer from the wick pool. Each call becomes
//! an event in a [`HistoryRecorder`] under the calling thread's label stack, as the host heap's
//! allocations do, so the same [`crate::MemoryHistory`] reports and exports read it.
//!
//! libcupti is opened at run time (`WICK_CUPTI` names the file, else `libcupti.so` and its
//! versioned names are looked up as the dynamic loader does), so machines without it still run;
//! asking to record there is a clear `Unsupported` error. The ABI figures the callback relies on
//! live in [`crate::cupti_abi`], checked against CUPTI's headers in CI.

use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, OnceLock};

use wick_memory::{HeapAction, HeapHistory, HistoryRecorder, MemoryError};

use crate::cupti_abi::{decode, Call, ALLOC_CALLS, CUPTI_SUCCESS, DOMAIN_DRIVER_API, FREE_CALLS};

/// The device's history (one recorder: wick governs one CUDA device per process).
static HISTORY: HistoryRecorder = HistoryRecorder::new("cuda");

/// Sizes of the blocks seen allocated while recording (a free names only the address).
static SIZES: Mutex<Option<HashMap<u64, usize>>> = Mutex::new(None);

/// The subscription, made once per process (CUPTI allows one subscriber); the error says why
/// it could not be made, for every later request.
static SUBSCRIBED: OnceLock<Result<Cupti, String>> = OnceLock::new();

type CallbackFunc = unsafe extern "C" fn(*mut c_void, u32, u32, *const c_void);
type Subscribe = unsafe extern "C" fn(*mut *mut c_void, CallbackFunc, *mut c_void) -> u32;
type EnableCallback = unsafe extern "C" fn(u32, *mut c_void, u32, u32) -> u32;
type GetResultString = unsafe extern "C" fn(u32, *mut *const c_char) -> u32;

/// The opened library, kept for the life of the process (its callback may run at any time).
struct Cupti {
    _library: libloading::Library,
}

fn sizes() -> std::sync::MutexGuard<'static, Option<HashMap<u64, usize>>> {
    SIZES.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Starts recording candle's allocations on the device: `baseline` is the pool's live bytes now.
pub(crate) fn start(max_entries: usize, min_size: usize, baseline: usize) -> Result<(), MemoryError> {
    SUBSCRIBED.get_or_init(subscribe).as_ref().map_err(|why| MemoryError::Unsupported(why.clone()))?;
    HISTORY.stop();
    *sizes() = Some(HashMap::new());
    HISTORY.start(max_entries, min_size, || baseline)
}

/// Stops recording (what was recorded stays readable).
pub(crate) fn stop() {
    HISTORY.stop();
    *sizes() = None;
}

/// What was recorded so far.
pub(crate) fn history() -> HeapHistory {
    HISTORY.history()
}

/// Opens libcupti and subscribes [`on_driver_call`] to the allocation calls.
fn subscribe() -> Result<Cupti, String> {
    let names: Vec<String> = match std::env::var("WICK_CUPTI") {
        Ok(path) if !path.is_empty() => vec![path],
        _ => ["libcupti.so", "libcupti.so.13", "libcupti.so.12"].map(String::from).to_vec(),
    };
    let mut tried = Vec::new();
    let library = names
        .iter()
        .find_map(|name| {
            // SAFETY: loading libcupti runs its initialisers, which only set up CUPTI's own state.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => Some(lib),
                Err(e) => {
                    tried.push(format!("{name}: {e}"));
                    None
                }
            }
        })
        .ok_or_else(|| {
            format!(
                "record_memory_history on CUDA needs CUPTI (libcupti, in the CUDA toolkit's extras/CUPTI/lib64 or \
                 PyPI's nvidia-cuda-cupti); put it on LD_LIBRARY_PATH or name it in WICK_CUPTI. Tried: {}",
                tried.join("; ")
            )
        })?;
    // SAFETY: the symbols have the signatures of CUPTI's C API (cupti_callbacks.h, cupti_result.h).
    unsafe {
        let get = |name: &[u8]| -> Result<*mut c_void, String> {
            library
                .get::<*mut c_void>(name)
                .map(|s| *s)
                .map_err(|e| format!("libcupti lacks {}: {e}", String::from_utf8_lossy(name)))
        };
        let subscribe: Subscribe = std::mem::transmute::<*mut c_void, Subscribe>(get(b"cuptiSubscribe\0")?);
        let enable: EnableCallback = std::mem::transmute::<*mut c_void, EnableCallback>(get(b"cuptiEnableCallback\0")?);
        let describe: GetResultString =
            std::mem::transmute::<*mut c_void, GetResultString>(get(b"cuptiGetResultString\0")?);
        let why = |what: &str, code: u32| {
            let mut text: *const c_char = std::ptr::null();
            let name = if describe(code, &mut text) == CUPTI_SUCCESS && !text.is_null() {
                CStr::from_ptr(text).to_string_lossy().into_owned()
            } else {
                format!("CUPTI error {code}")
            };
            format!("{what}: {name} (another CUPTI client in this process, such as a profiler, excludes wick's)")
        };
        let mut subscriber: *mut c_void = std::ptr::null_mut();
        let code = subscribe(&mut subscriber, on_driver_call, std::ptr::null_mut());
        if code != CUPTI_SUCCESS {
            return Err(why("cuptiSubscribe", code));
        }
        for cbid in ALLOC_CALLS.iter().chain(&FREE_CALLS) {
            let code = enable(1, subscriber, DOMAIN_DRIVER_API, *cbid);
            if code != CUPTI_SUCCESS {
                return Err(why("cuptiEnableCallback", code));
            }
        }
    }
    Ok(Cupti { _library: library })
}

/// CUPTI's callback: runs on the thread making the driver call, before (`API_ENTER`) and after
/// (`API_EXIT`) it. Never unwinds into the driver.
unsafe extern "C" fn on_driver_call(_userdata: *mut c_void, domain: u32, cbid: u32, data: *const c_void) {
    if !HISTORY.is_recording() {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: CUPTI hands `data` as `decode` requires.
        match unsafe { decode(domain, cbid, data) } {
            Some(Call::Alloc { addr, size }) => allocated(addr, size),
            Some(Call::Free { addr }) => freed(addr),
            None => {}
        }
    });
}

fn allocated(addr: u64, size: usize) {
    if let Some(map) = sizes().as_mut() {
        map.insert(addr, size);
    }
    HISTORY.record(HeapAction::Alloc, addr, size);
}

fn freed(addr: u64) {
    let known = sizes().as_mut().and_then(|map| map.remove(&addr));
    // A block allocated before recording started: the driver knows its extent.
    let size = known.or_else(|| allocation_size(addr));
    if let Some(size) = size {
        HISTORY.record(HeapAction::Free, addr, size);
    }
}

/// The size of the allocation at `addr` as the driver records it (`cuMemGetAddressRange`).
fn allocation_size(addr: u64) -> Option<usize> {
    let mut base = 0;
    let mut size = 0usize;
    // SAFETY: out-pointers to locals; the driver validates `addr`.
    let code = unsafe { cudarc::driver::sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
    (code == cudarc::driver::sys::CUresult::CUDA_SUCCESS && base == addr).then_some(size)
}
