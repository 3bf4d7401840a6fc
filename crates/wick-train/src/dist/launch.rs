//! Who this process is, as its launcher says: `mpirun`'s Open MPI variables
//! (`OMPI_COMM_WORLD_RANK`/`_SIZE`/`_LOCAL_RANK`/`_LOCAL_SIZE`), MPICH/Hydra's and Slurm's PMI
//! ones (`PMI_RANK`/`PMI_SIZE`), or the torchrun-style names (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`). The first family present wins; a malformed value is an
//! error, never a silent single process.

use super::error::DistError;

/// A process's place in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank, from 0.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// This process's rank on its host (which GPU it takes).
    pub local_rank: usize,
    /// Processes on this host.
    pub local_world_size: usize,
    /// Which variables said so.
    pub launcher: &'static str,
}

const FAMILIES: [(&str, [&str; 4]); 3] = [
    (
        "mpirun (Open MPI)",
        ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"],
    ),
    ("PMI (MPICH, Slurm)", ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"]),
    ("torchrun-style", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]),
];

impl Launch {
    /// The process alone.
    pub fn single() -> Self {
        Launch { rank: 0, world_size: 1, local_rank: 0, local_world_size: 1, launcher: "none" }
    }

    /// What this process's environment says; [`Launch::single`] when no launcher set anything.
    pub fn from_env() -> Result<Self, DistError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`Launch::from_env`], reading variables through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        for (launcher, [rank, size, local, local_size]) in FAMILIES {
            let (Some(r), Some(s)) = (var(rank), var(size)) else { continue };
            let number = |name: &str, value: &str| {
                value.trim().parse::<usize>().map_err(|_| DistError::Launch {
                    message: format!("{name}={value:?} (set by {launcher}) is not a number"),
                })
            };
            let (rank_n, world) = (number(rank, &r)?, number(size, &s)?);
            if world == 0 || rank_n >= world {
                return Err(DistError::Launch { message: format!("{rank}={rank_n} with {size}={world} ({launcher})") });
            }
            let local_rank = var(local).map(|v| number(local, &v)).transpose()?.unwrap_or(rank_n);
            let local_world_size = var(local_size).map(|v| number(local_size, &v)).transpose()?.unwrap_or(world);
            if local_rank >= local_world_size || local_world_size > world {
                return Err(DistError::Launch {
                    message: format!(
                        "{local}={local_rank} with {local_size}={local_world_size} of {world} ({launcher})"
                    ),
                });
            }
            return Ok(Launch { rank: rank_n, world_size: world, local_rank, local_world_size, launcher });
        }
        Ok(Launch::single())
    }

    /// Whether the launcher is MPI's (so MPI can be initialised to reach the other ranks).
    pub fn is_mpi(&self) -> bool {
        self.launcher != "torchrun-style" && self.launcher != "none"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(pairs: &[(&str, &str)]) -> Result<Launch, DistError> {
        let map: std::collections::HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Launch::from_vars(|n| map.get(n).cloned())
    }

    #[test]
    fn each_launchers_variables_are_read_and_bad_ones_refused() {
        assert_eq!(from(&[]).unwrap(), Launch::single());
        let l =
            from(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")])
                .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_rank, l.local_world_size), (1, 2, 1, 2));
        assert!(l.is_mpi());
        let t = from(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")]).unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank, t.local_world_size, t.is_mpi()), (3, 4, 1, 2, false));
        for bad in [
            vec![("RANK", "x"), ("WORLD_SIZE", "2")],
            vec![("RANK", "2"), ("WORLD_SIZE", "2")],
            vec![("RANK", "0"), ("WORLD_SIZE", "0")],
            vec![("PMI_RANK", "0"), ("PMI_SIZE", "2"), ("MPI_LOCALRANKID", "2"), ("MPI_LOCALNRANKS", "2")],
        ] {
            let e = from(&bad).unwrap_err().to_string();
            assert!(e.contains(bad[0].0) || e.contains(bad[2].0), "{e}");
        }
    }
}
