//! A GPT trained with ZeRO-2 (and DDP) by 4 processes over the TCP backend, started by the
//! launcher behind `cargo xtask launch` (this binary re-runs itself as the ranks: the
//! ignored test `gpt_rank`): the final weights equal, bit for bit, one process training the
//! 4 ranks as threads, and each process's memory is what the same rank on a thread holds.
//! (The `zero2_gpt` example is the same at the `gpt` preset's size.)

use std::path::PathBuf;
use std::time::{Duration, Instant};

use vram_harness::data::Dataset;
use vram_harness::dp::DpJob;
use vram_harness::models::Arch;
use vram_kernels::{AdamWConfig, DType};
use vram_parallel::launch::Launch;
use vram_parallel::{DpConfig, HostCollective, ProcessGroupConfig, Strategy, TIMEOUT_VAR, TcpComm};

const N: usize = 4;

/// The `gpt` preset's shape at a test's size (dropout kept: every rank draws the same masks
/// in a process as on a thread).
fn job(strategy: Strategy) -> DpJob {
    let arch =
        Arch::Gpt { vocab: 64, d: 32, layers: 2, heads: 4, seq: 16, dropout: 0.1, tied: false };
    DpJob {
        arch,
        data: Dataset::Sequences { vocab: 64, seq: 16 },
        dtype: DType::F32,
        config: DpConfig {
            adamw: AdamWConfig { lr: 1e-3, ..AdamWConfig::default() },
            ..DpConfig::new(strategy)
        },
        samples: 8,
        steps: 3,
        seed: 5,
        device_memory: 64 << 20,
    }
}

fn strategy(name: &str) -> Strategy {
    Strategy::ALL.into_iter().find(|s| s.name() == name).unwrap()
}

/// One rank: trains, writes `peak state bits...` to `$VRAM_TEST_OUT/rank<r>.txt`.
#[test]
#[ignore = "a rank of the multi-process test: it starts it"]
fn gpt_rank() {
    let Ok(out) = std::env::var("VRAM_TEST_OUT") else { return };
    let s = strategy(&std::env::var("VRAM_TEST_STRATEGY").unwrap());
    let cfg = ProcessGroupConfig::from_env().unwrap();
    let comm = TcpComm::connect(&cfg).unwrap();
    let (report, params) = job(s).train_process(Box::new(HostCollective::new(comm))).unwrap();
    let bits: Vec<String> = params.iter().flatten().map(|x| x.to_bits().to_string()).collect();
    let line =
        format!("{} {} {}", report.peak_allocated, report.state_requested_bytes, bits.join(","));
    std::fs::write(PathBuf::from(out).join(format!("rank{}.txt", cfg.rank)), line).unwrap();
}

#[test]
fn four_processes_train_a_gpt_to_the_bits_and_memory_of_one_process() {
    let started = Instant::now();
    for s in [Strategy::Zero2, Strategy::Ddp] {
        let dir =
            std::env::temp_dir().join(format!("vram-gpt-mp-{}-{}", s.name(), std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let launch = Launch {
            timeout: Some(Duration::from_secs(120)),
            env: vec![
                ("VRAM_TEST_OUT".into(), dir.to_string_lossy().into_owned()),
                ("VRAM_TEST_STRATEGY".into(), s.name().into()),
                (TIMEOUT_VAR.into(), "60".into()),
            ],
            log_dir: Some(dir.clone()),
            ..Launch::new(N)
        };
        let exe = std::env::current_exe().unwrap().to_string_lossy().into_owned();
        let args = ["gpt_rank", "--exact", "--ignored", "--nocapture", "--test-threads=1"]
            .map(String::from);
        launch.run(exe, &args).unwrap();
        let threads = job(s).train_threads(N).unwrap();
        for (r, (report, params)) in threads.iter().enumerate() {
            let text = std::fs::read_to_string(dir.join(format!("rank{r}.txt"))).unwrap();
            let f: Vec<&str> = text.splitn(3, ' ').collect();
            let bits: Vec<u32> = f[2].split(',').map(|x| x.parse().unwrap()).collect();
            let want: Vec<u32> = params.iter().flatten().map(|x| x.to_bits()).collect();
            assert_eq!(bits, want, "{} rank {r}: weights", s.name());
            assert_eq!(
                f[0].parse::<u64>().unwrap(),
                report.peak_allocated,
                "{} rank {r}: peak",
                s.name()
            );
            assert_eq!(
                f[1].parse::<u64>().unwrap(),
                report.state_requested_bytes,
                "{} rank {r}",
                s.name()
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    println!("4 processes, ZeRO-2 and DDP: {:?}", started.elapsed());
}
