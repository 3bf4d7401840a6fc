//! `wick train --ranks N`: the run started as N ranks under the system's `mpirun` (Open MPI's
//! flags: `--oversubscribe` so a small machine takes N ranks, `--bind-to none`, and as root the
//! `--allow-run-as-root` Open MPI asks for), each rank with its share of the cores
//! (`RAYON_NUM_THREADS`, unless set), the same `wick train` arguments otherwise. Under `mpirun`
//! directly (`mpirun -n N wick train ...`) each process joins the group by itself.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The `mpirun` program and its arguments that start `exe train ARGS` as `ranks` ranks, `args`
/// being this process's arguments after `train` without `--ranks N`/`--detach`.
pub fn mpirun(ranks: usize, exe: &std::path::Path, args: &[String]) -> Result<(PathBuf, Vec<String>)> {
    let found =
        std::env::var_os("PATH").iter().flat_map(std::env::split_paths).map(|d| d.join("mpirun")).find(|p| p.is_file());
    let Some(program) = found else {
        bail!("--ranks needs MPI's `mpirun` on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)");
    };
    let version = Command::new(&program).arg("--version").output().context("running mpirun --version")?;
    let open_mpi = String::from_utf8_lossy(&version.stdout).contains("Open MPI");
    let mut argv = vec!["-n".to_string(), ranks.to_string()];
    if open_mpi {
        argv.extend(["--oversubscribe", "--bind-to", "none"].map(String::from));
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            argv.push("--allow-run-as-root".into());
        }
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            argv.extend(["-x".to_string(), format!("RAYON_NUM_THREADS={}", (cores / ranks).max(1))]);
        } else {
            argv.extend(["-x".to_string(), "RAYON_NUM_THREADS".to_string()]);
        }
    }
    argv.push(exe.display().to_string());
    argv.push("train".into());
    argv.extend(args.iter().cloned());
    Ok((program, argv))
}

/// This process's arguments after the subcommand, without `--ranks N` (or `--ranks=N`) and
/// `--detach`.
pub fn forwarded_args() -> Vec<String> {
    let mut out = Vec::new();
    let mut args = std::env::args().skip(2);
    while let Some(a) = args.next() {
        if a == "--ranks" {
            args.next();
        } else if !(a.starts_with("--ranks=") || a == "--detach") {
            out.push(a);
        }
    }
    out
}
