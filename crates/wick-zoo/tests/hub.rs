//! `wick_zoo::hub::fetch` against a hub-shaped HTTP server on 127.0.0.1 (`support/hub_server.py`)
//! serving the real all-MiniLM-L6-v2 files: a fetch lands in the hub's cache layout where
//! `hf_cache_snapshot` finds it, byte for byte; an interrupted transfer resumes from where it
//! stopped; a wrong checksum, a full disk, a too-small memory budget and a hostile listing are
//! clear errors with nothing half-written where a reader would take it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use wick::memory::MemoryLimit;
use wick_zoo::hub::{fetch, FetchEvent, FetchOptions, FileSelection};

const REPO: &str = "sentence-transformers/all-MiniLM-L6-v2";
const WEIGHTS: &str = "model.safetensors";

#[path = "support/hub.rs"]
mod hub;

use hub::Hub;

fn serve(dir: &Path, faults: &[&str]) -> Option<Hub> {
    hub::serve(dir, REPO, faults)
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn options(hub: &Hub, cache: &Path) -> FetchOptions {
    FetchOptions {
        endpoint: Some(hub.endpoint.clone()),
        cache: Some(cache.to_path_buf()),
        token: Some(String::new()),
        ..FetchOptions::default()
    }
}

/// The repository's folder in the cache, and every file under it (relative), sorted.
fn tree(cache: &Path) -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                walk(&p, root, out);
            } else {
                out.push(p.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(cache, cache, &mut out);
    out.sort();
    out
}

#[test]
fn a_fetch_lands_in_the_hub_cache_byte_for_byte_and_a_second_downloads_nothing() {
    let Some(src) = common::minilm_dir() else { return };
    let Some(hub) = serve(&src, &[]) else { return };
    let cache = temp("plain");
    let mut seen = Vec::new();
    let got = fetch(REPO, &options(&hub, &cache), None, &mut |e| seen.push(e)).unwrap();
    let names: Vec<&str> = got.files.iter().map(|f| f.name.as_str()).collect();
    for expected in ["config.json", "model.safetensors", "tokenizer.json", "vocab.txt"] {
        assert!(names.contains(&expected), "{names:?}");
    }
    assert!(got.files.iter().all(|f| f.downloaded));
    assert_eq!(got.downloaded_bytes, got.files.iter().map(|f| f.size).sum::<u64>());
    assert!(matches!(seen[0], FetchEvent::Planned { cached: 0, .. }), "{:?}", seen[0]);
    // Found by the offline reader, and the same bytes as served.
    let dir = wick_zoo::weights::hf_cache_snapshot(Some(&cache), REPO, &["config.json", WEIGHTS]).unwrap();
    assert_eq!(dir, got.snapshot);
    for f in &got.files {
        assert_eq!(std::fs::read(dir.join(&f.name)).unwrap(), std::fs::read(src.join(&f.name)).unwrap(), "{}", f.name);
    }
    assert!(std::fs::symlink_metadata(dir.join(WEIGHTS)).unwrap().file_type().is_symlink());
    let main = cache.join("models--sentence-transformers--all-MiniLM-L6-v2/refs/main");
    assert_eq!(std::fs::read_to_string(main).unwrap(), got.commit);
    // The model loads from it.
    let model = wick_zoo::bert::SentenceEmbedder::load(&dir, candle_core::DType::F32, &candle_core::Device::Cpu);
    assert!(model.is_ok());
    // Again: everything is in the cache.
    let again = fetch(REPO, &options(&hub, &cache), None, &mut |_| {}).unwrap();
    assert_eq!(again.downloaded_bytes, 0);
    assert!(again.files.iter().all(|f| !f.downloaded));
    // Named files only; a name the repository lacks is an error.
    let cache2 = temp("named");
    let opts = FetchOptions { files: FileSelection::Named(vec!["config.json".into()]), ..options(&hub, &cache2) };
    assert_eq!(fetch(REPO, &opts, None, &mut |_| {}).unwrap().files.len(), 1);
    let opts = FetchOptions { files: FileSelection::Named(vec!["nope.bin".into()]), ..options(&hub, &cache2) };
    let err = fetch(REPO, &opts, None, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("nope.bin") && err.contains("no such file"), "{err}");
    for c in [cache, cache2] {
        let _ = std::fs::remove_dir_all(c);
    }
}

#[test]
fn an_interrupted_transfer_resumes_from_where_it_stopped() {
    let Some(src) = common::minilm_dir() else { return };
    let size = std::fs::metadata(src.join(WEIGHTS)).unwrap().len();
    // Cut once at 10 MB: the retry asks for the rest.
    let Some(hub) = serve(&src, &["--interrupt", "model.safetensors:10000000:1"]) else { return };
    let cache = temp("resume");
    let mut seen = Vec::new();
    let opts = FetchOptions { files: FileSelection::Named(vec![WEIGHTS.into()]), ..options(&hub, &cache) };
    let got = fetch(REPO, &opts, None, &mut |e| seen.push(e)).unwrap();
    let retry = seen.iter().find_map(|e| match e {
        FetchEvent::Retrying { at, .. } => Some(*at),
        _ => None,
    });
    assert_eq!(retry, Some(10_000_000), "{seen:?}");
    assert_eq!(got.downloaded_bytes, size, "the retry continued; it did not start over");
    assert_eq!(std::fs::read(got.snapshot.join(WEIGHTS)).unwrap(), std::fs::read(src.join(WEIGHTS)).unwrap());
    drop(hub);
    // Cut every time: the fetch gives up, and keeps what it has where no reader looks.
    let Some(hub) = serve(&src, &["--interrupt", "model.safetensors:20000000:100"]) else { return };
    let cache = temp("resume-later");
    let opts = FetchOptions { files: FileSelection::Named(vec![WEIGHTS.into()]), retries: 1, ..options(&hub, &cache) };
    let err = fetch(REPO, &opts, None, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("interrupted at 20000000") && err.contains("resumes"), "{err}");
    let files = tree(&cache);
    assert!(files.iter().all(|f| !f.contains("snapshots") && !f.contains("refs")), "{files:?}");
    assert!(files.iter().any(|f| f.ends_with(".incomplete")), "{files:?}");
    drop(hub);
    // A later fetch from a sound server resumes the partial file.
    let Some(hub) = serve(&src, &[]) else { return };
    let mut seen = Vec::new();
    let opts = FetchOptions { files: FileSelection::Named(vec![WEIGHTS.into()]), ..options(&hub, &cache) };
    let got = fetch(REPO, &opts, None, &mut |e| seen.push(e)).unwrap();
    assert!(seen.iter().any(|e| matches!(e, FetchEvent::Started { resumed_at: 20_000_000, .. })), "{seen:?}");
    assert_eq!(got.downloaded_bytes, size - 20_000_000);
    assert_eq!(std::fs::read(got.snapshot.join(WEIGHTS)).unwrap(), std::fs::read(src.join(WEIGHTS)).unwrap());
    assert!(tree(&cache).iter().all(|f| !f.ends_with(".incomplete")));
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_wrong_checksum_is_an_error_and_nothing_is_cached() {
    let Some(src) = common::minilm_dir() else { return };
    let Some(hub) = serve(&src, &["--corrupt", "model.safetensors"]) else { return };
    let cache = temp("corrupt");
    let err = fetch(REPO, &options(&hub, &cache), None, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("checksum mismatch") && err.contains(WEIGHTS), "{err}");
    let files = tree(&cache);
    // The files before it may be in place; the weights are nowhere, and no ref names the commit.
    assert!(files.iter().all(|f| !f.ends_with(".incomplete") && !f.contains("refs/")), "{files:?}");
    assert!(files.iter().all(|f| !f.ends_with(WEIGHTS)), "{files:?}");
    assert!(wick_zoo::weights::hf_cache_snapshot(Some(&cache), REPO, &[WEIGHTS]).is_err());
    let _ = std::fs::remove_dir_all(&cache);
}

/// A small tmpfs at `dir` (root only); `None`, loudly, where it cannot be mounted.
fn tmpfs(dir: &Path, size: &str) -> Option<()> {
    let ok = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(dir).status();
    if !matches!(ok, Ok(s) if s.success()) {
        eprintln!("\n!!!!!!!! SKIPPED: cannot mount a tmpfs (needs root); the full-disk checks did not run\n");
        return None;
    }
    Some(())
}

#[test]
fn a_full_disk_is_refused_before_downloading_or_stops_cleanly() {
    let Some(src) = common::minilm_dir() else { return };
    let Some(hub) = serve(&src, &[]) else { return };
    let cache = temp("full");
    if tmpfs(&cache, "8m").is_none() {
        return;
    }
    let result = std::panic::catch_unwind(|| {
        // Pre-flight: 90 MB of weights on an 8 MiB file system: nothing is downloaded.
        let err = fetch(REPO, &options(&hub, &cache), None, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("not enough disk space") && err.contains("nothing was downloaded"), "{err}");
        assert!(
            tree(&cache).iter().all(|f| !f.contains("incomplete") && !f.contains("snapshots")),
            "{:?}",
            tree(&cache)
        );
        // Without the pre-flight the disk fills mid-transfer: an error naming the file, the
        // partial download kept where no reader takes it.
        let opts = FetchOptions {
            preflight: false,
            files: FileSelection::Named(vec![WEIGHTS.into()]),
            ..options(&hub, &cache)
        };
        let err = fetch(REPO, &opts, None, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("No space left on device") && err.contains(".incomplete"), "{err}");
        assert!(wick_zoo::weights::hf_cache_snapshot(Some(&cache), REPO, &[WEIGHTS]).is_err());
    });
    let _ = Command::new("umount").arg(&cache).status();
    let _ = std::fs::remove_dir_all(&cache);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn weights_over_the_memory_budget_are_refused_before_downloading() {
    let Some(src) = common::minilm_dir() else { return };
    let Some(hub) = serve(&src, &[]) else { return };
    let cache = temp("memory");
    let mut engine = wick::Engine::cpu();
    engine.set_memory_limit(Some(MemoryLimit::Bytes(engine.allocated().bytes + (16 << 20)))).unwrap();
    let err = fetch(REPO, &options(&hub, &cache), Some(&engine), &mut |_| {}).unwrap_err();
    let text = err.to_string();
    assert!(matches!(&err, wick_zoo::ZooError::Nn(wick_nn::NnError::Memory(e)) if e.is_out_of_memory()), "{text}");
    assert!(text.contains("before downloading"), "{text}");
    assert!(tree(&cache).iter().all(|f| !f.contains("incomplete") && !f.contains("snapshots")));
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn unknown_repositories_unreachable_hubs_and_hostile_listings_are_clear_errors() {
    let Some(src) = common::minilm_dir() else { return };
    let cache = temp("errors");
    {
        let Some(hub) = serve(&src, &[]) else { return };
        let err = fetch("someone/else", &options(&hub, &cache), None, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("404"), "{err}");
        let opts = FetchOptions { revision: "v9".into(), ..options(&hub, &cache) };
        assert!(fetch(REPO, &opts, None, &mut |_| {}).unwrap_err().to_string().contains("404"));
        for bad in ["../up", "a/b/c", ""] {
            let err = fetch(bad, &options(&hub, &cache), None, &mut |_| {}).unwrap_err().to_string();
            assert!(err.contains("not a repository id"), "{err}");
        }
        let opts = FetchOptions { revision: "../../etc".into(), ..options(&hub, &cache) };
        assert!(fetch(REPO, &opts, None, &mut |_| {}).unwrap_err().to_string().contains("not a revision"));
    }
    {
        let Some(hub) = serve(&src, &["--evil-name"]) else { return };
        let opts = FetchOptions { files: FileSelection::All, ..options(&hub, &cache) };
        let err = fetch(REPO, &opts, None, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("outside the repository"), "{err}");
    }
    // Nothing listens there any more.
    let opts = FetchOptions { endpoint: Some("http://127.0.0.1:9".into()), ..FetchOptions::default() };
    let opts = FetchOptions { cache: Some(cache.clone()), timeout: std::time::Duration::from_secs(5), ..opts };
    let err = fetch(REPO, &opts, None, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("cannot reach the hub"), "{err}");
    assert!(!tree(&cache).iter().any(|f| f.contains("snapshots")));
    let _ = std::fs::remove_dir_all(&cache);
}
