//! The network and file side of a fetch: the repository listing, one file's transfer (resumed,
//! retried, hashed as it is written, checked, then renamed into place) and its snapshot link.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Duration;

use super::{invalid, FetchEvent, Hasher, Listing, Wanted, CHUNK, MAX_LISTING};
use crate::error::ZooError;

/// Why a transfer stopped: worth retrying from where it stopped, or not.
enum Stop {
    Retry(String),
    Fail(ZooError),
}

fn describe(code: u16, what: &str) -> String {
    match code {
        401 | 403 => {
            format!("{what}: the hub refused access ({code}); a gated or private repository needs a token (HF_TOKEN)")
        }
        404 => format!("{what}: not found (404): no such repository, revision or file"),
        _ => format!("{what}: the hub answered {code}"),
    }
}

/// The repository's listing at the revision, with sizes and checksums (`blobs=true`), through
/// hf-hub's own API request.
pub(super) fn listing(
    repo: &hf_hub::api::sync::ApiRepo,
    repo_id: &str,
    timeout: Duration,
) -> Result<Listing, ZooError> {
    let response = match repo.info_request().query("blobs", "true").timeout(timeout).call() {
        Ok(r) => r,
        Err(ureq::Error::Status(code, _)) => return Err(invalid(repo_id, describe(code, "listing the repository"))),
        Err(ureq::Error::Transport(t)) => return Err(invalid(repo_id, format!("cannot reach the hub: {t}"))),
    };
    let mut body = Vec::new();
    response
        .into_reader()
        .take(MAX_LISTING + 1)
        .read_to_end(&mut body)
        .map_err(|e| invalid(repo_id, format!("reading the listing: {e}")))?;
    if body.len() as u64 > MAX_LISTING {
        return Err(invalid(repo_id, "the listing is larger than 64 MiB"));
    }
    serde_json::from_slice(&body).map_err(|e| invalid(repo_id, format!("the listing is not the hub's: {e}")))
}

/// The HTTP client of file transfers (hf-hub's own does not lend its requests for other URLs).
pub(super) struct Client {
    agent: ureq::Agent,
    token: Option<String>,
}

fn file_error(path: &Path, message: impl std::fmt::Display) -> ZooError {
    ZooError::File { path: path.to_path_buf(), message: message.to_string() }
}

impl Client {
    pub(super) fn new(token: Option<&str>, timeout: Duration) -> Self {
        let agent = ureq::AgentBuilder::new()
            .try_proxy_from_env(true)
            .timeout_connect(timeout)
            .timeout_read(timeout)
            // The hub redirects LFS files to a CDN: the token goes to the hub only.
            .redirect_auth_headers(ureq::RedirectAuthHeaders::SameHost)
            .user_agent(&format!("wick/{}", env!("CARGO_PKG_VERSION")))
            .build();
        Client { agent, token: token.map(str::to_string) }
    }

    /// Downloads `w` from `url` into `partial` (continuing what is there), checks it, and renames
    /// it to `blob`. Returns the bytes downloaded now.
    pub(super) fn download(
        &self,
        url: &str,
        w: &Wanted,
        partial: &Path,
        blob: &Path,
        retries: usize,
        progress: &mut dyn FnMut(FetchEvent),
    ) -> Result<u64, ZooError> {
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(partial)
            .map_err(|e| file_error(partial, e))?;
        let mut have = file.metadata().map_err(|e| file_error(partial, e))?.len();
        if have > w.size {
            file.set_len(0).map_err(|e| file_error(partial, e))?;
            have = 0;
        }
        // What a partial file holds is hashed again: the checksum covers the whole file.
        let mut hasher = Hasher::new(&w.check, w.size);
        hash_prefix(&mut file, have, &mut hasher).map_err(|e| file_error(partial, e))?;
        progress(FetchEvent::Started { file: w.name.clone(), size: w.size, resumed_at: have });
        let mut downloaded = 0u64;
        let mut attempt = 0;
        while have < w.size {
            let mut t = Transfer { file: &mut file, have: &mut have, hasher: &mut hasher, downloaded: &mut downloaded };
            let why = match self.transfer(url, w, partial, &mut t, progress) {
                Ok(()) if have == w.size => break,
                Ok(()) => format!("the connection closed at {have} of {} bytes", w.size),
                Err(Stop::Retry(why)) => why,
                Err(Stop::Fail(e)) => return Err(e),
            };
            if attempt >= retries {
                return Err(file_error(
                    partial,
                    format!(
                        "`{}`: the transfer was interrupted at {have} of {} bytes ({why}), {retries} retries \
                         spent; the partial download is kept here and the next fetch resumes from it",
                        w.name, w.size
                    ),
                ));
            }
            attempt += 1;
            progress(FetchEvent::Retrying { file: w.name.clone(), at: have, why });
            std::thread::sleep(Duration::from_millis(200 << attempt.min(5)));
        }
        let got = hasher.hex();
        if got != w.check.hex() {
            drop(file);
            let _ = std::fs::remove_file(partial);
            return Err(file_error(
                partial,
                format!(
                    "`{}`: checksum mismatch: the hub lists {}, the {} bytes downloaded hash to {got}; \
                     the download was removed and nothing was put in the cache",
                    w.name,
                    w.check.hex(),
                    w.size
                ),
            ));
        }
        file.sync_all().map_err(|e| file_error(partial, e))?;
        drop(file);
        std::fs::rename(partial, blob).map_err(|e| file_error(blob, e))?;
        if let Some(dir) = blob.parent() {
            // The rename is durable once the folder is flushed.
            File::open(dir).and_then(|d| d.sync_all()).map_err(|e| file_error(dir, e))?;
        }
        Ok(downloaded)
    }

