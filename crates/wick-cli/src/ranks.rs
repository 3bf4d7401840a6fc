//! `wick train --ranks N`: the run started as N ranks under the system's `mpirun` (Open MPI's
//! flags: `--oversubscribe` so a small machine takes N ranks, `--bind-to none`, and as root the
//! `--allow-run-as-root` Open MPI asks for), each rank with its share of the cores
//! (`RAYON_NUM_THREADS`, unless set), the same `wick train` arguments otherwise. Under `mpirun`
//! directly (`mpirun -n N wick train ...`) each process joins the group by itself. And the
//! ZeRO options that only some stages read, refused where the stage would ignore them (`wick
//! train`, `estimate` and `fit-batch` alike).

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

/// Refuses a data-parallel option that ZeRO stage `zero` would ignore: `--prefetch` and
/// `--no-recompute` change how stage 3 gathers and runs its blocks, `--no-overlap` how stages
/// 0–2 reduce (stage 3 reduce-scatters each block's gradients from inside backward whatever it
/// says).
pub fn check_stage_options(zero: u8, no_overlap: bool, prefetch: bool, no_recompute: bool) -> Result<()> {
    for (given, flag) in [(prefetch, "--prefetch"), (no_recompute, "--no-recompute")] {
        if given && zero != 3 {
            bail!(
                "{flag} changes how ZeRO stage 3 runs its blocks: give it with --zero 3 (this run is at stage {zero})"
            );
        }
    }
    if no_overlap && zero == 3 {
        bail!(
            "--no-overlap is for ZeRO stages 0-2: at stage 3 each block's gradients are reduce-scattered from inside \
             backward in any case"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_stage_options;

    #[test]
    fn options_a_stage_would_ignore_are_refused() {
        for zero in 0..=3u8 {
            let ok = |no_overlap, prefetch, no_recompute| check_stage_options(zero, no_overlap, prefetch, no_recompute);
            assert!(ok(false, false, false).is_ok());
            assert_eq!(ok(true, false, false).is_ok(), zero < 3, "--no-overlap at stage {zero}");
            for (prefetch, no_recompute) in [(true, false), (false, true), (true, true)] {
                let r = ok(false, prefetch, no_recompute);
                assert_eq!(r.is_ok(), zero == 3, "stage {zero}");
                if let Err(e) = r {
                    assert!(e.to_string().contains("--zero 3"), "{e}");
                }
            }
        }
    }
}
