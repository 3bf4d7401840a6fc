//! With the `cuda` feature, compiles `src/cuda/*.cu` (the fused AMP and optimizer kernels, and the
//! CUDA bodies of wick-nn's ops) into fatbins that the
//! crate embeds (`wick_kernels::fatbin`): SASS for sm_80 and sm_90 plus compute_90 PTX. The
//! compiler is `$WICK_KERNELS_NVCC` (a real nvcc, e.g. from `../shared/tools/cuda-toolkit-pypi.sh`);
//! without it the crate builds and the kernels report that they were not compiled in.
//!
//! Why fatbins with SASS rather than PTX alone: a driver only JIT-compiles PTX whose ISA version
//! it knows, and nvcc 13.4 writes PTX 9.4, newer than a CUDA 13.0 driver (580) accepts; SASS
//! built by any 13.x toolkit runs on any 13.x driver.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 11] = [
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

fn main() {
    println!("cargo::rustc-check-cfg=cfg(wick_kernels)");
    println!("cargo::rerun-if-env-changed=WICK_KERNELS_NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("src")
        .join("cuda");
    println!("cargo::rerun-if-changed={}", root.display());
    let Some(nvcc) = std::env::var_os("WICK_KERNELS_NVCC") else {
        println!("cargo::warning=WICK_KERNELS_NVCC is not set: the CUDA kernels are not compiled in");
        return;
    };
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    for name in KERNELS {
        let src = root.join(format!("{name}.cu"));
        let dst = out.join(format!("{name}.fatbin"));
        let status = Command::new(&nvcc)
            .args(["-fatbin", "-O3", "-gencode", "arch=compute_80,code=sm_80", "-gencode"])
            .arg("arch=compute_90,code=[sm_90,compute_90]")
            .arg(&src)
            .arg("-o")
            .arg(&dst)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("nvcc failed on {} ({s})", src.display()),
            Err(e) => panic!("cannot run nvcc {:?}: {e}", nvcc),
        }
    }
    println!("cargo::rustc-cfg=wick_kernels");
}
