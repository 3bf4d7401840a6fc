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
