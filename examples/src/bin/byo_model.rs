//! A candle-transformers model governed by wick: the caching heap, an engine, weights through
//! wick's loader, layers labelled by their spans. `byo-model-alone` runs the same model without
//! wick; see `wick_examples::byo_model` for both.

use clap::Parser;
use wick_examples::byo_model::{run as time, ByoArgs};

fn run() -> anyhow::Result<()> {
    let args = ByoArgs::parse();
    if !args.no_labels {
        wick::span_labels::install()?;
    }
    let engine = wick_examples::open_engine(&args.device, args.cap_mib.map(|m| m << 20))?;
    let result = time(&args, Some(&engine));
    if let Err(e) = &result {
        // A refusal or a device out-of-memory is reported as such, with the engine's figures.
        let oom = e.chain().any(|c| {
            c.downcast_ref::<candle_core::Error>().is_some_and(wick::is_out_of_memory)
                || c.downcast_ref::<wick_zoo::ZooError>().is_some_and(
                    |z| matches!(z, wick_zoo::ZooError::Nn(wick_nn::NnError::Memory(m)) if m.is_out_of_memory()),
                )
        });
        eprintln!("{}: {e:#}\n{}", if oom { "out of memory, as an error" } else { "failed" }, engine.memory_summary());
    }
    result
}

wick::main!(run);
