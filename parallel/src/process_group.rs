//! Where a process sits in a multi-process job, in torchrun's terms: `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (what `torchrun`, Slurm
//! wrappers and `cargo xtask launch` set), or the same values as arguments.

use std::time::Duration;

use crate::comm::CommError;

/// The environment variable that overrides [`ProcessGroupConfig::timeout`] (seconds).
pub const TIMEOUT_VAR: &str = "VRAM_DIST_TIMEOUT";

/// The default of [`ProcessGroupConfig::timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// One process's place in a job of `world_size` processes, and where they meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessGroupConfig {
    /// This process's rank, in `0..world_size` (`RANK`).
    pub rank: usize,
    /// Processes in the job, on every machine (`WORLD_SIZE`).
    pub world_size: usize,
    /// This process's rank on its machine: the GPU it uses (`LOCAL_RANK`).
    pub local_rank: usize,
    /// Processes on this machine (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
    /// Rank 0's host name or address (`MASTER_ADDR`); rank 0 listens there.
    pub master_addr: String,
    /// Rank 0's port (`MASTER_PORT`).
    pub master_port: u16,
    /// How long the rendezvous waits for every rank, and a collective for a silent rank,
    /// before failing with an error naming it ([`TIMEOUT_VAR`], default 300 s).
    pub timeout: Duration,
}

impl ProcessGroupConfig {
    /// A single-machine job: `local_rank = rank`, `local_world_size = world_size`, the
    /// default timeout.
    pub fn new(rank: usize, world_size: usize, master_addr: &str, master_port: u16) -> Self {
        ProcessGroupConfig {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: master_addr.to_owned(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Reads torchrun's variables: `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`
    /// are required; `LOCAL_RANK` and `LOCAL_WORLD_SIZE` default to `RANK` and
    /// `WORLD_SIZE` (one machine); [`TIMEOUT_VAR`] to [`DEFAULT_TIMEOUT`].
    ///
    /// # Errors
    ///
    /// [`CommError::Invalid`] naming a missing or malformed variable, or a rank outside the
    /// world.
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`from_env`](Self::from_env), with the variables from `var`.
    ///
    /// # Errors
    ///
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, CommError> {
        let required = |k: &str| {
            var(k).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
                CommError::Invalid(format!(
                    "{k} is not set: start the processes with `cargo xtask launch --nproc N -- \
                     <command>` or torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and \
                     MASTER_PORT"
                ))
            })
        };
        let number = |k: &str, v: String| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| CommError::Invalid(format!("{k}={v:?} is not a non-negative integer")))
        };
        let rank = number("RANK", required("RANK")?)?;
        let world_size = number("WORLD_SIZE", required("WORLD_SIZE")?)?;
        let master_addr = required("MASTER_ADDR")?.trim().to_owned();
        let port = required("MASTER_PORT")?;
        let master_port = port.trim().parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| {
            CommError::Invalid(format!("MASTER_PORT={port:?} is not a port (1 to 65535)"))
        })?;
        let local_rank = var("LOCAL_RANK").map_or(Ok(rank), |v| number("LOCAL_RANK", v))?;
        let local_world_size =
            var("LOCAL_WORLD_SIZE").map_or(Ok(world_size), |v| number("LOCAL_WORLD_SIZE", v))?;
        let timeout = match var(TIMEOUT_VAR) {
            None => DEFAULT_TIMEOUT,
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| {
                    CommError::Invalid(format!(
                        "{TIMEOUT_VAR}={v:?} is not a positive number of seconds"
                    ))
                })?,
        };
        let config = ProcessGroupConfig {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            timeout,
        };
        config.check()?;
        Ok(config)
    }

    /// Checks the ranks against the world sizes.
    ///
    /// # Errors
    ///
    /// [`CommError::Invalid`] for an empty world or a rank outside it.
    pub fn check(&self) -> Result<(), CommError> {
        if self.world_size == 0 || self.local_world_size == 0 {
            return Err(CommError::Invalid(
                "WORLD_SIZE and LOCAL_WORLD_SIZE must be at least 1".into(),
            ));
        }
        if self.rank >= self.world_size {
            return Err(CommError::Invalid(format!(
                "RANK={} is outside WORLD_SIZE={} (ranks are 0..WORLD_SIZE)",
                self.rank, self.world_size
            )));
        }
        if self.local_rank >= self.local_world_size {
            return Err(CommError::Invalid(format!(
                "LOCAL_RANK={} is outside LOCAL_WORLD_SIZE={}",
                self.local_rank, self.local_world_size
            )));
        }
        if self.master_addr.is_empty() {
            return Err(CommError::Invalid("MASTER_ADDR is empty".into()));
        }
        Ok(())
    }

    /// `MASTER_ADDR:MASTER_PORT` (an IPv6 address in brackets).
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn torchrun_variables_are_read_and_local_ones_default_to_the_global_ones() {
        let base = [
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let c = ProcessGroupConfig::from_vars(vars(&base)).unwrap();
        assert_eq!(c, ProcessGroupConfig::new(2, 4, "127.0.0.1", 29500));
        let mut more = base.to_vec();
        more.extend([("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2"), (TIMEOUT_VAR, "2.5")]);
        let c = ProcessGroupConfig::from_vars(vars(&more)).unwrap();
        assert_eq!((c.local_rank, c.local_world_size), (0, 2));
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.master(), "127.0.0.1:29500");
    }

    #[test]
    fn missing_or_malformed_variables_are_errors_naming_them() {
        let ok = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "1234"),
        ];
        for (drop, needle) in
            [("RANK", "RANK is not set"), ("MASTER_PORT", "MASTER_PORT is not set")]
        {
            let v: Vec<_> = ok.iter().copied().filter(|(k, _)| *k != drop).collect();
            let e = ProcessGroupConfig::from_vars(vars(&v)).unwrap_err().to_string();
            assert!(e.contains(needle) && e.contains("cargo xtask launch"), "{e}");
        }
        for (k, bad, needle) in [
            ("RANK", "x", "RANK=\"x\""),
            ("RANK", "2", "outside WORLD_SIZE=2"),
            ("MASTER_PORT", "70000", "not a port"),
            ("WORLD_SIZE", "0", "at least 1"),
            (TIMEOUT_VAR, "-1", "positive number"),
        ] {
            let mut v: Vec<_> = ok.iter().copied().filter(|(x, _)| *x != k).collect();
            v.push((k, bad));
            let e = ProcessGroupConfig::from_vars(vars(&v)).unwrap_err().to_string();
            assert!(e.contains(needle), "{k}={bad}: {e}");
        }
    }
}
