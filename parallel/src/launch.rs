//! Starting a job on this machine as torchrun's standalone mode does: `N` processes of one
//! command, each with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`
//! and `MASTER_PORT`; when one fails, the others are stopped. `cargo xtask launch` is this.
//!
//! ```no_run
//! use vram_parallel::launch::Launch;
//!
//! let done = Launch::new(4).run("target/release/examples/zero2_gpt", &[])?;
//! println!("4 ranks done in {:?} on port {}", done.elapsed, done.master_port);
//! # Ok::<(), vram_parallel::DistError>(())
//! ```

use std::ffi::OsStr;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use crate::error::DistError;

/// How to start a local job.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Processes to start (ranks `0..nproc`).
    pub nproc: usize,
    /// `MASTER_ADDR` (default `127.0.0.1`).
    pub master_addr: String,
    /// `MASTER_PORT`; `None` takes a free port of `master_addr`.
    pub master_port: Option<u16>,
    /// Stops every process and fails when the job runs longer (`None`: no limit).
    pub timeout: Option<Duration>,
    /// More variables for every process (e.g. [`TIMEOUT_VAR`](crate::TIMEOUT_VAR)).
    pub env: Vec<(String, String)>,
    /// Writes rank `r`'s standard output and error to `<log_dir>/rank<r>.log` (torchrun's
    /// `--log-dir`) instead of this process's.
    pub log_dir: Option<PathBuf>,
}

/// A job that ended well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// The port the ranks met on.
    pub master_port: u16,
    /// Wall time from the first start to the last exit.
    pub elapsed: Duration,
}

impl Launch {
    /// `nproc` processes meeting on a free port of 127.0.0.1, no time limit.
    pub fn new(nproc: usize) -> Self {
        Launch {
            nproc,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            timeout: None,
            env: Vec::new(),
            log_dir: None,
        }
    }

    /// Starts `nproc` processes of `program args...` and waits for all. When one exits
    /// with a failure (or a signal), the others are killed at once.
    ///
    /// # Errors
    ///
    /// [`DistError::RankFailed`] naming the rank(s) that failed first;
    /// [`DistError::Launch`] when a process cannot be started, no free port is found, or
    /// the job outlives [`timeout`](Self::timeout).
    pub fn run<S: AsRef<OsStr>>(&self, program: S, args: &[S]) -> Result<Finished, DistError> {
        if self.nproc == 0 {
            return Err(DistError::Launch("--nproc must be at least 1".into()));
        }
        let port = match self.master_port {
            Some(p) => p,
            None => free_port(&self.master_addr)?,
        };
        let started = Instant::now();
        let mut children: Vec<Option<Child>> = Vec::with_capacity(self.nproc);
        for rank in 0..self.nproc {
            let mut cmd = Command::new(program.as_ref());
            cmd.args(args.iter().map(AsRef::as_ref));
            let n = self.nproc.to_string();
            cmd.env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", &n)
                .env("LOCAL_WORLD_SIZE", &n)
                .env("MASTER_ADDR", &self.master_addr)
                .env("MASTER_PORT", port.to_string());
            cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
            if let Some(dir) = &self.log_dir {
                let log = dir.join(format!("rank{rank}.log"));
                let file = std::fs::File::create(&log).and_then(|f| Ok((f.try_clone()?, f)));
                match file {
                    Ok((out, err)) => {
                        cmd.stdout(out).stderr(err);
                    }
                    Err(e) => {
                        stop(&mut children);
                        return Err(DistError::Launch(format!(
                            "cannot write {}: {e}",
                            log.display()
                        )));
                    }
                }
            }
            match cmd.spawn() {
                Ok(c) => children.push(Some(c)),
                Err(e) => {
                    stop(&mut children);
                    return Err(DistError::Launch(format!(
                        "cannot start rank {rank} ({}): {e}",
                        program.as_ref().to_string_lossy()
                    )));
                }
            }
        }
        loop {
            let mut failed = Vec::new();
            for (rank, slot) in children.iter_mut().enumerate() {
                let Some(child) = slot else { continue };
                match child.try_wait() {
                    Ok(Some(status)) if status.success() => *slot = None,
                    Ok(Some(status)) => {
                        failed.push((rank, describe(status)));
                        *slot = None;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        failed.push((rank, format!("cannot wait for it: {e}")));
                        *slot = None;
                    }
                }
            }
            if !failed.is_empty() {
                stop(&mut children);
                return Err(DistError::RankFailed { failed });
            }
            if children.iter().all(Option::is_none) {
                return Ok(Finished { master_port: port, elapsed: started.elapsed() });
            }
            if let Some(t) = self.timeout.filter(|t| started.elapsed() > *t) {
                stop(&mut children);
                return Err(DistError::Launch(format!(
                    "the job ran longer than {t:?}: stopped every rank"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A port nobody listens on at `addr` right now.
fn free_port(addr: &str) -> Result<u16, DistError> {
    TcpListener::bind((addr, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| DistError::Launch(format!("no free port on {addr}: {e}")))
}

fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    if let Some(sig) = std::os::unix::process::ExitStatusExt::signal(&status) {
        return format!("killed by signal {sig}");
    }
    status.code().map_or_else(|| status.to_string(), |c| format!("exit code {c}"))
}

/// Kills and reaps every process still running.
fn stop(children: &mut [Option<Child>]) {
    for child in children.iter_mut().flatten() {
        let _ = child.kill();
    }
    for child in children.iter_mut().filter_map(Option::take) {
        let mut child = child;
        let _ = child.wait();
    }
}
