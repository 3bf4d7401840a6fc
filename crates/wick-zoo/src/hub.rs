//! Downloading a model repository from the Hugging Face hub into the hub's own cache layout
//! (`models--org--name/{blobs,snapshots,refs}`), so [`crate::weights::hf_cache_snapshot`],
//! Python's `huggingface_hub` and hf-hub find it.
//!
//! What a fetch does, in order:
//! 1. Lists the repository at the revision through hf-hub's API request (its endpoint, user
//!    agent and token) with `blobs=true`: every file's size and checksum (SHA-256 for LFS files,
//!    the git blob id otherwise) and the commit.
//! 2. Pre-flight, before a byte is downloaded: the disk space the missing bytes need on the
//!    cache's file system, and the memory the weights (`.safetensors`) need on the engine given.
//! 3. Downloads each missing file into `blobs/<checksum>.incomplete` (the name `huggingface_hub`
//!    uses) under the blob's lock file (`.locks/…/<checksum>.lock`, `flock`ed as `huggingface_hub`
//!    does: a second process fetching the same blob waits and then uses it), resuming a partial file with an HTTP range request, retrying an interrupted
//!    transfer from where it stopped, hashing as it writes.
//! 4. Checks size and checksum; a mismatch removes the download and is an error. Only then is
//!    the file flushed and renamed to `blobs/<checksum>`, its snapshot link made (atomically), and,
//!    once every file is in place, `refs/<revision>` written (atomically): a reader that follows
//!    the ref never sees a half-written file.
//!
//! Why not hf-hub's own `download`: in 0.4.3 it checks no checksum and no size before moving a
//! file into the cache, links it and writes the ref, so a corrupt transfer is a cached file; and
//! it `unwrap`s on a redirect without a `Location`. Its naming, URLs, cache paths and API request
//! are used as they are.

use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;
use sha2::Digest;

use crate::error::ZooError;

/// The largest repository listing read (a listing is a few kilobytes to a few megabytes).
const MAX_LISTING: u64 = 64 << 20;

/// Bytes read from the network per write.
const CHUNK: usize = 1 << 20;

/// Which files of the repository to fetch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum FileSelection {
    /// What wick loads: the top-level `.json`, `.txt` and `.model` files and the `.safetensors`
    /// weights (not the same weights again as `.bin`, `.h5`, `.onnx`, …).
    #[default]
    Loadable,
    /// Every file.
    All,
    /// These files (an error names any the repository does not have).
    Named(Vec<String>),
}

/// Where and how to fetch.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// The hub (default: `HF_ENDPOINT`, else `https://huggingface.co`).
    pub endpoint: Option<String>,
    /// The hub cache (default: `HF_HUB_CACHE`, then `HF_HOME/hub`, then `~/.cache/huggingface/hub`).
    pub cache: Option<PathBuf>,
    /// Branch, tag or commit (default `main`).
    pub revision: String,
    /// Which files.
    pub files: FileSelection,
    /// The token (default: `HF_TOKEN`, else the hub cache's `token` file; `Some("")`: none).
    pub token: Option<String>,
    /// Check disk space (and memory, with an engine) before downloading (default true).
    pub preflight: bool,
    /// Transfers retried after an interruption, each from where the last stopped (default 3).
    pub retries: usize,
    /// Connect and read timeout.
    pub timeout: Duration,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            endpoint: None,
            cache: None,
            revision: "main".into(),
            files: FileSelection::Loadable,
            token: None,
            preflight: true,
            retries: 3,
            timeout: Duration::from_secs(60),
        }
    }
}

/// What a fetch reports as it goes (for a progress bar).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchEvent {
    /// The plan: files fetched, of them already in the cache, and bytes to download.
    Planned {
        /// Files selected.
        files: usize,
        /// Of them, already in the cache.
        cached: usize,
        /// Bytes still to download (a partial file's bytes are not counted again).
        bytes: u64,
    },
    /// A file's download started (`resumed_at` > 0: continued from a partial file).
    Started {
        /// The file's name in the repository.
        file: String,
        /// Its size.
        size: u64,
        /// Bytes already there.
        resumed_at: u64,
    },
    /// Bytes written since the last event.
    Progress(u64),
    /// Another process is downloading the file (it holds the blob's lock): this one waits, then
    /// takes the blob it placed.
    Waiting {
        /// The file.
        file: String,
    },
    /// A transfer was interrupted and is retried from `at` bytes.
    Retrying {
        /// The file.
        file: String,
        /// Where it resumes.
        at: u64,
        /// What happened.
        why: String,
    },
    /// A file is in place (checked).
    Done {
        /// The file.
        file: String,
    },
}

