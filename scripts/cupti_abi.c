/* Prints the CUPTI figures that crates/wick/src/cupti_abi.rs writes out by hand, read from the
 * real headers, as `name value` lines in that module's order. scripts/cuda-ci.sh compiles it
 * against the PyPI CUPTI and CUDA headers and diffs the output with
 * crates/wick/src/cupti_abi.expected (which the module's test checks against the Rust side). */
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
#include <cupti.h> /* brings generated_cuda_meta.h: the calls' parameter structs */

#define FIG(name, value) printf("%s %zu\n", name, (size_t)(value))

int main(void) {
    FIG("CUPTI_CB_DOMAIN_DRIVER_API", CUPTI_CB_DOMAIN_DRIVER_API);
    FIG("CUPTI_API_ENTER", CUPTI_API_ENTER);
    FIG("CUPTI_API_EXIT", CUPTI_API_EXIT);
    FIG("CUPTI_SUCCESS", CUPTI_SUCCESS);
    FIG("CBID_cuMemAllocAsync", CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync);
    FIG("CBID_cuMemAllocAsync_ptsz", CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz);
    FIG("CBID_cuMemFreeAsync", CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync);
    FIG("CBID_cuMemFreeAsync_ptsz", CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz);
    FIG("CBID_cuMemAllocFromPoolAsync", CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync);
    FIG("CBID_cuMemAllocFromPoolAsync_ptsz", CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz);
    FIG("sizeof(CUpti_CallbackData)", sizeof(CUpti_CallbackData));
    FIG("CUpti_CallbackData.callbackSite", offsetof(CUpti_CallbackData, callbackSite));
    FIG("CUpti_CallbackData.functionParams", offsetof(CUpti_CallbackData, functionParams));
    FIG("CUpti_CallbackData.functionReturnValue", offsetof(CUpti_CallbackData, functionReturnValue));
    FIG("sizeof(cuMemAllocAsync_params)", sizeof(cuMemAllocAsync_params));
    FIG("cuMemAllocAsync_params.dptr", offsetof(cuMemAllocAsync_params, dptr));
    FIG("cuMemAllocAsync_params.bytesize", offsetof(cuMemAllocAsync_params, bytesize));
    FIG("sizeof(cuMemAllocFromPoolAsync_params)", sizeof(cuMemAllocFromPoolAsync_params));
    FIG("cuMemAllocFromPoolAsync_params.dptr", offsetof(cuMemAllocFromPoolAsync_params, dptr));
    FIG("cuMemAllocFromPoolAsync_params.bytesize", offsetof(cuMemAllocFromPoolAsync_params, bytesize));
    FIG("sizeof(cuMemFreeAsync_params)", sizeof(cuMemFreeAsync_params));
    FIG("cuMemFreeAsync_params.dptr", offsetof(cuMemFreeAsync_params, dptr));
    FIG("sizeof(CUdeviceptr)", sizeof(CUdeviceptr));
    /* The _ptsz variants must share their base call's layout (the callback reads both alike). */
    if (sizeof(cuMemAllocAsync_ptsz_params) != sizeof(cuMemAllocAsync_params) ||
        offsetof(cuMemAllocAsync_ptsz_params, bytesize) != offsetof(cuMemAllocAsync_params, bytesize) ||
        sizeof(cuMemFreeAsync_ptsz_params) != sizeof(cuMemFreeAsync_params) ||
        sizeof(cuMemAllocFromPoolAsync_ptsz_params) != sizeof(cuMemAllocFromPoolAsync_params)) {
        fprintf(stderr, "a _ptsz parameter struct differs from its base call's\n");
        return 1;
    }
    return 0;
}
