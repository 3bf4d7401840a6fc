//! `wick fetch REPO`: a model repository from the Hugging Face hub into the hub's cache
//! (`wick_zoo::hub::fetch`: pre-flight of disk and memory, resumed and checksummed transfers,
//! atomic placement), with a progress bar on a terminal.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use wick_zoo::hub::{fetch, FetchEvent, FetchOptions, FileSelection};

/// `wick fetch` arguments.
#[derive(Debug, Args)]
pub struct FetchArgs {
    /// The repository (`owner/name`).
    pub repo: String,
    /// Only these files (repeatable); default: the configuration, tokenizer and `.safetensors`
    /// weights.
    #[arg(long = "file", conflicts_with = "all")]
    pub files: Vec<String>,
    /// Every file of the repository (other weight formats too).
    #[arg(long)]
    pub all: bool,
    /// Branch, tag or commit.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// The hub cache (default: `HF_HUB_CACHE`, `HF_HOME/hub`, `~/.cache/huggingface/hub`).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// The hub (default: `HF_ENDPOINT`, else `https://huggingface.co`).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Skip the memory check of the weights against this machine (download for elsewhere).
    #[arg(long)]
    pub no_memory_check: bool,
    /// Skip every pre-flight (disk and memory).
    #[arg(long)]
    pub no_preflight: bool,
    /// Retries of an interrupted transfer, each from where it stopped.
    #[arg(long, default_value_t = 3)]
    pub retries: usize,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `wick fetch`.
pub fn run(args: &FetchArgs) -> Result<()> {
    let files = match (args.all, args.files.is_empty()) {
        (true, _) => FileSelection::All,
        (false, true) => FileSelection::Loadable,
        (false, false) => FileSelection::Named(args.files.clone()),
    };
    let options = FetchOptions {
        endpoint: args.endpoint.clone(),
        cache: args.cache.clone(),
        revision: args.revision.clone(),
        files,
        preflight: !args.no_preflight,
        retries: args.retries,
        ..FetchOptions::default()
    };
    let engine = (!args.no_memory_check && !args.no_preflight).then(wick::Engine::cpu);
    let bar = if std::io::IsTerminal::is_terminal(&std::io::stderr()) && !args.json {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:30!} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let fetched = fetch(&args.repo, &options, engine.as_ref(), &mut |e| match e {
        FetchEvent::Planned { files, cached, bytes } => {
            bar.set_length(bytes);
            bar.println(format!(
                "{}: {files} files, {cached} already cached, {} to download",
                args.repo,
                wick::memory::format_bytes(bytes)
            ));
        }
        FetchEvent::Started { file, resumed_at, .. } => {
            if resumed_at > 0 {
                bar.println(format!("{file}: resuming at {}", wick::memory::format_bytes(resumed_at)));
            }
            bar.set_message(file);
        }
        FetchEvent::Progress(n) => bar.inc(n),
        FetchEvent::Waiting { file } => {
            bar.println(format!("{file}: another process is downloading it; waiting for it"));
        }
        FetchEvent::Retrying { file, at, why } => {
            bar.println(format!("{file}: interrupted at {} ({why}); retrying", wick::memory::format_bytes(at)));
        }
        FetchEvent::Done { .. } => {}
    });
    bar.finish_and_clear();
    let fetched = fetched?;
    let seconds = start.elapsed().as_secs_f64();
    if args.json {
        let mut v = serde_json::to_value(&fetched)?;
        v["seconds"] = serde_json::json!(seconds);
        println!("{v}");
    } else {
        let rate = fetched.downloaded_bytes as f64 / seconds.max(1e-9);
        println!(
            "{} at {}: {} downloaded in {:.1} s ({}/s)\n{}",
            args.repo,
            fetched.commit,
            wick::memory::format_bytes(fetched.downloaded_bytes),
            seconds,
            wick::memory::format_bytes(rate as u64),
            fetched.snapshot.display()
        );
    }
    Ok(())
}
