//! Data parallel across processes: this test binary starts copies of itself (the ignored
//! test `rank_process`, told what to do by environment variables) as the ranks of a job
//! on 127.0.0.1, through the TCP backend and, for the training runs, the launcher behind
//! `cargo xtask launch`.
//!
//! - N = 2 and 4 processes train every strategy to the same bits as N ranks on threads of
//!   one process (the in-process group reduces in the same rank order), and within 1e-5 of
//!   one device on the whole batch (which sums the gradient in another order: not bit for
//!   bit); each rank's bytes on the wire per step are the star's analytic volume.
//! - A rank that dies mid-step (rank 2, or rank 0 which the others connect through) makes
//!   the others fail within a second with an error naming it; a rank that never comes is
//!   named by the ranks that did; the launcher stops the other ranks when one fails.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Mlp, Rows, rows, single_device};
use vram_kernels::{AdamWConfig, DType, Device, Tensor};
use vram_parallel::launch::Launch;
use vram_parallel::{
    BucketPlan, Collective, DistError, DpConfig, HostCollective, InProcessGroup,
    ProcessGroupConfig, ReduceOp, Strategy, TIMEOUT_VAR, TcpComm, Traffic, train, train_rank,
};

const DIMS: [usize; 3] = [6, 10, 3];
const STEPS: u64 = 3;

fn adamw() -> AdamWConfig {
    AdamWConfig { lr: 0.01, weight_decay: 0.01, ..AdamWConfig::default() }
}

/// The global batches every run trains on (24 rows: splits over 1, 2, 3 and 4 ranks).
fn batches() -> Vec<Rows> {
    (0..STEPS).map(|s| rows(s + 3, 24, DIMS[0], DIMS[2])).collect()
}

fn config(strategy: Strategy) -> DpConfig {
    DpConfig { adamw: adamw(), ..DpConfig::new(strategy) }
}

// ---- the child ------------------------------------------------------------------------

/// A collective that ends its process (exit code 17) at its `at`-th call: a rank dying
/// mid-step.
struct DieAt<C> {
    inner: C,
    at: usize,
    calls: std::cell::Cell<usize>,
}

impl<C: Collective> DieAt<C> {
    fn tick(&self) {
        let k = self.calls.get() + 1;
        self.calls.set(k);
        if k == self.at {
            std::process::exit(17);
        }
    }
}

impl<C: Collective> Collective for DieAt<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        self.tick();
        self.inner.all_reduce(t, op)
    }
    fn reduce_scatter(&self, i: &Tensor, o: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        self.tick();
        self.inner.reduce_scatter(i, o, op)
    }
    fn all_gather(&self, i: &Tensor, o: &mut Tensor) -> Result<(), DistError> {
        self.tick();
        self.inner.all_gather(i, o)
    }
    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.tick();
        self.inner.broadcast(t, root)
    }
    fn reduce(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.tick();
        self.inner.reduce(t, root)
    }
    fn gather(&self, i: &Tensor, o: Option<&mut Tensor>, root: usize) -> Result<(), DistError> {
        self.tick();
        self.inner.gather(i, o, root)
    }
    fn scatter(&self, i: Option<&Tensor>, o: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.tick();
        self.inner.scatter(i, o, root)
    }
    fn copy_elements(
        &self,
        s: &Tensor,
        so: usize,
        d: &mut Tensor,
        doff: usize,
        len: usize,
    ) -> Result<(), DistError> {
        self.inner.copy_elements(s, so, d, doff, len)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }
}

fn hex(params: &[Vec<f32>]) -> String {
    let v: Vec<String> = params
        .iter()
        .map(|p| p.iter().map(|x| format!("{:08x}", x.to_bits())).collect::<Vec<_>>().join(","))
        .collect();
    v.join(";")
}

fn unhex(s: &str) -> Vec<Vec<u32>> {
    s.split(';')
        .map(|p| {
            p.split(',')
                .filter(|x| !x.is_empty())
                .map(|x| u32::from_str_radix(x, 16).unwrap())
                .collect()
        })
        .collect()
}

/// One rank of a job, run by the tests below in child processes.
#[test]
#[ignore = "a rank of the multi-process tests: they start it"]
fn rank_process() {
    let Ok(scenario) = std::env::var("VRAM_TEST_SCENARIO") else { return };
    let out = PathBuf::from(std::env::var("VRAM_TEST_OUT").unwrap());
    let cfg = ProcessGroupConfig::from_env().unwrap();
    let mut lines = Vec::new();
    let victim: Option<usize> = std::env::var("VRAM_TEST_VICTIM").ok().map(|v| v.parse().unwrap());
    let strategies: Vec<Strategy> = match scenario.as_str() {
        "train" => Strategy::ALL.to_vec(),
        _ => vec![Strategy::Ddp],
    };
    for strategy in strategies {
        // Every strategy meets again on the same port: rank 0 listens anew.
        let result = TcpComm::connect(&cfg).map_err(DistError::from).and_then(|comm| {
            let host = HostCollective::new(comm);
            let comm: Box<dyn Collective> = match victim {
                // Setup's broadcasts are 4 calls; one step of DDP is 1: die in step 2.
                Some(v) if v == cfg.rank => {
                    Box::new(DieAt { inner: host, at: 6, calls: Default::default() })
                }
                _ => Box::new(host),
            };
            let replica = Mlp::new(&Device::host(64 << 20), &DIMS, DType::F32);
            train_rank(replica, comm, config(strategy), &batches(), |t| t.full_params())
        });
        match result {
            Ok((report, params)) => {
                let t = report.step_traffic.unwrap();
                lines.push(format!(
                    "{} {} {} {} {}",
                    strategy.name(),
                    t.sent,
                    t.received,
                    t.calls,
                    hex(&params)
                ));
            }
            Err(e) => lines.push(format!("error {e}")),
        }
    }
    std::fs::write(out.join(format!("rank{}.txt", cfg.rank)), lines.join("\n")).unwrap();
}

