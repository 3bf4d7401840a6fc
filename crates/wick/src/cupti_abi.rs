//! The slice of CUPTI's ABI that [`crate::cuda`] uses to see candle's allocations (CUPTI 13's
//! `cupti_callbacks.h`, `cupti_driver_cbid.h` and `generated_cuda_meta.h`): the callback ids of
//! the driver's stream-ordered allocation calls, the callback record, and those calls' parameter
//! structs. The library is opened at run time, so these are written out here rather than
//! generated; `cupti_abi.expected` holds the same figures as `name value` lines, this module's
//! test checks them against it, and CI (`scripts/cuda-ci.sh`) regenerates that file from the
//! real headers with `scripts/cupti_abi.c` and fails on any difference.

// Without the `cuda` feature only the test reads these.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::ffi::{c_char, c_void};

/// `CUPTI_CB_DOMAIN_DRIVER_API`.
pub(crate) const DOMAIN_DRIVER_API: u32 = 1;
/// `CUPTI_API_ENTER`: the callback runs before the driver call.
pub(crate) const API_ENTER: u32 = 0;
/// `CUPTI_API_EXIT`: the callback runs after it (its results are readable).
pub(crate) const API_EXIT: u32 = 1;
/// `CUPTI_SUCCESS`.
pub(crate) const CUPTI_SUCCESS: u32 = 0;

/// `CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync`.
pub(crate) const CBID_MEM_ALLOC_ASYNC: u32 = 598;
/// `CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz`.
pub(crate) const CBID_MEM_ALLOC_ASYNC_PTSZ: u32 = 599;
/// `CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync`.
pub(crate) const CBID_MEM_FREE_ASYNC: u32 = 600;
/// `CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz`.
pub(crate) const CBID_MEM_FREE_ASYNC_PTSZ: u32 = 601;
/// `CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync`.
pub(crate) const CBID_MEM_ALLOC_FROM_POOL_ASYNC: u32 = 611;
/// `CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz`.
pub(crate) const CBID_MEM_ALLOC_FROM_POOL_ASYNC_PTSZ: u32 = 612;

/// The allocation calls: their parameters start with `CUdeviceptr *dptr; size_t bytesize;`.
pub(crate) const ALLOC_CALLS: [u32; 4] = [
    CBID_MEM_ALLOC_ASYNC,
    CBID_MEM_ALLOC_ASYNC_PTSZ,
    CBID_MEM_ALLOC_FROM_POOL_ASYNC,
    CBID_MEM_ALLOC_FROM_POOL_ASYNC_PTSZ,
];
/// The free calls: their parameters start with `CUdeviceptr dptr;`.
pub(crate) const FREE_CALLS: [u32; 2] = [CBID_MEM_FREE_ASYNC, CBID_MEM_FREE_ASYNC_PTSZ];

/// `CUpti_CallbackData`: what a driver-API callback is handed.
#[repr(C)]
pub(crate) struct CallbackData {
    /// `CUpti_ApiCallbackSite callbackSite` ([`API_ENTER`] or [`API_EXIT`]).
    pub callback_site: u32,
    pub function_name: *const c_char,
    /// Points at the call's parameter struct.
    pub function_params: *const c_void,
    /// Points at the call's `CUresult` (valid at exit).
    pub function_return_value: *mut c_void,
    pub symbol_name: *const c_char,
    pub context: *mut c_void,
    pub context_uid: u32,
    pub correlation_data: *mut u64,
    pub correlation_id: u32,
}

/// `cuMemAllocAsync_params` (the `_ptsz` variant has the same fields).
#[repr(C)]
pub(crate) struct MemAllocAsyncParams {
    pub dptr: *mut u64,
    pub bytesize: usize,
    pub stream: *mut c_void,
}

/// `cuMemAllocFromPoolAsync_params`: read through [`MemAllocAsyncParams`], whose fields are its
/// prefix (this struct is here for the layout check and the decoding test).
#[cfg(test)]
#[repr(C)]
pub(crate) struct MemAllocFromPoolAsyncParams {
    pub dptr: *mut u64,
    pub bytesize: usize,
    pub pool: *mut c_void,
    pub stream: *mut c_void,
}

/// `cuMemFreeAsync_params`.
#[repr(C)]
pub(crate) struct MemFreeAsyncParams {
    pub dptr: u64,
    pub stream: *mut c_void,
}

/// A driver call the history records, decoded from a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// An allocation call returned `addr` for `size` bytes (seen at its exit, when it succeeded).
    Alloc { addr: u64, size: usize },
    /// A free call is about to free `addr` (seen at its entry, while the block is still known).
    Free { addr: u64 },
}

