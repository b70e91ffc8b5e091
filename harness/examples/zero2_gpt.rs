//! Trains the small GPT (the zoo's `gpt` preset: vocab 256, d 128, 4 layers, seq 64) with
//! ZeRO-2 across the processes of a job on host devices, over the TCP backend, then checks
//! on rank 0 that the final weights equal, bit for bit, those of one process training the
//! same global batches with the same number of ranks as threads.
//!
//! ```text
//! cargo build --release -p vram-harness --example zero2_gpt
//! cargo xtask launch --nproc 4 -- target/release/examples/zero2_gpt [--steps 5] [--samples 8]
//! ```
//!
//! Any launcher that sets torchrun's variables and leaves `MASTER_PORT` free for rank 0 to
//! listen on should work (only `cargo xtask launch` has been tried: torchrun itself may hold
//! its own store on that port). Exit status 1 if the check fails or a rank fails (every rank
//! then says which).

use std::process::ExitCode;

use vram_harness::data::Dataset;
use vram_harness::dp::DpJob;
use vram_harness::human_bytes;
use vram_harness::models::Arch;
use vram_kernels::{AdamWConfig, DType};
use vram_parallel::{
    DpConfig, HostCollective, ProcessGroupConfig, Strategy, TcpComm, ring_bytes_per_param,
};

fn arg(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("{name} takes a positive integer")),
    }
}

fn run() -> Result<bool, String> {
    let (steps, samples) = (arg("--steps", 5)?, arg("--samples", 8)?);
    let cfg = ProcessGroupConfig::from_env().map_err(|e| e.to_string())?;
    let arch = Arch::preset("gpt").map_err(|e| e.to_string())?;
    let Arch::Gpt { vocab, seq, .. } = arch else {
        return Err("the gpt preset is not a GPT".into());
    };
    let job = DpJob {
        arch,
        data: Dataset::Sequences { vocab, seq },
        dtype: DType::F32,
        config: DpConfig {
            adamw: AdamWConfig { lr: 1e-3, ..AdamWConfig::default() },
            ..DpConfig::new(Strategy::Zero2)
        },
        samples,
        steps,
        seed: 0,
        device_memory: 1 << 30,
    };
    let comm = TcpComm::connect(&cfg).map_err(|e| e.to_string())?;
    let (report, params) =
        job.train_process(Box::new(HostCollective::new(comm))).map_err(|e| e.to_string())?;
    let count: usize = params.iter().map(Vec::len).sum();
    let per_step = report.step_traffic.map_or(0.0, |t| t.sent as f64 / steps as f64);
    println!(
        "rank {}/{}: {count} parameters, {steps} ZeRO-2 steps of {samples} sequences, peak \
         allocated {}, model states {}; sent {:.2} bytes per parameter per step over TCP \
         (f32 values, star around rank 0; a ring in f32 would send {:.2})",
        cfg.rank,
        cfg.world_size,
        human_bytes(report.peak_allocated),
        human_bytes(report.state_requested_bytes),
        per_step / count as f64,
        ring_bytes_per_param(Strategy::Zero2, cfg.world_size, 4).unwrap_or(0.0),
    );
    if cfg.rank != 0 {
        return Ok(true);
    }
    let threads = job.train_threads(cfg.world_size).map_err(|e| e.to_string())?;
    let want = &threads.first().ok_or("no ranks")?.1;
    let same = want.len() == params.len()
        && want
            .iter()
            .flatten()
            .zip(params.iter().flatten())
            .all(|(a, b)| a.to_bits() == b.to_bits());
    if same {
        println!(
            "rank 0: the final weights equal, bit for bit, one process's run of the same {} ranks \
             as threads",
            cfg.world_size
        );
    } else {
        eprintln!("rank 0: the final weights DIFFER from one process's run as threads");
    }
    Ok(same)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
