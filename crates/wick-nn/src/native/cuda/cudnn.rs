//! cuDNN, opened at run time: the legacy convolution API of cuDNN 8.x/9.x (forward, backward
//! data, backward filter; the algorithm lists of `cudnnGet*Algorithm_v7`), through a table of
//! function pointers taken from `libcudnn.so.9` (or `.8`) when the first GPU convolution runs.
//!
//! Why not cudarc's `cudnn` module: under candle's `cuda` feature cudarc links its libraries at
//! build time, and its `cudnn` feature would then make every GPU binary need `libcudnn.so` to
//! start — a machine without cuDNN could not even run the CPU path of a CUDA build. Opened here,
//! a missing cuDNN is an `Err` naming how to install it, at the first convolution.
//!
//! Where it is looked for: `$WICK_CUDNN` (a path to the library); the loader's own search
//! (`LD_LIBRARY_PATH`, the system's cache); the PyPI wheel PyTorch installs
//! (`nvidia/cudnn/lib/libcudnn.so.9` under a `site-packages` or `dist-packages` of
//! `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `~/.local`, `/usr/local`, `/usr`, `/opt/conda`).
//!
//! The enum values and the algorithm-result layout below are cuDNN's (`cudnn_graph.h`,
//! `cudnn_cnn.h`; the same in 8.9 and 9.x, as cudarc's bindings of 8.9.7, 9.10.2 and 9.21.1 show).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use candle_core::Result;

use super::err;

pub(crate) type Status = c_int;
pub(crate) type Handle = *mut c_void;
pub(crate) type Desc = *mut c_void;

/// `cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t` (one layout for the three).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct AlgoPerf {
    pub(crate) algo: c_int,
    pub(crate) status: Status,
    pub(crate) time: f32,
    pub(crate) memory: usize,
    pub(crate) determinism: c_int,
    pub(crate) math_type: c_int,
    pub(crate) reserved: [c_int; 3],
}

pub(crate) const SUCCESS: Status = 0;
pub(crate) const DATA_FLOAT: c_int = 0;
pub(crate) const DATA_DOUBLE: c_int = 1;
pub(crate) const DATA_HALF: c_int = 2;
pub(crate) const DATA_BFLOAT16: c_int = 9;
pub(crate) const TENSOR_NCHW: c_int = 0;
pub(crate) const CROSS_CORRELATION: c_int = 1;
pub(crate) const DEFAULT_MATH: c_int = 0;
pub(crate) const TENSOR_OP_MATH: c_int = 1;
pub(crate) const FMA_MATH: c_int = 3;
pub(crate) const DETERMINISTIC: c_int = 1;

type AlgosFn = unsafe extern "C" fn(Handle, Desc, Desc, Desc, Desc, c_int, *mut c_int, *mut AlgoPerf) -> Status;
type WorkspaceFn = unsafe extern "C" fn(Handle, Desc, Desc, Desc, Desc, c_int, *mut usize) -> Status;
type RunFn = unsafe extern "C" fn(
    Handle,
    *const c_void,
    Desc,
    *const c_void,
    Desc,
    *const c_void,
    Desc,
    c_int,
    *mut c_void,
    usize,
    *const c_void,
    Desc,
    *mut c_void,
) -> Status;