/// Decodes a CUPTI callback into the call the history records, if it is one.
///
/// # Safety
/// `data` is null or what CUPTI hands a callback of `domain`: for the driver-API domain a
/// `CUpti_CallbackData` valid for the call, whose `functionParams` points at the parameter
/// struct of the call `cbid` names and whose `functionReturnValue` at its `CUresult`.
pub(crate) unsafe fn decode(domain: u32, cbid: u32, data: *const c_void) -> Option<Call> {
    if domain != DOMAIN_DRIVER_API || data.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    let data = unsafe { &*(data as *const CallbackData) };
    if data.function_params.is_null() {
        return None;
    }
    if ALLOC_CALLS.contains(&cbid) && data.callback_site == API_EXIT {
        // Every allocation call's parameters begin with `dptr` and `bytesize` (checked in CI).
        // SAFETY: `function_params` points at such a struct; `function_return_value` at a
        // `CUresult` (a C enum: 32 bits) when not null.
        let (params, ok) = unsafe {
            let params = &*(data.function_params as *const MemAllocAsyncParams);
            let ret = data.function_return_value as *const u32;
            (params, !ret.is_null() && *ret == 0)
        };
        if ok && !params.dptr.is_null() {
            // SAFETY: a successful allocation call wrote the new address through `dptr`.
            return Some(Call::Alloc { addr: unsafe { *params.dptr }, size: params.bytesize });
        }
    } else if FREE_CALLS.contains(&cbid) && data.callback_site == API_ENTER {
        // SAFETY: a free call's parameters begin with `dptr`.
        return Some(Call::Free { addr: unsafe { (*(data.function_params as *const MemFreeAsyncParams)).dptr } });
    }
    None
}

