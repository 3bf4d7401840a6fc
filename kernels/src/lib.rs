//! # wick-kernels
//!
//! wick's compute kernels, without candle's types, as candle keeps its own in `candle-kernels`:
//!
//! - [`cpu`]: the CPU kernels over plain slices (matrix products f32/f64 and bf16 with f32 sums on
//!   AVX512-BF16 or AMX, direct convolutions, vectorised `exp`/`erf`, batch norm's sums, max
//!   pooling's window sweep, the optimizer updates) and the helpers they share; wick-nn and
//!   wick-train wrap them as candle ops;
//! - the CUDA C kernels, `src/cuda/*.cu` beside `src/cpu/` (one layout: the host's kernels in
//!   Rust, the device's in CUDA C): the AMP kernels (multi-tensor unscale with inf/NaN check, the
//!   loss-scale update), the optimizer's step per parameter or multi-tensor (SGD with momentum and
//!   AdamW on an f32 tensor or the f32 master of a low-precision one, writing its model copy; the
//!   arithmetic of [`cpu::optim`] to the bit; the multi-tensor form skipped by a device flag), and
//!   the CUDA bodies of wick-nn's ops
//!   (`nn_act`: the element-wise activations; `nn_norm`: layer and RMS norm; `nn_attention`:
//!   attention in the manner of FlashAttention-2; `nn_rows`: RoPE, cross-entropy, embeddings;
//!   `nn_pool`: max and global average pooling; `nn_batch_norm`: batch norm with its fused
//!   ReLU/ReLU6, the statistics and running estimates on the device; `nn_linear`: the linear
//!   layer's bias rows and bias-gradient sums around cuBLAS's products — each forward and backward); the build script
//!   that compiles them, the compiled fatbins embedded in this crate ([`fatbin`]), and their CPU
//!   references ([`mod@reference`], [`cpu::optim`], and wick-nn's host bodies of the same ops).
//!   Loading and launching them on candle's CUDA device is wick-train's `amp::cuda` and wick-nn's
//!   `native::cuda`. `emu/` (not part of the crate) runs wick-nn's kernels on a host emulator of
//!   CUDA's threads against direct f64 references (`scripts/cuda-ci.sh`), so their indexing and
//!   arithmetic are tested without a GPU;
//! - [`launch`]: the launch figures the host needs — a multi-tensor launch's table of tensors
//!   passed by value, and attention's rows a block and shared memory, which wick-nn's launcher
//!   uses and the emulator's check holds to the same table;
//! - [`step_scalars`]: the block of scalars a multi-tensor optimizer step reads on the device
//!   (its layout, and the host's computation of what the device's `wick_step_scalars` writes).
//!
//! This crate depends on no candle or CUDA crate.
//!
//! With the `cuda` feature and `WICK_KERNELS_NVCC` naming a real nvcc (e.g. from
//! `../shared/tools/cuda-toolkit-pypi.sh`) at build time, each kernel is compiled to a fatbin
//! with SASS for sm_80 and sm_90 plus compute_90 PTX; otherwise [`fatbin`] answers `None` and
//! [`COMPILED`] is false, and callers report that the kernels were not compiled in.

pub mod cpu;
pub mod launch;
pub mod reference;
pub mod step_scalars;

/// The kernels, by the name of their source file (without `.cu`).
pub const KERNELS: [&str; 11] = [
    "amp_unscale",
    "amp_update_scale",
    "optim_step",
    "nn_act",
    "nn_norm",
    "nn_attention",
    "nn_attention_tc",
    "nn_rows",
    "nn_pool",
    "nn_batch_norm",
    "nn_linear",
];

/// True when this build compiled the kernels in.
pub const COMPILED: bool = cfg!(wick_kernels);

/// The compiled fatbin of kernel `name` (one of [`KERNELS`]), when this build has it.
#[cfg(wick_kernels)]
pub fn fatbin(name: &str) -> Option<&'static [u8]> {
    match name {
        "amp_unscale" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/amp_unscale.fatbin"))),
        "amp_update_scale" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/amp_update_scale.fatbin"))),
        "optim_step" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/optim_step.fatbin"))),
        "nn_act" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/nn_act.fatbin"))),
        "nn_norm" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/nn_norm.fatbin"))),
        "nn_attention" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/nn_attention.fatbin"))),
        "nn_attention_tc" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/nn_attention_tc.fatbin"))),
        "nn_rows" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/nn_rows.fatbin"))),
        "nn_pool" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/nn_pool.fatbin"))),
        "nn_batch_norm" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/nn_batch_norm.fatbin"))),
        "nn_linear" => Some(include_bytes!(concat!(env!("OUT_DIR"), "/nn_linear.fatbin"))),
        _ => None,
    }
}

/// The compiled fatbin of kernel `name` (one of [`KERNELS`]), when this build has it.
#[cfg(not(wick_kernels))]
pub fn fatbin(_name: &str) -> Option<&'static [u8]> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_has_its_source_and_a_fatbin_exactly_when_compiled() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join("cuda");
        for name in KERNELS {
            assert!(dir.join(format!("{name}.cu")).is_file(), "{name}.cu is missing");
            assert_eq!(fatbin(name).is_some(), COMPILED, "{name}");
        }
        assert!(fatbin("no_such_kernel").is_none());
    }
}
