//! `wick fetch` against a hub-shaped server on 127.0.0.1 (wick-zoo's `tests/support/hub_server.py`):
//! the files land in the hub cache as served, a second run downloads nothing, a bad request is
//! an error on stderr with a failing exit status, and two processes fetching at once download
//! each file once.

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

/// The resolve requests the server saw for `file`.
fn downloads_of(endpoint: &str, file: &str) -> usize {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1] + '/requests').read().decode())",
        ])
        .arg(endpoint)
        .output()
        .expect("python3 runs");
    let requests: Vec<(String, Option<String>)> = serde_json::from_slice(&out.stdout).expect("the request log");
    requests.iter().filter(|(path, _)| path.contains("/resolve/") && path.ends_with(file)).count()
}

#[test]
fn two_processes_fetching_at_once_download_once_and_both_get_the_files() {
    let repo_dir = temp("race-repo");
    std::fs::write(repo_dir.join("config.json"), br#"{"hidden_size": 8}"#).unwrap();
    let w = candle_core::Tensor::arange(0f32, 65536.0, &candle_core::Device::Cpu).unwrap();
    let tensors: HashMap<String, candle_core::Tensor> = [("w".to_string(), w)].into();
    wick::tensor_files::write_safetensors(&repo_dir.join("model.safetensors"), &tensors).unwrap();
    // The weights take 2 s to send, so the second process asks while the first downloads.
    let Some(server) = hub::serve(&repo_dir, "org/race", &["--slow", "model.safetensors:2"]) else { return };
    let cache = temp("race-cache");
    let cache_s = cache.display().to_string();
    let args = ["fetch", "org/race", "--cache", &cache_s, "--endpoint", &server.endpoint, "--json"];
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_wick"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("wick runs")
    };
    let first = spawn();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let second = spawn();
    let mut downloaded = Vec::new();
    for child in [first, second] {
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let snapshot = PathBuf::from(v["snapshot"].as_str().unwrap());
        for n in ["config.json", "model.safetensors"] {
            assert_eq!(std::fs::read(snapshot.join(n)).unwrap(), std::fs::read(repo_dir.join(n)).unwrap(), "{n}");
        }
        downloaded.push(v["downloaded_bytes"].as_u64().unwrap());
    }
    let size = std::fs::metadata(repo_dir.join("model.safetensors")).unwrap().len();
    assert_eq!(downloads_of(&server.endpoint, "model.safetensors"), 1, "the weights were downloaded more than once");
    assert!(downloaded[0] >= size && downloaded[1] < size, "the second took the first's blob: {downloaded:?}");
    for d in [repo_dir, cache] {
        let _ = std::fs::remove_dir_all(d);
    }
}