/// The figures above as `name value` lines, in the order `scripts/cupti_abi.c` prints them.
#[cfg(test)]
fn abi_lines() -> Vec<String> {
    use std::mem::{offset_of, size_of};
    let figures: [(&str, usize); 23] = [
        ("CUPTI_CB_DOMAIN_DRIVER_API", DOMAIN_DRIVER_API as usize),
        ("CUPTI_API_ENTER", API_ENTER as usize),
        ("CUPTI_API_EXIT", API_EXIT as usize),
        ("CUPTI_SUCCESS", CUPTI_SUCCESS as usize),
        ("CBID_cuMemAllocAsync", CBID_MEM_ALLOC_ASYNC as usize),
        ("CBID_cuMemAllocAsync_ptsz", CBID_MEM_ALLOC_ASYNC_PTSZ as usize),
        ("CBID_cuMemFreeAsync", CBID_MEM_FREE_ASYNC as usize),
        ("CBID_cuMemFreeAsync_ptsz", CBID_MEM_FREE_ASYNC_PTSZ as usize),
        ("CBID_cuMemAllocFromPoolAsync", CBID_MEM_ALLOC_FROM_POOL_ASYNC as usize),
        ("CBID_cuMemAllocFromPoolAsync_ptsz", CBID_MEM_ALLOC_FROM_POOL_ASYNC_PTSZ as usize),
        ("sizeof(CUpti_CallbackData)", size_of::<CallbackData>()),
        ("CUpti_CallbackData.callbackSite", offset_of!(CallbackData, callback_site)),
        ("CUpti_CallbackData.functionParams", offset_of!(CallbackData, function_params)),
        ("CUpti_CallbackData.functionReturnValue", offset_of!(CallbackData, function_return_value)),
        ("sizeof(cuMemAllocAsync_params)", size_of::<MemAllocAsyncParams>()),
        ("cuMemAllocAsync_params.dptr", offset_of!(MemAllocAsyncParams, dptr)),
        ("cuMemAllocAsync_params.bytesize", offset_of!(MemAllocAsyncParams, bytesize)),
        ("sizeof(cuMemAllocFromPoolAsync_params)", size_of::<MemAllocFromPoolAsyncParams>()),
        ("cuMemAllocFromPoolAsync_params.dptr", offset_of!(MemAllocFromPoolAsyncParams, dptr)),
        ("cuMemAllocFromPoolAsync_params.bytesize", offset_of!(MemAllocFromPoolAsyncParams, bytesize)),
        ("sizeof(cuMemFreeAsync_params)", size_of::<MemFreeAsyncParams>()),
        ("cuMemFreeAsync_params.dptr", offset_of!(MemFreeAsyncParams, dptr)),
        ("sizeof(CUdeviceptr)", size_of::<u64>()),
    ];
    figures.iter().map(|(name, value)| format!("{name} {value}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn callback(site: u32, params: *const c_void, ret: *mut c_void) -> CallbackData {
        CallbackData {
            callback_site: site,
            function_name: std::ptr::null(),
            function_params: params,
            function_return_value: ret,
            symbol_name: std::ptr::null(),
            context: std::ptr::null_mut(),
            context_uid: 0,
            correlation_data: std::ptr::null_mut(),
            correlation_id: 0,
        }
    }

    fn decode_of(domain: u32, cbid: u32, data: &CallbackData) -> Option<Call> {
        // SAFETY: `data` and what it points at live for the call.
        unsafe { decode(domain, cbid, data as *const CallbackData as *const c_void) }
    }

    #[test]
    fn callbacks_decode_into_the_calls_the_history_records() {
        let mut addr = 0x7f00_0000_1000u64;
        let mut ok = 0u32;
        let mut failed = 2u32; // CUDA_ERROR_OUT_OF_MEMORY
        let alloc = MemAllocAsyncParams { dptr: &mut addr, bytesize: 4096, stream: std::ptr::null_mut() };
        let from_pool = MemAllocFromPoolAsyncParams {
            dptr: &mut addr,
            bytesize: 8192,
            pool: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
        };
        let free = MemFreeAsyncParams { dptr: 0x7f00_0000_2000, stream: std::ptr::null_mut() };
        let p = |x: *const c_void| x;
        let ok_ret = &mut ok as *mut u32 as *mut c_void;
        let exit = callback(API_EXIT, p(&alloc as *const _ as *const c_void), ok_ret);
        let want = Some(Call::Alloc { addr: 0x7f00_0000_1000, size: 4096 });
        assert_eq!(decode_of(DOMAIN_DRIVER_API, CBID_MEM_ALLOC_ASYNC, &exit), want);
        assert_eq!(decode_of(DOMAIN_DRIVER_API, CBID_MEM_ALLOC_ASYNC_PTSZ, &exit), want);
        let pool_exit = callback(API_EXIT, p(&from_pool as *const _ as *const c_void), ok_ret);
        assert_eq!(
            decode_of(DOMAIN_DRIVER_API, CBID_MEM_ALLOC_FROM_POOL_ASYNC, &pool_exit),
            Some(Call::Alloc { addr: 0x7f00_0000_1000, size: 8192 })
        );
        // Not recorded: the entry of an allocation (no address yet), a failed allocation, another
        // domain or call, a free's exit.
        let enter = callback(API_ENTER, p(&alloc as *const _ as *const c_void), ok_ret);
        assert_eq!(decode_of(DOMAIN_DRIVER_API, CBID_MEM_ALLOC_ASYNC, &enter), None);
        let failed_exit =
            callback(API_EXIT, p(&alloc as *const _ as *const c_void), &mut failed as *mut u32 as *mut c_void);
        assert_eq!(decode_of(DOMAIN_DRIVER_API, CBID_MEM_ALLOC_ASYNC, &failed_exit), None);
        assert_eq!(decode_of(2, CBID_MEM_ALLOC_ASYNC, &exit), None);
        assert_eq!(decode_of(DOMAIN_DRIVER_API, 597, &exit), None);
        let free_enter = callback(API_ENTER, p(&free as *const _ as *const c_void), std::ptr::null_mut());
        assert_eq!(
            decode_of(DOMAIN_DRIVER_API, CBID_MEM_FREE_ASYNC, &free_enter),
            Some(Call::Free { addr: 0x7f00_0000_2000 })
        );
        assert_eq!(
            decode_of(DOMAIN_DRIVER_API, CBID_MEM_FREE_ASYNC_PTSZ, &free_enter),
            Some(Call::Free { addr: 0x7f00_0000_2000 })
        );
        let free_exit = callback(API_EXIT, p(&free as *const _ as *const c_void), std::ptr::null_mut());
        assert_eq!(decode_of(DOMAIN_DRIVER_API, CBID_MEM_FREE_ASYNC, &free_exit), None);
        // SAFETY: null data is allowed.
        assert_eq!(unsafe { decode(DOMAIN_DRIVER_API, CBID_MEM_FREE_ASYNC, std::ptr::null()) }, None);
    }

    #[test]
    fn the_abi_matches_the_figures_read_from_cuptis_headers() {
        // `cupti_abi.expected` is what scripts/cupti_abi.c printed when compiled against
        // CUPTI's headers; CI regenerates it and fails when the headers disagree.
        let expected: Vec<String> = include_str!("cupti_abi.expected").lines().map(str::to_string).collect();
        assert_eq!(super::abi_lines(), expected);
    }
}
