//! `wick fetch` against a hub-shaped server on 127.0.0.1 (wick-zoo's `tests/support/hub_server.py`):
//! the files land in the hub cache as served, a second run downloads nothing, and a bad request
//! is an error on stderr with a failing exit status.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

#[path = "../../wick-zoo/tests/support/hub.rs"]
mod hub;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-cli-fetch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn wick(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wick")).args(args).output().expect("wick runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn wick_fetch_places_a_repository_in_the_hub_cache() {
    let repo_dir = temp("repo");
    std::fs::write(repo_dir.join("config.json"), br#"{"hidden_size": 8}"#).unwrap();
    let w = candle_core::Tensor::arange(0f32, 4096.0, &candle_core::Device::Cpu).unwrap();
    let tensors: HashMap<String, candle_core::Tensor> = [("w".to_string(), w)].into();
    wick::tensor_files::write_safetensors(&repo_dir.join("model.safetensors"), &tensors).unwrap();
    std::fs::write(repo_dir.join("pytorch_model.bin"), b"not fetched by default").unwrap();
    let Some(server) = hub::serve(&repo_dir, "org/tiny", &[]) else { return };
    let endpoint = server.endpoint.clone();
    let cache = temp("cache");
    let cache_s = cache.display().to_string();
    let base = ["fetch", "org/tiny", "--cache", &cache_s, "--endpoint", &endpoint];
    let (ok, out, err) = wick(&[&base[..], &["--json"]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let names: Vec<&str> = v["files"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names.contains(&"config.json") && names.contains(&"model.safetensors"), "{names:?}");
    let snapshot = PathBuf::from(v["snapshot"].as_str().unwrap());
    for n in names {
        assert_eq!(std::fs::read(snapshot.join(n)).unwrap(), std::fs::read(repo_dir.join(n)).unwrap());
    }
    // Again: nothing to download; the text form says so.
    let (ok, out, err) = wick(&base);
    assert!(ok, "{err}");
    assert!(out.contains(": 0 B downloaded"), "{out}");
    // A file the repository lacks: an error, a failing status.
    let (ok, _, err) = wick(&[&base[..], &["--file", "nope.json"]].concat());
    assert!(!ok && err.contains("nope.json") && err.contains("no such file"), "{err}");
    for d in [repo_dir, cache] {
        let _ = std::fs::remove_dir_all(d);
    }
}
