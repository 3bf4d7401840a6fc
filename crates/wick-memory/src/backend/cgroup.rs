//! The memory cgroup this process is charged to: its usage and the tightest limit that applies.
//!
//! Containers and job schedulers (Docker, Kubernetes, systemd, Slurm) put a process in a
//! cgroup that is not necessarily the root, and limits set on any ancestor apply to it. The
//! process's own cgroup comes from `/proc/self/cgroup` (`0::/path` on v2; `N:memory:/path` on
//! v1); the limit is the smallest `memory.max` (v2) or `memory.limit_in_bytes` (v1) from that
//! cgroup up to the root of the mounted hierarchy. Inside a cgroup namespace the path is `/` and
//! the mount's root is the process's own cgroup, so the same walk is right there too.

use std::path::{Path, PathBuf};

/// v1 reports "no limit" as a page-rounded `i64::MAX`; anything this large is no limit.
const V1_UNLIMITED: usize = 1 << 60;

/// The process's cgroup (usage, limit) in bytes; the limit is `None` when nothing along the path
/// sets one. `None` when no memory cgroup is mounted at `/sys/fs/cgroup`.
pub fn cgroup_memory() -> Option<(usize, Option<usize>)> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    cgroup_memory_in(Path::new("/sys/fs/cgroup"), &membership)
}

/// [`cgroup_memory`] for a hierarchy mounted at `root` and the contents of `/proc/self/cgroup`.
pub fn cgroup_memory_in(root: &Path, membership: &str) -> Option<(usize, Option<usize>)> {
    let v2_path = membership.lines().find_map(|l| l.strip_prefix("0::"));
    if root.join("cgroup.controllers").is_file() || (v2_path.is_some() && root.join("memory.current").is_file()) {
        let own = own_dir(root, v2_path.unwrap_or("/"));
        let current = read_number(&own.join("memory.current")).or_else(|| read_number(&root.join("memory.current")))?;
        return Some((current, tightest(root, &own, "memory.max", usize::MAX)));
    }
    let v1_path = membership.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    });
    let base = root.join("memory");
    let own = own_dir(&base, v1_path.unwrap_or("/"));
    let current =
        read_number(&own.join("memory.usage_in_bytes")).or_else(|| read_number(&base.join("memory.usage_in_bytes")))?;
    Some((current, tightest(&base, &own, "memory.limit_in_bytes", V1_UNLIMITED)))
}

/// The process's cgroup directory under a hierarchy's mount, or the mount itself when that path
/// is not visible (a cgroup namespace shows the process's cgroup as the root).
fn own_dir(mount: &Path, path: &str) -> PathBuf {
    let dir = mount.join(path.trim_start_matches('/'));
    // `..` in a crafted path must not walk out of the mount.
    if path.split('/').any(|c| c == "..") || !dir.is_dir() {
        mount.to_path_buf()
    } else {
        dir
    }
}

/// The smallest limit in `file` from `own` up to `mount` (values at or above `unlimited`, or
/// `max`, are no limit).
fn tightest(mount: &Path, own: &Path, file: &str, unlimited: usize) -> Option<usize> {
    let mut limit: Option<usize> = None;
    for dir in own.ancestors() {
        if let Some(l) = read_number(&dir.join(file)).filter(|l| *l < unlimited) {
            limit = Some(limit.map_or(l, |m| m.min(l)));
        }
        if dir == mount {
            break;
        }
    }
    limit
}

fn read_number(path: &Path) -> Option<usize> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let root = std::env::temp_dir().join(format!("wick-cgroup-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, content) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, content).unwrap();
        }
        root
    }

    #[test]
    fn v2_takes_the_smallest_limit_along_the_process_path() {
        // A job's limit on a parent (4 GiB) binds although its own cgroup says "max" and the
        // root has none: reading only the root's `memory.max` missed it.
        let root = tree(&[
            ("cgroup.controllers", "memory"),
            ("memory.current", "999999"),
            ("job/memory.max", "4294967296"),
            ("job/step/memory.max", "max"),
            ("job/step/memory.current", "12345"),
            ("other/memory.max", "1000"),
        ]);
        assert_eq!(cgroup_memory_in(&root, "0::/job/step\n"), Some((12345, Some(4 << 30))));
        // A tighter limit lower down wins.
        std::fs::write(root.join("job/step/memory.max"), "2147483648").unwrap();
        assert_eq!(cgroup_memory_in(&root, "0::/job/step\n"), Some((12345, Some(2 << 30))));
        // Inside a cgroup namespace the path is `/`: the mount is the process's cgroup.
        assert_eq!(cgroup_memory_in(&root, "0::/\n"), Some((999999, None)));
        // A path that escapes the mount is not followed.
        assert_eq!(cgroup_memory_in(&root, "0::/../../etc\n"), Some((999999, None)));
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn v1_reads_the_memory_controller_path_and_ignores_unlimited() {
        let root = tree(&[
            ("memory/memory.usage_in_bytes", "5"),
            ("memory/memory.limit_in_bytes", "9223372036854771712"),
            ("memory/docker/abc/memory.usage_in_bytes", "777"),
            ("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712"),
            ("memory/docker/memory.limit_in_bytes", "3000000000"),
        ]);
        let membership = "12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n9:memory:/docker/abc\n";
        assert_eq!(cgroup_memory_in(&root, membership), Some((777, Some(3_000_000_000))));
        std::fs::write(root.join("memory/docker/memory.limit_in_bytes"), "9223372036854771712").unwrap();
        assert_eq!(cgroup_memory_in(&root, membership), Some((777, None)));
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn no_cgroup_mounted_is_none() {
        let root = tree(&[("unrelated", "")]);
        assert_eq!(cgroup_memory_in(&root, ""), None);
        std::fs::remove_dir_all(&root).ok();
    }
}
