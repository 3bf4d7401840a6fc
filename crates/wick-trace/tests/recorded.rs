//! The recorded zoo training runs in `traces/recorded/` (a real training step's heap history,
//! exported as a trace by `zoo-speed --record-history`): each replays on the simulated device
//! under PyTorch's classic policy and under wick's default (expandable segments), asks both for
//! the same bytes, and the default never reserves more at the peak (BENCHMARKS.md, issue 16).

use wick_memory::AllocatorConfig;
use wick_trace::{replay_simulated, Trace};

const MODELS: [&str; 6] = ["bert", "decoder", "mobilenet_v2", "resnet18", "resnet50", "vit"];

#[test]
fn recorded_runs_replay_and_expandable_segments_never_reserve_more() {
    for model in MODELS {
        let path = format!("{}/traces/recorded/{model}-train.json", env!("CARGO_MANIFEST_DIR"));
        let trace = Trace::from_file(std::path::Path::new(&path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(trace.ops.len() > 1000, "{model}: {} ops", trace.ops.len());
        let run = |config| replay_simulated(&trace, 80 << 30, config).unwrap_or_else(|e| panic!("{model}: {e}"));
        let (classic, expandable) = (run(AllocatorConfig::pytorch()), run(AllocatorConfig::default()));
        println!(
            "{model}: requested {} B; reserved classic {} B ({:.3}), expandable {} B ({:.3})",
            classic.peak_requested,
            classic.peak_reserved,
            classic.fragmentation,
            expandable.peak_reserved,
            expandable.fragmentation
        );
        assert_eq!((classic.ooms, expandable.ooms), (0, 0), "{model}");
        assert_eq!(classic.peak_requested, expandable.peak_requested, "{model}: the same requests");
        assert!(
            expandable.peak_reserved <= classic.peak_reserved,
            "{model}: expandable {} > classic {}",
            expandable.peak_reserved,
            classic.peak_reserved
        );
    }
}
