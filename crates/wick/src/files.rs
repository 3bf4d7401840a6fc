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
/// `$XDG_CACHE_HOME/wick`, else `~/.cache/wick`, else a private folder in the system's temporary
/// folder ([`private_temp_dir`]); created if missing.
pub fn output_dir() -> std::io::Result<PathBuf> {
    let dir = std::env::var_os("WICK_OUTPUT_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("wick")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/wick")));
    match dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir)?;
            Ok(dir)
        }
        None => private_temp_dir(&std::env::temp_dir()),
    }
}

/// `wick-<uid>` in `base` (the system's temporary folder, shared by every user), made private:
/// created with mode 0700 if missing; if present, it must be a directory (not a symbolic link)
/// owned by this user, and its mode is narrowed to 0700. Anything else is an error that names the
/// folder and `WICK_OUTPUT_DIR`, before anything is written there: another user who made the
/// folder first, or planted a link at its name, would otherwise receive wick's outputs (status
/// files, job logs, reports) or redirect them.
#[cfg(unix)]
pub fn private_temp_dir(base: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let dir = base.join(format!("wick-{uid}"));
    let refuse = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} {why}, so wick will not write its outputs there; set WICK_OUTPUT_DIR to a folder \
                 of your own (or HOME / XDG_CACHE_HOME)",
                dir.display()
            ),
        )
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    // Not followed: a link planted at the name is refused, not trusted.
    let meta = std::fs::symlink_metadata(&dir)?;
    if meta.file_type().is_symlink() {
        return Err(refuse("is a symbolic link".into()));
    }
    if !meta.is_dir() {
        return Err(refuse("is not a folder".into()));
    }
    if meta.uid() != uid {
        return Err(refuse(format!("belongs to another user (uid {}, this process runs as uid {uid})", meta.uid())));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(dir)
}

/// `wick-<user>` in `base`, created if missing (no owner to check on this platform).
#[cfg(not(unix))]
pub fn private_temp_dir(base: &Path) -> std::io::Result<PathBuf> {
    let user = std::env::var("USERNAME").unwrap_or_else(|_| "user".into());
    let dir = base.join(format!("wick-{user}"));
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

    #[cfg(unix)]
    #[test]
    fn the_temporary_fallback_is_private_and_refuses_a_planted_link_or_another_users_folder() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        let base = dir("private");
        let name = format!("wick-{uid}");
        // Made fresh: mode 0700, this user's.
        let made = private_temp_dir(&base).unwrap();
        assert_eq!(made, base.join(&name));
        let meta = std::fs::metadata(&made).unwrap();
        assert_eq!((meta.mode() & 0o777, meta.uid()), (0o700, uid));
        // Present and this user's but open to others: narrowed to 0700.
        std::fs::set_permissions(&made, std::fs::Permissions::from_mode(0o777)).unwrap();
        private_temp_dir(&base).unwrap();
        assert_eq!(std::fs::metadata(&made).unwrap().mode() & 0o777, 0o700);
        // A link planted at the name (to a folder the planter reads): refused, nothing written.
        std::fs::remove_dir(&made).unwrap();
        let target = base.join("planted");
        std::fs::create_dir(&target).unwrap();
        std::os::unix::fs::symlink(&target, &made).unwrap();
        let err = private_temp_dir(&base).unwrap_err().to_string();
        assert!(err.contains("symbolic link") && err.contains("WICK_OUTPUT_DIR") && err.contains(&name), "{err}");
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
        std::fs::remove_file(&made).unwrap();
        // A folder of another user at the name: refused (made by chown, which needs root: CI
        // runs as root).
        if uid == 0 {
            std::fs::create_dir(&made).unwrap();
            std::os::unix::fs::chown(&made, Some(65534), Some(65534)).unwrap();
            let err = private_temp_dir(&base).unwrap_err().to_string();
            assert!(err.contains("another user (uid 65534") && err.contains("WICK_OUTPUT_DIR"), "{err}");
        } else {
            eprintln!("\n!!!!!!!! SKIPPED: another user's folder needs root to make (uid {uid})\n");
        }
        std::fs::remove_dir_all(&base).ok();
    }
}
