//! The candle-transformers model of `byo-model` as a candle user runs it without wick: the
//! system allocator, candle's memory-mapped `VarBuilder`, no subscriber.

use clap::Parser;
use wick_examples::byo_model::{run, ByoArgs};

fn main() -> anyhow::Result<()> {
    run(&ByoArgs::parse(), None)
}