    /// One HTTP request: from `have` to the end, or from 0 when the server ignores the range.
    fn transfer(
        &self,
        url: &str,
        w: &Wanted,
        partial: &Path,
        t: &mut Transfer<'_>,
        progress: &mut dyn FnMut(FetchEvent),
    ) -> Result<(), Stop> {
        let mut request = self.agent.get(url);
        if let Some(token) = &self.token {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        if *t.have > 0 {
            request = request.set("Range", &format!("bytes={}-", *t.have));
        }
        let response = match request.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(code, _)) if code == 408 || code == 429 || code >= 500 => {
                return Err(Stop::Retry(format!("the server answered {code}")))
            }
            Err(ureq::Error::Status(416, _)) => {
                // The partial file is not a prefix the server can continue: start over.
                t.restart(w).map_err(|e| Stop::Fail(file_error(partial, e)))?;
                return Err(Stop::Retry("the server refused to resume; starting over".into()));
            }
            Err(ureq::Error::Status(code, _)) => return Err(Stop::Fail(invalid(url, describe(code, &w.name)))),
            Err(ureq::Error::Transport(e)) => return Err(Stop::Retry(e.to_string())),
        };
        match response.status() {
            206 => {
                let range = response.header("Content-Range").unwrap_or("");
                let start = range.strip_prefix("bytes ").and_then(|r| r.split('-').next()).and_then(|s| s.parse().ok());
                if start != Some(*t.have) {
                    return Err(Stop::Fail(invalid(
                        url,
                        format!("asked for bytes from {}, the server sent `{range}`", *t.have),
                    )));
                }
            }
            200 if *t.have > 0 => t.restart(w).map_err(|e| Stop::Fail(file_error(partial, e)))?,
            200 => {}
            code => return Err(Stop::Fail(invalid(url, describe(code, &w.name)))),
        }
        t.file.seek(SeekFrom::Start(*t.have)).map_err(|e| Stop::Fail(file_error(partial, e)))?;
        let mut reader = response.into_reader();
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Stop::Retry(e.to_string())),
            };
            if *t.have + n as u64 > w.size {
                let _ = t.restart(w);
                return Err(Stop::Fail(invalid(url, format!("the server sent more than the {} bytes listed", w.size))));
            }
            t.file.write_all(&buf[..n]).map_err(|e| {
                Stop::Fail(file_error(
                    partial,
                    format!(
                        "`{}`: {e} after {} of {} bytes; the partial download is kept here (never read as \
                         the file) and the next fetch resumes from it",
                        w.name, *t.have, w.size
                    ),
                ))
            })?;
            t.hasher.update(&buf[..n]);
            *t.have += n as u64;
            *t.downloaded += n as u64;
            progress(FetchEvent::Progress(n as u64));
        }
    }
}

/// The state one file's transfers share.
struct Transfer<'a> {
    file: &'a mut File,
    have: &'a mut u64,
    hasher: &'a mut Hasher,
    downloaded: &'a mut u64,
}

impl Transfer<'_> {
    fn restart(&mut self, w: &Wanted) -> std::io::Result<()> {
        self.file.set_len(0)?;
        *self.have = 0;
        *self.hasher = Hasher::new(&w.check, w.size);
        Ok(())
    }
}

fn hash_prefix(file: &mut File, len: u64, hasher: &mut Hasher) -> std::io::Result<()> {
    file.seek(SeekFrom::Start(0))?;
    let mut buf = vec![0u8; CHUNK];
    let mut left = len;
    while left > 0 {
        let n = file.read(&mut buf[..CHUNK.min(left as usize)])?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the partial file shrank"));
        }
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(())
}

/// Makes `snapshot/name` a link to `blob` (relative, as the hub's cache has them), replacing
/// what is there atomically; a copy where the system has no symbolic links.
pub(super) fn link(snapshot: &Path, name: &str, blob: &Path) -> Result<(), ZooError> {
    let path = snapshot.join(name);
    let dir = path.parent().unwrap_or(snapshot);
    std::fs::create_dir_all(dir).map_err(|e| file_error(dir, e))?;
    let base = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{base}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    #[cfg(unix)]
    {
        // snapshots/<commit>/<dirs of name>/<base> → ../../<one ../ per dir>blobs/<checksum>
        let depth = Path::new(name).components().count() + 1;
        let blob_name = blob.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let target = format!("{}blobs/{blob_name}", "../".repeat(depth));
        std::os::unix::fs::symlink(&target, &tmp).map_err(|e| file_error(&tmp, e))?;
    }
    #[cfg(not(unix))]
    std::fs::copy(blob, &tmp).map_err(|e| file_error(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        file_error(&path, e)
    })
}
