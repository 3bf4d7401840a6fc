//! The GPU check of wick-nn's CUDA op bodies, in its `--host` mode: every composed form it times
//! on a GPU, on the inputs it checks there (masks, tables, ids, kinks), against the host bodies on
//! the CPU. A device run is one short shot; this keeps its harness right between runs.

use std::process::Command;

#[test]
fn the_gpu_checks_harness_agrees_with_the_host_bodies() {
    let out = Command::new(env!("CARGO_BIN_EXE_nn-gpu-check"))
        .arg("--host")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run nn-gpu-check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "nn-gpu-check --host failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let passed = stdout.lines().filter(|l| l.starts_with("PASS ")).count();
    // 31 cases × their sizes × 4 dtypes, and batch norm's running estimates.
    assert_eq!(passed, 329, "{stdout}");
    assert!(!stdout.lines().any(|l| l.starts_with("FAIL ")), "{stdout}");
}
