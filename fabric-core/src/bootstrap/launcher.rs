//! Rank and world size from the usual launchers, or given explicitly.

use crate::error::{Error, Result};

/// Which launcher the values came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Slurm `srun` (`SLURM_PROCID` / `SLURM_NTASKS`, else `SLURM_STEP_NUM_TASKS`, else
    /// the older `SLURM_NPROCS`).
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
        // In order of precedence: an MPI launcher inside a Slurm allocation sets both, and
        // its own variables describe the job; the generic RANK / WORLD_SIZE come last.
        let table: [(Launcher, &str, &[&str]); 4] = [
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                &["OMPI_COMM_WORLD_SIZE"],
            ),
            (Launcher::Pmi, "PMI_RANK", &["PMI_SIZE"]),
            (
                Launcher::Slurm,
                "SLURM_PROCID",
                &["SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS"],
            ),
            (Launcher::Torchrun, "RANK", &["WORLD_SIZE"]),
        ];
        let explicit_server = get("FABRIC_BOOTSTRAP");
        for (launcher, r, sizes) in table {
            let Some((s, size)) = sizes.iter().find_map(|s| get(s).map(|v| (*s, v))) else {
                continue;
            };
            let Some(rank) = get(r) else {
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
    fn rendezvous_address_per_launcher() {
        // Slurm, Open MPI and PMI give no address: FABRIC_BOOTSTRAP does.
        for (r, s) in [
            ("SLURM_PROCID", "SLURM_NTASKS"),
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            ("PMI_RANK", "PMI_SIZE"),
        ] {
            let l = Launch::from_vars(env(&[(r, "1"), (s, "2")]))
                .unwrap()
                .unwrap();
            assert_eq!(l.server, None, "{r}");
            let l = Launch::from_vars(env(&[(r, "1"), (s, "2"), ("FABRIC_BOOTSTRAP", "h:1")]))
                .unwrap()
                .unwrap();
            assert_eq!(l.server.as_deref(), Some("h:1"), "{r}");
        }
        // torchrun: MASTER_ADDR:MASTER_PORT wins over FABRIC_BOOTSTRAP; with either
        // missing, FABRIC_BOOTSTRAP is used.
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("FABRIC_BOOTSTRAP", "fb:9"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            Launch::from_vars(env(&v)).unwrap().unwrap().server
        };
        assert_eq!(
            with(&[("MASTER_ADDR", "m"), ("MASTER_PORT", "29500")]).as_deref(),
            Some("m:29500")
        );
        assert_eq!(with(&[("MASTER_ADDR", "m")]).as_deref(), Some("fb:9"));
        assert_eq!(with(&[("MASTER_PORT", "1")]).as_deref(), Some("fb:9"));
    }

    #[test]
    fn precedence_and_partial_sets() {
        // mpirun inside a Slurm allocation, with torchrun-style variables too: Open MPI's
        // own variables describe the job.
        let l = Launch::from_vars(env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("RANK", "7"),
            ("WORLD_SIZE", "9"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::OpenMpi, 2, 4));
        // Slurm beats the generic RANK / WORLD_SIZE.
        let l = Launch::from_vars(env(&[
            ("RANK", "7"),
            ("WORLD_SIZE", "9"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((l.launcher, l.rank, l.size), (Launcher::Slurm, 5, 6));
        // Slurm's size from the step (or the old name) when SLURM_NTASKS is absent.
        for s in ["SLURM_STEP_NUM_TASKS", "SLURM_NPROCS"] {
            let l = Launch::from_vars(env(&[("SLURM_PROCID", "3"), (s, "4")]))
                .unwrap()
                .unwrap();
            assert_eq!((l.launcher, l.rank, l.size), (Launcher::Slurm, 3, 4), "{s}");
        }
        // Half a pair is no launcher: a rank without a size (or the reverse) is skipped.
        assert_eq!(
            Launch::from_vars(env(&[("SLURM_PROCID", "1")])).unwrap(),
            None
        );
        assert_eq!(
            Launch::from_vars(env(&[("WORLD_SIZE", "4")])).unwrap(),
            None
        );
        let l = Launch::from_vars(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(l.launcher, Launcher::Torchrun);
        // Surrounding whitespace is tolerated.
        let l = Launch::from_vars(env(&[("PMI_RANK", " 1 "), ("PMI_SIZE", "2\n")]))
            .unwrap()
            .unwrap();
        assert_eq!((l.rank, l.size), (1, 2));
    }

    #[test]
    fn malformed_values_are_errors() {
        for (r, s) in [
            ("", "2"),
            ("-1", "2"),
            ("1", "0"),
            ("0", "0"),
            ("1", "4294967296"),
            ("0x1", "2"),
        ] {
            let e = Launch::from_vars(env(&[("SLURM_PROCID", r), ("SLURM_NTASKS", s)]));
            assert!(
                matches!(e, Err(Error::InvalidArgument(_))),
                "SLURM_PROCID={r:?} SLURM_NTASKS={s:?}: {e:?}"
            );
        }
        assert!(Launch::from_vars(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).is_err());
        assert!(Launch::from_vars(env(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")])).is_err());
        assert!(Launch::explicit(2, 2, None).is_err());
    }
}
