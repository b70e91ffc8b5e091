//! `cargo xtask launch --nproc N -- <command>`: torchrun's standalone mode on this machine
//! (the engine is `vram_parallel::launch`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use vram_parallel::DistError;
use vram_parallel::launch::Launch;

#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Processes to start (ranks 0..N).
    #[arg(long, value_name = "N")]
    nproc: usize,
    /// MASTER_ADDR: where rank 0 listens.
    #[arg(long, default_value = "127.0.0.1", value_name = "ADDR")]
    master_addr: String,
    /// MASTER_PORT (default: a free port of ADDR).
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
    /// Write rank r's output to DIR/rank<r>.log instead of this terminal.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Kill every rank and fail when the job runs longer than this many seconds.
    #[arg(long, value_name = "SECONDS")]
    timeout: Option<f64>,
    /// The command each rank runs, after `--`.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    command: Vec<String>,
}

pub fn run(args: LaunchArgs) -> Result<ExitCode, String> {
    let timeout = match args.timeout {
        None => None,
        Some(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
        Some(s) => return Err(format!("--timeout {s}: give a positive number of seconds")),
    };
    if let Some(dir) = &args.log_dir {
        std::fs::create_dir_all(dir).map_err(|e| format!("--log-dir {}: {e}", dir.display()))?;
    }
    let launch = Launch {
        master_addr: args.master_addr,
        master_port: args.master_port,
        timeout,
        log_dir: args.log_dir,
        ..Launch::new(args.nproc)
    };
    let (program, rest) = args.command.split_first().ok_or("give the command after `--`")?;
    match launch.run(program.as_str(), &rest.iter().map(String::as_str).collect::<Vec<_>>()) {
        Ok(done) => {
            eprintln!(
                "launch: {} ranks done in {:.1} s (MASTER_PORT {})",
                args.nproc,
                done.elapsed.as_secs_f64(),
                done.master_port
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ DistError::RankFailed { .. }) => {
            eprintln!("error: {e}");
            Ok(ExitCode::FAILURE)
        }
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: LaunchArgs,
    }

    fn args(argv: &[&str]) -> LaunchArgs {
        let mut full = vec!["launch"];
        full.extend(argv);
        Cli::try_parse_from(full).expect("parses").args
    }

    #[test]
    fn the_command_after_the_double_dash_keeps_its_own_flags() {
        let a = args(&["--nproc", "2", "--", "prog", "--nproc", "-x"]);
        assert_eq!(a.nproc, 2);
        assert_eq!(a.command, ["prog", "--nproc", "-x"]);
        assert!(Cli::try_parse_from(["launch", "--nproc", "2"]).is_err(), "a command is required");
    }

    #[test]
    fn a_failing_rank_makes_the_launcher_fail_and_a_good_job_succeeds() {
        let bad = run(args(&["--nproc", "3", "--", "sh", "-c", "exit $RANK"])).unwrap();
        assert_eq!(bad, ExitCode::FAILURE);
        let good =
            run(args(&["--nproc", "2", "--", "sh", "-c", "test \"$WORLD_SIZE\" = 2"])).unwrap();
        assert_eq!(good, ExitCode::SUCCESS);
        assert!(run(args(&["--nproc", "0", "--", "true"])).is_err());
    }
}
