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
    let engine = wick::Engine::cpu();
    time(&args, Some(&engine))
}

wick::main!(run);