/// One fetched file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FetchedFile {
    /// Its name in the repository.
    pub name: String,
    /// Its size.
    pub size: u64,
    /// Downloaded now (false: it was in the cache).
    pub downloaded: bool,
}

/// What a fetch did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Fetched {
    /// The snapshot folder: the files under their repository names.
    pub snapshot: PathBuf,
    /// The commit the revision named.
    pub commit: String,
    /// The files.
    pub files: Vec<FetchedFile>,
    /// Bytes downloaded now.
    pub downloaded_bytes: u64,
}

#[derive(Debug, Deserialize)]
struct Listing {
    sha: String,
    siblings: Vec<Sibling>,
}

#[derive(Debug, Deserialize)]
struct Sibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<Lfs>,
}

#[derive(Debug, Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

/// A file to fetch: its name, size and checksum.
#[derive(Debug, Clone)]
struct Wanted {
    name: String,
    size: u64,
    check: Checksum,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Checksum {
    /// LFS files: SHA-256 of the content (and the blob's name in the cache).
    Sha256(String),
    /// Other files: the git blob id, SHA-1 of `blob <size>\0` and the content.
    GitSha1(String),
}

impl Checksum {
    fn hex(&self) -> &str {
        match self {
            Checksum::Sha256(h) | Checksum::GitSha1(h) => h,
        }
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn invalid(what: &str, message: impl std::fmt::Display) -> ZooError {
    ZooError::File { path: PathBuf::from(what), message: message.to_string() }
}

/// A repository id the hub accepts: `name` or `owner/name`, of letters, digits, `-`, `_`, `.`.
fn check_repo_id(id: &str) -> Result<(), ZooError> {
    let parts: Vec<&str> = id.split('/').collect();
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p != "."
            && p != ".."
            && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    if parts.len() > 2 || !parts.iter().all(|p| part_ok(p)) {
        return Err(invalid(id, "not a repository id (`name` or `owner/name` of letters, digits, `-`, `_`, `.`)"));
    }
    Ok(())
}

/// A relative path of plain components (a repository file or a revision): nothing that could
/// climb out of the folder it is joined to.
fn plain_relative(s: &str) -> bool {
    !s.is_empty()
        && !s.contains('\\')
        && !s.contains('\0')
        && Path::new(s).components().all(|c| matches!(c, Component::Normal(_)))
}

fn selected(listing: &Listing, files: &FileSelection) -> Result<Vec<Wanted>, ZooError> {
    let loadable = |name: &str| {
        !name.contains('/') && [".json", ".txt", ".model", ".safetensors"].iter().any(|ext| name.ends_with(ext))
    };
    let mut wanted = Vec::new();
    for s in &listing.siblings {
        let keep = match files {
            FileSelection::All => true,
            FileSelection::Loadable => loadable(&s.rfilename),
            FileSelection::Named(names) => names.contains(&s.rfilename),
        };
        if !keep {
            continue;
        }
        if !plain_relative(&s.rfilename) {
            return Err(invalid(&s.rfilename, "the listing names a file outside the repository"));
        }
        let (size, check) = match (&s.lfs, &s.blob_id, s.size) {
            (Some(lfs), _, _) if is_hex(&lfs.sha256, 64) => (lfs.size, Checksum::Sha256(lfs.sha256.to_lowercase())),
            (None, Some(id), Some(size)) if is_hex(id, 40) => (size, Checksum::GitSha1(id.to_lowercase())),
            _ => return Err(invalid(&s.rfilename, "the listing gives no size and checksum for it")),
        };
        wanted.push(Wanted { name: s.rfilename.clone(), size, check });
    }
    if let FileSelection::Named(names) = files {
        if let Some(missing) = names.iter().find(|n| !wanted.iter().any(|w| w.name == **n)) {
            return Err(invalid(missing, "the repository has no such file"));
        }
    }
    Ok(wanted)
}

/// The hasher of a [`Checksum`], fed as the file is written.
enum Hasher {
    Sha256(sha2::Sha256),
    GitSha1(sha1::Sha1),
}

impl Hasher {
    fn new(check: &Checksum, size: u64) -> Self {
        match check {
            Checksum::Sha256(_) => Hasher::Sha256(sha2::Sha256::new()),
            Checksum::GitSha1(_) => {
                let mut h = sha1::Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Hasher::GitSha1(h)
            }
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::GitSha1(h) => h.update(bytes),
        }
    }

    fn hex(self) -> String {
        let bytes: Vec<u8> = match self {
            Hasher::Sha256(h) => h.finalize().to_vec(),
            Hasher::GitSha1(h) => h.finalize().to_vec(),
        };
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}

mod transfer;

/// Fetches `repo_id` (a model repository) into the hub cache: see the [module](self). With an
/// `engine`, the weights are pre-flighted against what it can still give. Returns the snapshot
/// folder and what was downloaded; `progress` hears of each step.
pub fn fetch(
    repo_id: &str,
    options: &FetchOptions,
    engine: Option<&wick::Engine>,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<Fetched, ZooError> {
    check_repo_id(repo_id)?;
    if !plain_relative(&options.revision) {
        return Err(invalid(&options.revision, "not a revision (a branch, tag or commit)"));
    }
    let root = crate::weights::hub_cache_root(options.cache.as_deref())?;
    let token = match &options.token {
        Some(t) if t.is_empty() => None,
        Some(t) => Some(t.clone()),
        None => std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()).or_else(|| Cache::new(root.clone()).token()),
    };
    let endpoint = options
        .endpoint
        .clone()
        .or_else(|| std::env::var("HF_ENDPOINT").ok())
        .unwrap_or_else(|| "https://huggingface.co".into());
    let endpoint = endpoint.trim_end_matches('/').to_string();
    let api = ApiBuilder::from_cache(Cache::new(root.clone()))
        .with_endpoint(endpoint.clone())
        .with_token(token.clone())
        .with_progress(false)
        .build()
        .map_err(|e| invalid(&endpoint, format!("hub client: {e}")))?;
    let repo = Repo::with_revision(repo_id.to_string(), RepoType::Model, options.revision.clone());
    let listing = transfer::listing(&api.repo(repo.clone()), repo_id, options.timeout)?;
    if !is_hex(&listing.sha, 40) {
        return Err(invalid(repo_id, format!("the hub gave `{}` as the commit", listing.sha)));
    }
    let wanted = selected(&listing, &options.files)?;
    let folder = root.join(repo.folder_name());
    let blobs = folder.join("blobs");
    std::fs::create_dir_all(&blobs).map_err(|e| invalid(&blobs.display().to_string(), e))?;
    let blob = |w: &Wanted| blobs.join(w.check.hex());
    let partial = |w: &Wanted| blobs.join(format!("{}.incomplete", w.check.hex()));
    let cached = |w: &Wanted| std::fs::metadata(blob(w)).is_ok_and(|m| m.len() == w.size);
    let (mut missing, mut n_cached) = (0u64, 0);
    for w in &wanted {
        if cached(w) {
            n_cached += 1;
        } else {
            let have = std::fs::metadata(partial(w)).map_or(0, |m| m.len()).min(w.size);
            missing = missing.saturating_add(w.size - have);
        }
    }
    if options.preflight {
        preflight(&blobs, missing, &wanted, engine, repo_id)?;
    }
    progress(FetchEvent::Planned { files: wanted.len(), cached: n_cached, bytes: missing });
    let client = transfer::Client::new(token.as_deref(), options.timeout);
    let commit_repo = api.repo(Repo::with_revision(repo_id.to_string(), RepoType::Model, listing.sha.clone()));
    let snapshot = folder.join("snapshots").join(&listing.sha);
    let mut files = Vec::new();
    let mut downloaded_bytes = 0;
    let locks = root.join(".locks").join(repo.folder_name());
    for w in &wanted {
        // Asked again: two files of the same content share one blob, placed by the first.
        let mut was_cached = cached(w);
        if !was_cached {
            // One writer per blob across processes; asked again once the lock is ours, since the
            // holder it waited for may have placed the blob.
            let _lock = lock_blob(&locks, w, progress)?;
            was_cached = cached(w);
            if !was_cached {
                let url = commit_repo.url(&w.name);
                downloaded_bytes += client.download(&url, w, &partial(w), &blob(w), options.retries, progress)?;
            }
        }
        transfer::link(&snapshot, &w.name, &blob(w))?;
        progress(FetchEvent::Done { file: w.name.clone() });
        files.push(FetchedFile { name: w.name.clone(), size: w.size, downloaded: !was_cached });
    }
    if options.revision != listing.sha {
        let r = folder.join("refs").join(&options.revision);
        if let Some(parent) = r.parent() {
            std::fs::create_dir_all(parent).map_err(|e| invalid(&parent.display().to_string(), e))?;
        }
        wick::files::write_atomic(&r, listing.sha.as_bytes()).map_err(|e| invalid(&r.display().to_string(), e))?;
    }
    Ok(Fetched { snapshot, commit: listing.sha, files, downloaded_bytes })
}

/// The exclusive lock of blob `w`'s download, `.locks/<repo folder>/<checksum>.lock` under the
/// cache (the file `huggingface_hub` locks, with the same `flock`, so a Python download of the
/// same blob waits too); held until dropped. Waits for another holder, saying so.
fn lock_blob(locks: &Path, w: &Wanted, progress: &mut dyn FnMut(FetchEvent)) -> Result<std::fs::File, ZooError> {
    std::fs::create_dir_all(locks).map_err(|e| invalid(&locks.display().to_string(), e))?;
    let path = locks.join(format!("{}.lock", w.check.hex()));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| invalid(&path.display().to_string(), e))?;
    match file.try_lock() {
        Ok(()) => return Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => progress(FetchEvent::Waiting { file: w.name.clone() }),
        Err(std::fs::TryLockError::Error(e)) => return Err(invalid(&path.display().to_string(), e)),
    }
    file.lock().map_err(|e| invalid(&path.display().to_string(), e))?;
    Ok(file)
}

/// Disk for the `missing` bytes on the blobs' file system; memory for the weights on `engine`.
fn preflight(
    blobs: &Path,
    missing: u64,
    wanted: &[Wanted],
    engine: Option<&wick::Engine>,
    repo_id: &str,
) -> Result<(), ZooError> {
    if let Some((_, free)) = wick::machine::filesystem_space(blobs) {
        if missing > free {
            return Err(invalid(
                &blobs.display().to_string(),
                format!(
                    "not enough disk space for {repo_id}: {} to download, {} free on this file system; \
                     nothing was downloaded (free space, or fetch fewer files)",
                    wick::memory::format_bytes(missing),
                    wick::memory::format_bytes(free)
                ),
            ));
        }
    }
    if let Some(engine) = engine {
        let weights: u64 = wanted.iter().filter(|w| w.name.ends_with(".safetensors")).map(|w| w.size).sum();
        let weights = usize::try_from(weights).unwrap_or(usize::MAX);
        engine.preflight(weights, &format!("the weights of {repo_id}, before downloading them"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_ids_revisions_and_file_names_cannot_leave_the_cache() {
        for ok in ["gpt2", "sentence-transformers/all-MiniLM-L6-v2", "a.b_c/d-e"] {
            assert!(check_repo_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "../x", "a/../b", "a/b/c", "/abs", "a b", "a\\b", "..", "a/."] {
            assert!(check_repo_id(bad).is_err(), "{bad}");
        }
        for ok in ["main", "refs/pr/1", "config.json", "onnx/model.onnx"] {
            assert!(plain_relative(ok), "{ok}");
        }
        for bad in ["", "../x", "/etc/passwd", "a/../b", "./a", "a\\..\\b", "a\0b"] {
            assert!(!plain_relative(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_git_blob_id_is_sha1_of_the_header_and_content() {
        // `printf 'hello\n' | git hash-object --stdin`
        let mut h = Hasher::new(&Checksum::GitSha1(String::new()), 6);
        h.update(b"hello\n");
        assert_eq!(h.hex(), "ce013625030ba8dba906f756967f9e9ca394464a");
    }
}
