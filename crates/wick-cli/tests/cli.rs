//! The `wick` command refuses settings it cannot honour with a clear message and a failing exit
//! status, and never panics on them.

use std::process::Command;

fn wick(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wick")).args(args).output().expect("the wick binary runs");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

const TRACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../wick-trace/traces/cnn-train.json");

#[test]
fn replay_refuses_capacities_and_settings_out_of_range() {
    for (capacity, config) in
        [("1e11", ""), ("0", ""), ("NaN", ""), ("-3", ""), ("80", "roundup_power2_divisions:36028797018963968")]
    {
        let (ok, text) = wick(&["replay", TRACE, &format!("--capacity-gib={capacity}"), "--config", config]);
        assert!(!ok, "accepted --capacity-gib {capacity} --config {config}: {text}");
        assert!(!text.contains("panicked"), "{text}");
        assert!(text.contains("capacity-gib") || text.contains("roundup_power2_divisions"), "{text}");
    }
    // The largest simulated device and expandable segments: replays (checked address arithmetic).
    let (ok, text) = wick(&["replay", TRACE, "--capacity-gib", "1.6e10", "--config", "expandable_segments:True"]);
    assert!(ok, "{text}");
}

/// Runs `wick` with exactly these allocator variables set (both cleared otherwise).
fn wick_with_conf(args: &[&str], vars: &[(&str, &str)]) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_wick"));
    command.args(args).env_remove("WICK_ALLOC_CONF").env_remove("PYTORCH_CUDA_ALLOC_CONF");
    for (name, value) in vars {
        command.env(name, value);
    }
    let out = command.output().expect("the wick binary runs");
    // The replay's figures without its speed (which differs between runs).
    let figures: Vec<&str> = std::str::from_utf8(&out.stdout)
        .expect("utf-8 output")
        .lines()
        .filter(|line| !line.contains("ops_per_sec"))
        .collect();
    (out.status.success(), figures.join("\n"), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn replay_takes_its_policy_from_the_environment_unless_given_one() {
    let replay = ["replay", TRACE, "--capacity-gib", "2", "--json"];
    // Classic segments: not wick's default (expandable segments), and a different replay.
    let with_option: Vec<&str> = replay.iter().copied().chain(["--config", "expandable_segments:False"]).collect();
    let (ok, defaults, stderr) = wick_with_conf(&replay, &[]);
    assert!(ok && stderr.contains("wick's defaults"), "{stderr}");
    let (ok, classic, stderr) = wick_with_conf(&with_option, &[]);
    assert!(ok && stderr.contains("from --config"), "{stderr}");
    assert_ne!(defaults, classic, "classic segments changed nothing in the replay");
    // PyTorch's variable is read when wick's is not set, and wick's takes precedence over it.
    let (ok, from_torch, stderr) = wick_with_conf(&replay, &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")]);
    assert!(ok && stderr.contains("from PYTORCH_CUDA_ALLOC_CONF"), "{stderr}");
    assert_eq!(from_torch, classic);
    let both = [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"), ("WICK_ALLOC_CONF", "")];
    let (ok, from_wick, stderr) = wick_with_conf(&replay, &both);
    assert!(ok && stderr.contains("from WICK_ALLOC_CONF"), "{stderr}");
    assert_eq!(from_wick, defaults);
    // --config wins over the environment.
    let (ok, overridden, _) = wick_with_conf(&with_option, &[("WICK_ALLOC_CONF", "max_split_size_mb:64")]);
    assert!(ok);
    assert_eq!(overridden, classic);
    // A bad setting in the environment is refused, naming the variable, not ignored.
    let (ok, _, stderr) = wick_with_conf(&replay, &[("WICK_ALLOC_CONF", "expandable_segments:maybe")]);
    assert!(!ok && stderr.contains("WICK_ALLOC_CONF") && !stderr.contains("panicked"), "{stderr}");
}
