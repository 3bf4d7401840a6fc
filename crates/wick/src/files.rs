//! Writing outputs so that a reader never sees half a file, and choosing where they go.
//!
//! Every report, trace, checkpoint and converted weight file wick writes goes through
//! [`write_atomic`] (or [`write_atomic_with`] for writers that want a path): the bytes go to a
//! temporary file in the destination's folder (same file system, so the rename is atomic),
//! which is flushed to disk, renamed over the destination, and the folder is flushed so the
//! rename itself survives a crash. A crash or a full disk leaves the old file (or none), never
//! a truncated one; the temporary file is removed on failure.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically (see the module documentation).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_with(path, |tmp| {
        let mut file = std::fs::File::create(tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })
}

/// Lets `write` fill a temporary path next to `path`, then makes it `path` atomically: the
/// temporary file is flushed to disk, renamed, and the folder flushed. On any error the
/// temporary file is removed and `path` is untouched.
pub fn write_atomic_with<E>(path: &Path, write: impl FnOnce(&Path) -> Result<(), E>) -> Result<(), E>
where
    E: From<std::io::Error>,
{
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{} names no file", path.display()))
    })?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp-{}-{nanos}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = write(&tmp).and_then(|()| {
        // Writers that only got a path may not have flushed: flush here (the file exists now).
        std::fs::OpenOptions::new().write(true).open(&tmp).and_then(|f| f.sync_all())?;
        std::fs::rename(&tmp, path)?;
        sync_dir(&dir)?;
        Ok(())
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

/// Where wick puts outputs the user did not place: `$WICK_OUTPUT_DIR`, else
/// `$XDG_CACHE_HOME/wick`, else `~/.cache/wick`, else the system temporary folder under a
/// per-user name; created if missing. Never a fixed name shared by every user of `/tmp`.
pub fn output_dir() -> std::io::Result<PathBuf> {
    let dir = std::env::var_os("WICK_OUTPUT_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("wick")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/wick")))
        .unwrap_or_else(|| {
            let user = std::env::var("USER").unwrap_or_else(|_| "user".into());
            std::env::temp_dir().join(format!("wick-{user}"))
        });
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wick-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn replaces_the_file_whole_and_leaves_no_temporary() {
        let d = dir("replace");
        let path = d.join("report.html");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, b"new contents").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new contents");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "only the file itself remains");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_failed_writer_leaves_the_old_file_and_no_temporary() {
        let d = dir("fail");
        let path = d.join("weights.safetensors");
        write_atomic(&path, b"complete old file").unwrap();
        let err = write_atomic_with(&path, |tmp| {
            std::fs::write(tmp, b"half")?;
            Err(std::io::Error::other("disk full halfway"))
        });
        assert!(err.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"complete old file");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_missing_folder_is_an_error_not_a_partial_write() {
        let d = dir("missing");
        assert!(write_atomic(&d.join("no/such/folder/x"), b"x").is_err());
        std::fs::remove_dir_all(&d).ok();
    }
}
