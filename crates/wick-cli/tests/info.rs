//! `wick info` and `wick --version`: the report's figures agree with the kernel's own files, the
//! allocator policy follows `WICK_ALLOC_CONF` then `PYTORCH_CUDA_ALLOC_CONF`, the GPU line says
//! why there is none, and bad arguments say what was expected.

use std::process::Command;

fn wick(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wick"));
    cmd.args(args).env_remove("WICK_ALLOC_CONF").env_remove("PYTORCH_CUDA_ALLOC_CONF");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("wick runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn info_json(env: &[(&str, &str)]) -> serde_json::Value {
    let (ok, out, err) = wick(&["info", "--json"], env);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn info_reports_the_machine_as_the_kernel_does() {
    let info = info_json(&[]);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib = |key: &str| -> u64 {
        let line = meminfo.lines().find(|l| l.starts_with(key)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    };
    assert_eq!(info["host"]["total_bytes"].as_u64(), Some(kib("MemTotal:")));
    let cores = std::thread::available_parallelism().unwrap().get() as u64;
    assert_eq!(info["cpu"]["usable_cores"].as_u64(), Some(cores));
    assert_eq!(info["wick_version"], env!("CARGO_PKG_VERSION"));
    // The GPU report: devices exactly when the driver answered, a reason otherwise.
    let gpus = &info["gpus"];
    let devices = gpus["devices"].as_array().unwrap();
    match gpus["state"].as_str().unwrap() {
        "ok" => assert!(!devices.is_empty() && gpus["driver_version"].is_string()),
        "no_driver" | "no_device" => assert!(devices.is_empty() && gpus["detail"].is_string(), "{gpus}"),
        other => panic!("unknown state {other}"),
    }
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        assert_eq!(gpus["state"], "no_driver", "{gpus}");
    }
    // The text form has every section.
    let (ok, text, _) = wick(&["info"], &[]);
    assert!(ok);
    for section in ["CPU", "memory", "cgroup", "/dev/shm", "GPUs", "allocator", "candle"] {
        assert!(text.lines().any(|l| l.starts_with(section)), "no {section} line in\n{text}");
    }
}

#[test]
fn the_allocator_policy_comes_from_wick_alloc_conf_then_pytorch_s_variable() {
    let policy = |env: &[(&str, &str)]| info_json(env)["allocator"].clone();
    let none = policy(&[]);
    assert!(none["variable"].is_null());
    assert_eq!(none["policy"]["Ok"], wick::machine::DEFAULT_POLICY);
    let torch = policy(&[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")]);
    assert_eq!(torch["variable"], "PYTORCH_CUDA_ALLOC_CONF");
    assert_eq!(torch["policy"]["Ok"], "classic segments (expandable_segments off)");
    let both = policy(&[
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),
        ("WICK_ALLOC_CONF", "max_split_size_mb:64"),
    ]);
    assert_eq!(both["variable"], "WICK_ALLOC_CONF");
    assert_eq!(both["policy"]["Ok"], "max_split_size 64.00 MiB");
    let bad = policy(&[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")]);
    assert!(bad["policy"]["Err"].as_str().unwrap().contains("unknown key `backend`"), "{bad}");
}

#[test]
fn version_and_bad_arguments() {
    let (ok, out, _) = wick(&["--version"], &[]);
    assert!(ok && out.trim() == format!("wick {}", env!("CARGO_PKG_VERSION")), "{out}");
    let (ok, _, err) = wick(&["info", "--bogus"], &[]);
    assert!(!ok && err.contains("--bogus"), "{err}");
    let (ok, _, err) = wick(&["nosuch"], &[]);
    assert!(!ok && err.contains("nosuch") && err.contains("info"), "{err}");
}