// ---- the parent -----------------------------------------------------------------------

/// The arguments that make this binary run `rank_process` only.
fn child_args() -> Vec<String> {
    ["rank_process", "--exact", "--ignored", "--nocapture", "--test-threads=1"]
        .map(String::from)
        .to_vec()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vram-mp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// What a rank wrote: per strategy name, (traffic, parameter bits), or its error.
type RankOut = BTreeMap<String, Result<(Traffic, Vec<Vec<u32>>), String>>;

fn read_rank(dir: &Path, rank: usize) -> RankOut {
    let text = std::fs::read_to_string(dir.join(format!("rank{rank}.txt")))
        .unwrap_or_else(|e| panic!("rank {rank} wrote nothing: {e}"));
    text.lines()
        .map(|l| {
            if let Some(e) = l.strip_prefix("error ") {
                return ("error".to_string(), Err(e.to_string()));
            }
            let f: Vec<&str> = l.splitn(5, ' ').collect();
            let n = |i: usize| f[i].parse::<u64>().unwrap();
            let t = Traffic { sent: n(1), received: n(2), calls: n(3) };
            (f[0].to_string(), Ok((t, unhex(f[4]))))
        })
        .collect()
}

fn bits(params: &[Vec<f32>]) -> Vec<Vec<u32>> {
    params.iter().map(|p| p.iter().map(|x| x.to_bits()).collect()).collect()
}

/// `n` ranks as threads of this process: the single-process reference.
fn in_process(n: usize, strategy: Strategy) -> Vec<Vec<f32>> {
    let comms: Vec<Box<dyn Collective>> = InProcessGroup::connect(n, Duration::from_secs(30))
        .unwrap()
        .into_iter()
        .map(|c| Box::new(HostCollective::new(c)) as Box<dyn Collective>)
        .collect();
    let replicas = (0..n).map(|_| Mlp::new(&Device::host(64 << 20), &DIMS, DType::F32)).collect();
    let mut out = train(replicas, comms, config(strategy), &batches(), |t| t.full_params());
    out.swap_remove(0).unwrap().1
}

/// Bytes a rank other than 0 sends and receives per step over the star (f32 values, a
/// frame header per message), from the collectives the strategy calls.
fn star_per_step(strategy: Strategy, n: usize) -> (u64, u64) {
    let f = |k: usize| TcpComm::FRAME_HEADER_BYTES + 4 * k as u64;
    let numels: Vec<usize> = DIMS.windows(2).flat_map(|w| [w[0] * w[1], w[1]]).collect();
    let (mut sent, mut received) = (0, 0);
    match strategy {
        Strategy::Ddp => {
            for b in BucketPlan::new(&numels, vram_parallel::DEFAULT_BUCKET_CAP_BYTES).buckets {
                let k: usize = b.iter().map(|&i| numels[i]).sum();
                sent += f(k);
                received += f(k);
            }
        }
        Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3 => {
            let gathers = if strategy == Strategy::Zero3 { 2 } else { 1 };
            for &p in &numels {
                let len = p.div_ceil(n);
                // reduce-scatter: the padded gradient up, this rank's shard down.
                sent += f(len * n);
                received += f(len);
                // all-gather(s): the shard up, the padded parameter down.
                sent += gathers * f(len);
                received += gathers * f(len * n);
            }
        }
        Strategy::DataParallel => unreachable!("not counted"),
    }
    (sent, received)
}

#[test]
fn n_processes_over_tcp_train_every_strategy_to_the_bits_of_one_process() {
    let started = Instant::now();
    let reference = single_device(&DIMS, &batches(), adamw());
    for n in [2, 4] {
        let dir = scratch(&format!("train{n}"));
        let launch = Launch {
            timeout: Some(Duration::from_secs(120)),
            env: vec![
                ("VRAM_TEST_SCENARIO".into(), "train".into()),
                ("VRAM_TEST_OUT".into(), dir.to_string_lossy().into_owned()),
                (TIMEOUT_VAR.into(), "30".into()),
            ],
            log_dir: Some(dir.clone()),
            ..Launch::new(n)
        };
        let exe = std::env::current_exe().unwrap();
        let exe = exe.to_string_lossy().into_owned();
        launch.run(exe, &child_args()).unwrap();
        let outs: Vec<RankOut> = (0..n).map(|r| read_rank(&dir, r)).collect();
        for strategy in Strategy::ALL {
            let want = in_process(n, strategy);
            for (r, out) in outs.iter().enumerate() {
                let what = format!("{} x{n} rank {r}", strategy.name());
                let (traffic, got) = out
                    .get(strategy.name())
                    .unwrap_or_else(|| panic!("{what}: {out:?}"))
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(got, &bits(&want), "{what}: not the in-process bits");
                for (x, y) in want.iter().flatten().zip(reference.iter().flatten()) {
                    assert!(
                        (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                        "{what}: {x} vs one device {y}"
                    );
                }
                if r > 0 && strategy != Strategy::DataParallel {
                    let (s, rcv) = star_per_step(strategy, n);
                    assert_eq!(
                        (traffic.sent, traffic.received),
                        (STEPS * s, STEPS * rcv),
                        "{what}"
                    );
                }
            }
            // Rank 0 moves what all the others move, the other way.
            let (sum_s, sum_r) = outs[1..]
                .iter()
                .map(|o| o[strategy.name()].as_ref().unwrap().0)
                .fold((0, 0), |a, t| (a.0 + t.sent, a.1 + t.received));
            let hub = outs[0][strategy.name()].as_ref().unwrap().0;
            assert_eq!((hub.sent, hub.received), (sum_r, sum_s), "{} x{n} rank 0", strategy.name());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    println!("2 and 4 processes, 5 strategies each: {:?}", started.elapsed());
}

/// Starts rank `rank` of a `world`-rank job on `port` for `scenario`, output captured.
fn spawn_rank(
    rank: usize,
    world: usize,
    port: u16,
    scenario: &str,
    dir: &Path,
    extra: &[(&str, &str)],
) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(child_args())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("VRAM_TEST_SCENARIO", scenario)
        .env("VRAM_TEST_OUT", dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Waits for `child` at most `limit`, killing it then.
fn wait(mut child: Child, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a rank still ran after {limit:?}: the group hangs");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_rank_that_dies_mid_step_is_named_by_every_other_rank_within_a_second() {
    for victim in [2, 0] {
        let dir = scratch(&format!("die{victim}"));
        let port = free_port();
        let v = victim.to_string();
        // A 30 s timeout: the others must notice the death, not time out.
        let extra = [("VRAM_TEST_VICTIM", v.as_str()), (TIMEOUT_VAR, "30")];
        let started = Instant::now();
        let children: Vec<Child> =
            (0..3).map(|r| spawn_rank(r, 3, port, "die", &dir, &extra)).collect();
        let codes: Vec<Option<i32>> =
            children.into_iter().map(|c| wait(c, Duration::from_secs(20))).collect();
        let elapsed = started.elapsed();
        assert_eq!(codes[victim], Some(17), "the victim died as planned");
        for r in (0..3).filter(|&r| r != victim) {
            assert_eq!(codes[r], Some(0), "rank {r} reported and exited");
            let out = read_rank(&dir, r);
            let e = out["error"].as_ref().unwrap_err();
            assert!(e.contains(&format!("rank {victim} is gone")), "rank {r}: {e}");
        }
        assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_rank_that_never_comes_is_named_by_the_processes_that_came() {
    let dir = scratch("never");
    let port = free_port();
    let started = Instant::now();
    let extra = [(TIMEOUT_VAR, "1")];
    let children: Vec<Child> =
        (0..2).map(|r| spawn_rank(r, 3, port, "never", &dir, &extra)).collect();
    for c in children {
        assert_eq!(wait(c, Duration::from_secs(20)), Some(0));
    }
    for r in 0..2 {
        let out = read_rank(&dir, r);
        let e = out["error"].as_ref().unwrap_err();
        assert!(e.contains("rank(s) [2] of 3 did not arrive"), "rank {r}: {e}");
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_launcher_stops_the_other_ranks_when_one_fails_and_names_it() {
    // Every rank sleeps for a minute but rank 1, which fails at once.
    let launch = Launch::new(3);
    let started = Instant::now();
    let e =
        launch.run("sh", &["-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60"]).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    match &e {
        DistError::RankFailed { failed } => assert_eq!(failed, &[(1, "exit code 3".to_string())]),
        e => panic!("{e}"),
    }
    assert!(e.to_string().contains("rank 1 failed (exit code 3)"), "{e}");
    // And every rank sees torchrun's variables.
    let done = launch
        .run(
            "sh",
            &["-c", "test \"$WORLD_SIZE\" = 3 -a \"$LOCAL_WORLD_SIZE\" = 3 -a \"$LOCAL_RANK\" = \"$RANK\" -a \"$MASTER_ADDR\" = 127.0.0.1 -a -n \"$MASTER_PORT\""],
        )
        .unwrap();
    assert!(done.master_port > 0);
}
