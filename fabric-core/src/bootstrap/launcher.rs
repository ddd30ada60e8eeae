//! Rank and world size from the usual launchers, or given explicitly.

use crate::error::{Error, Result};

/// Which launcher the values came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Slurm `srun` (`SLURM_PROCID` / `SLURM_NTASKS`).
    Slurm,
    /// Open MPI `mpirun` (`OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`).
    OpenMpi,
    /// PMI (`PMI_RANK` / `PMI_SIZE`: MPICH, Intel MPI, ...).
    Pmi,
    /// torchrun-style (`RANK` / `WORLD_SIZE` / `MASTER_ADDR` / `MASTER_PORT`).
    Torchrun,
    /// Given by the caller.
    Explicit,
}

/// Where this process sits in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Who said so.
    pub launcher: Launcher,
    /// This process's rank, `< size`.
    pub rank: u32,
    /// Number of ranks.
    pub size: u32,
    /// Rendezvous address `HOST:PORT`, when the launcher provides one (torchrun's
    /// `MASTER_ADDR:MASTER_PORT`, or `FABRIC_BOOTSTRAP`).
    pub server: Option<String>,
}

impl Launch {
    /// Explicit values.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `rank >= size`.
    pub fn explicit(rank: u32, size: u32, server: Option<String>) -> Result<Self> {
        if rank >= size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} not below size {size}"
            )));
        }
        Ok(Launch {
            launcher: Launcher::Explicit,
            rank,
            size,
            server,
        })
    }

    /// Detects the launcher from the process environment (`None`: not launched by one).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a launcher's variables are present but malformed.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Detection over any variable lookup (pure; testable).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a launcher's variables are present but malformed.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let table = [
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
            ),
            (Launcher::Pmi, "PMI_RANK", "PMI_SIZE"),
            (Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS"),
            (Launcher::Torchrun, "RANK", "WORLD_SIZE"),
        ];
        let explicit_server = get("FABRIC_BOOTSTRAP");
        for (launcher, r, s) in table {
            let (Some(rank), Some(size)) = (get(r), get(s)) else {
                continue;
            };
            let parse = |name: &str, v: &str| {
                v.trim()
                    .parse::<u32>()
                    .map_err(|_| Error::InvalidArgument(format!("{name}={v:?} is not a number")))
            };
            let rank = parse(r, &rank)?;
            let size = parse(s, &size)?;
            if size == 0 || rank >= size {
                return Err(Error::InvalidArgument(format!(
                    "{r}={rank} is not below {s}={size}"
                )));
            }
            let server = match (launcher, get("MASTER_ADDR"), get("MASTER_PORT")) {
                (Launcher::Torchrun, Some(a), Some(p)) => Some(format!("{a}:{p}")),
                _ => explicit_server.clone(),
            };
            return Ok(Some(Launch {
                launcher,
                rank,
                size,
                server,
            }));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn detects_each_launcher() {
        let l = Launch::from_vars(env(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8")]))
            .unwrap()
            .unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::Slurm, 3, 8));
        let l = Launch::from_vars(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((l.launcher, l.rank), (Launcher::OpenMpi, 1));
        let l = Launch::from_vars(env(&[("PMI_RANK", "0"), ("PMI_SIZE", "4")]))
            .unwrap()
            .unwrap();
        assert_eq!(l.launcher, Launcher::Pmi);
        let l = Launch::from_vars(env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(l.server.as_deref(), Some("node1:29500"));
        assert_eq!(Launch::from_vars(env(&[])).unwrap(), None);
    }

    #[test]
    fn malformed_values_are_errors() {
        assert!(Launch::from_vars(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).is_err());
        assert!(Launch::from_vars(env(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")])).is_err());
        assert!(Launch::explicit(2, 2, None).is_err());
    }
}