/// The functions wick calls, with the library that holds them.
pub(crate) struct Api {
    _lib: libloading::Library,
    /// `cudnnGetVersion()`, e.g. 91002 for 9.10.2.
    pub(crate) version: usize,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub(crate) create: unsafe extern "C" fn(*mut Handle) -> Status,
    pub(crate) set_stream: unsafe extern "C" fn(Handle, *mut c_void) -> Status,
    pub(crate) create_tensor: unsafe extern "C" fn(*mut Desc) -> Status,
    pub(crate) set_tensor_4d: unsafe extern "C" fn(Desc, c_int, c_int, c_int, c_int, c_int, c_int) -> Status,
    pub(crate) destroy_tensor: unsafe extern "C" fn(Desc) -> Status,
    pub(crate) create_filter: unsafe extern "C" fn(*mut Desc) -> Status,
    pub(crate) set_filter_4d: unsafe extern "C" fn(Desc, c_int, c_int, c_int, c_int, c_int, c_int) -> Status,
    pub(crate) destroy_filter: unsafe extern "C" fn(Desc) -> Status,
    pub(crate) create_conv: unsafe extern "C" fn(*mut Desc) -> Status,
    #[allow(clippy::type_complexity)]
    pub(crate) set_conv_2d:
        unsafe extern "C" fn(Desc, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int) -> Status,
    pub(crate) set_group_count: unsafe extern "C" fn(Desc, c_int) -> Status,
    pub(crate) set_math_type: unsafe extern "C" fn(Desc, c_int) -> Status,
    pub(crate) destroy_conv: unsafe extern "C" fn(Desc) -> Status,
    /// Forward: (x, w, conv, y); backward data: (w, dy, conv, dx); backward filter: (x, dy, conv, dw).
    pub(crate) algos: [AlgosFn; 3],
    pub(crate) workspace: [WorkspaceFn; 3],
    /// Forward: (x, w → y); backward data: (w, dy → dx); backward filter: (x, dy → dw).
    pub(crate) run: [RunFn; 3],
}

// SAFETY: the table holds plain function pointers into a library kept open for the process's
// life; cuDNN's functions may be called from any thread (each handle is used under a lock).
unsafe impl Send for Api {}
// SAFETY: as for Send: the table is never written after it is built.
unsafe impl Sync for Api {}

impl Api {
    /// `status` as an `Err` naming `what` and cuDNN's description, `Ok` for success.
    pub(crate) fn check(&self, status: Status, what: &str) -> Result<()> {
        if status == SUCCESS {
            return Ok(());
        }
        // SAFETY: cudnnGetErrorString returns a static string for any status (or null).
        let text = unsafe { (self.error_string)(status) };
        let text = if text.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: a NUL-terminated static string from cuDNN.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(err(format!("cuDNN {what}: {text} ({status})")))
    }
}

/// The library's candidates, in order.
fn candidates() -> Vec<String> {
    if let Ok(path) = std::env::var("WICK_CUDNN") {
        if !path.is_empty() {
            return vec![path];
        }
    }
    let mut names = vec!["libcudnn.so.9".to_string(), "libcudnn.so.8".to_string()];
    let home = std::env::var("HOME").ok().map(|h| format!("{h}/.local"));
    let bases = [std::env::var("VIRTUAL_ENV").ok(), std::env::var("CONDA_PREFIX").ok(), home]
        .into_iter()
        .flatten()
        .chain(["/usr/local", "/usr", "/opt/conda"].map(String::from));
    for base in bases {
        let Ok(entries) = std::fs::read_dir(format!("{base}/lib")) else { continue };
        let mut pythons: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("python3")))
            .collect();
        pythons.sort();
        for python in pythons {
            for packages in ["site-packages", "dist-packages"] {
                let lib = python.join(packages).join("nvidia/cudnn/lib/libcudnn.so.9");
                if lib.is_file() {
                    names.push(lib.to_string_lossy().into_owned());
                }
            }
        }
    }
    names
}

/// cuDNN's table, opened on first use (the outcome, found or not, is kept for the process).
pub(crate) fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(open).as_ref().map_err(|why| err(why.clone()))
}

/// A symbol of `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the C signature of the symbol `name` in cuDNN's headers.
unsafe fn symbol<F: Copy>(lib: &libloading::Library, name: &str) -> std::result::Result<F, String> {
    let mut bytes = name.as_bytes().to_vec();
    bytes.push(0);
    // SAFETY: the caller's contract (the type is the symbol's signature).
    unsafe { lib.get::<F>(&bytes) }.map(|s| *s).map_err(|e| format!("cuDNN lacks {name}: {e}"))
}

