//! What the `wick` binary's test files share.

use std::path::Path;
use std::process::Command;

/// Runs `wick ARGS` with the job registry in `registry` (a folder of the test's own); whether it
/// succeeded, and its stdout and stderr together.
pub fn wick_in(registry: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wick"))
        .args(args)
        .env("WICK_OUTPUT_DIR", registry)
        .output()
        .expect("wick runs");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}