fn open() -> std::result::Result<Api, String> {
    let mut tried = Vec::new();
    let mut found = None;
    for name in candidates() {
        // SAFETY: loading cuDNN runs its initialisers, which set up only cuDNN's own state.
        match unsafe { libloading::Library::new(&name) } {
            Ok(lib) => {
                found = Some(lib);
                break;
            }
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    let lib = found.ok_or_else(|| {
        format!(
            "GPU convolutions need cuDNN 9 (or 8.9), which was not found: `pip install nvidia-cudnn-cu12` (or \
             -cu13, the wheel PyTorch installs), a system cuDNN on LD_LIBRARY_PATH, or WICK_CUDNN=/path/to/\
             libcudnn.so.9; WICK_CUDNN=off runs candle's own (slower) convolutions instead. Tried: {}",
            tried.join("; ")
        )
    })?;
    // SAFETY: each type below is the C signature of its symbol in cuDNN 8.9/9.x's headers
    // (cudnn_graph.h, cudnn_ops.h, cudnn_cnn.h; enums are C ints).
    unsafe {
        let version: unsafe extern "C" fn() -> usize = symbol(&lib, "cudnnGetVersion")?;
        let version = version();
        if version < 8900 {
            return Err(format!("cuDNN {version} is older than 8.9, the oldest wick supports"));
        }
        Ok(Api {
            version,
            error_string: symbol(&lib, "cudnnGetErrorString")?,
            create: symbol(&lib, "cudnnCreate")?,
            set_stream: symbol(&lib, "cudnnSetStream")?,
            create_tensor: symbol(&lib, "cudnnCreateTensorDescriptor")?,
            set_tensor_4d: symbol(&lib, "cudnnSetTensor4dDescriptor")?,
            destroy_tensor: symbol(&lib, "cudnnDestroyTensorDescriptor")?,
            create_filter: symbol(&lib, "cudnnCreateFilterDescriptor")?,
            set_filter_4d: symbol(&lib, "cudnnSetFilter4dDescriptor")?,
            destroy_filter: symbol(&lib, "cudnnDestroyFilterDescriptor")?,
            create_conv: symbol(&lib, "cudnnCreateConvolutionDescriptor")?,
            set_conv_2d: symbol(&lib, "cudnnSetConvolution2dDescriptor")?,
            set_group_count: symbol(&lib, "cudnnSetConvolutionGroupCount")?,
            set_math_type: symbol(&lib, "cudnnSetConvolutionMathType")?,
            destroy_conv: symbol(&lib, "cudnnDestroyConvolutionDescriptor")?,
            algos: [
                symbol(&lib, "cudnnGetConvolutionForwardAlgorithm_v7")?,
                symbol(&lib, "cudnnGetConvolutionBackwardDataAlgorithm_v7")?,
                symbol(&lib, "cudnnGetConvolutionBackwardFilterAlgorithm_v7")?,
            ],
            workspace: [
                symbol(&lib, "cudnnGetConvolutionForwardWorkspaceSize")?,
                symbol(&lib, "cudnnGetConvolutionBackwardDataWorkspaceSize")?,
                symbol(&lib, "cudnnGetConvolutionBackwardFilterWorkspaceSize")?,
            ],
            run: [
                symbol(&lib, "cudnnConvolutionForward")?,
                symbol(&lib, "cudnnConvolutionBackwardData")?,
                symbol(&lib, "cudnnConvolutionBackwardFilter")?,
            ],
            _lib: lib,
        })
    }
}

/// True unless `WICK_CUDNN=off` asks for candle's own convolutions on a GPU (an A/B switch, and
/// the way to run without cuDNN).
pub(crate) fn wanted() -> bool {
    static WANTED: OnceLock<bool> = OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("WICK_CUDNN").map_or(true, |v| v != "off"))
}
