//! The data-parallel trainer on N host devices: every strategy equals single-device
//! training on the global batch, ZeRO's memory is the analytic partition, a failed rank is
//! an error on every rank, and virtual devices allocate what host devices allocate.

mod common;

use std::time::Duration;

use common::{Mlp, Rows, rows, single_device};
use vram_kernels::{AdamWConfig, DType, Device};
use vram_parallel::{
    Collective, CommError, DistError, DpConfig, HostCollective, InProcessGroup, Metered,
    RankReport, Strategy, VirtualCollective, ring_bytes_per_param, train,
};

const T: Duration = Duration::from_secs(30);

fn host_comms(n: usize) -> Vec<Box<dyn Collective>> {
    InProcessGroup::connect(n, T)
        .unwrap()
        .into_iter()
        .map(|c| Box::new(HostCollective::new(c)) as Box<dyn Collective>)
        .collect()
}

fn virtual_comms(n: usize) -> Vec<Box<dyn Collective>> {
    InProcessGroup::connect(n, T)
        .unwrap()
        .into_iter()
        .map(|c| Box::new(VirtualCollective::new(c)) as Box<dyn Collective>)
        .collect()
}

fn adamw() -> AdamWConfig {
    AdamWConfig { lr: 0.01, weight_decay: 0.01, ..AdamWConfig::default() }
}

/// Every parameter's values.
type Params = Vec<Vec<f32>>;

/// Runs `strategy` on `n` devices made by `device`; returns each rank's report and full
/// parameters (`None` on virtual devices).
fn run(
    n: usize,
    dims: &[usize],
    dtype: DType,
    config: DpConfig,
    batches: &[Rows],
    device: impl Fn(usize) -> Device,
) -> Vec<Result<(RankReport, Option<Params>), DistError>> {
    let devices: Vec<Device> = (0..n).map(device).collect();
    let virt = devices[0].is_virtual();
    let replicas = devices.iter().map(|d| Mlp::new(d, dims, dtype)).collect();
    let comms = if virt { virtual_comms(n) } else { host_comms(n) };
    train(
        replicas,
        comms,
        config,
        batches,
        |t| {
            if virt { Ok(None) } else { t.full_params().map(Some) }
        },
    )
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{what}: {x} vs {y}");
    }
}

#[test]
fn every_strategy_on_n_devices_equals_single_device_training_on_the_global_batch() {
    // Odd sizes: parameters that do not divide by N exercise ZeRO's padded shards.
    let dims = [6, 10, 3];
    let batches: Vec<Rows> = (0..3).map(|s| rows(s, 16, 6, 3)).collect();
    let reference = single_device(&dims, &batches, adamw());
    for n in [1, 2, 4, 8] {
        for strategy in Strategy::ALL {
            // Bucket caps of 1 element, of a few parameters, and DDP's default.
            for cap in [4, 160, vram_parallel::DEFAULT_BUCKET_CAP_BYTES] {
                let config =
                    DpConfig { bucket_cap_bytes: cap, adamw: adamw(), ..DpConfig::new(strategy) };
                let out = run(n, &dims, DType::F32, config, &batches, |_| Device::host(64 << 20));
                for r in out {
                    let (_, params) = r.unwrap();
                    close(
                        &params.unwrap(),
                        &reference,
                        &format!("{} n={n} cap={cap}", strategy.name()),
                    );
                }
                if strategy != Strategy::Ddp {
                    break; // the cap only matters to DDP
                }
            }
        }
    }
}

#[test]
fn zero_stages_give_the_same_parameters_as_ddp_bit_for_bit() {
    let dims = [8, 12, 5];
    let batches: Vec<Rows> = (0..4).map(|s| rows(s + 10, 8, 8, 5)).collect();
    let params = |s| {
        let config = DpConfig { adamw: adamw(), ..DpConfig::new(s) };
        run(4, &dims, DType::F32, config, &batches, |_| Device::host(64 << 20))
            .into_iter()
            .map(|r| r.unwrap().1.unwrap())
            .collect::<Vec<_>>()
    };
    let ddp = params(Strategy::Ddp);
    for s in [Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        assert_eq!(params(s), ddp, "{}", s.name());
    }
}

/// Per-device bytes of model states in DeepSpeed's accounting (2-byte weights and
/// gradients, 12 bytes of optimizer state: f32 master, two moments), for P parameters.
fn analytic(strategy: Strategy, p: f64, n: f64) -> f64 {
    match strategy {
        Strategy::Ddp => 16.0 * p,
        Strategy::Zero1 => 4.0 * p + 12.0 * p / n,
        Strategy::Zero2 => 2.0 * p + 14.0 * p / n,
        Strategy::Zero3 => 16.0 * p / n,
        Strategy::DataParallel => f64::NAN,
    }
}

#[test]
fn zero_memory_per_device_is_the_analytic_partition_of_16_bytes_per_parameter() {
    let dims = [256, 512, 384, 10];
    let batches: Vec<Rows> = (0..2).map(|s| rows(s, 16, 256, 10)).collect();
    let probe = Mlp::new(&Device::host(64 << 20), &dims, DType::BF16);
    let (p, tensors) = (probe.param_count() as f64, probe.tensor_count() as f64);
    for n in [1usize, 2, 4, 8] {
        for strategy in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
            // DDP's buckets are freed after each reduction here, so only model states count.
            let config =
                DpConfig { keep_buckets: false, adamw: adamw(), ..DpConfig::new(strategy) };
            let out = run(n, &dims, DType::BF16, config, &batches, |_| Device::host(256 << 20));
            let want = analytic(strategy, p, n as f64);
            // Rounding: each of at most 6 tensors per parameter tensor rounds up to 512 B;
            // each shard pads by fewer than N elements of at most 16 bytes together.
            let tol = tensors * 6.0 * 512.0 + tensors * 16.0 * n as f64;
            for r in out {
                let (rep, _) = r.unwrap();
                let got = rep.state_bytes as f64;
                assert!(
                    (got - want).abs() <= tol,
                    "{} n={n} rank {}: {got} bytes, analytic {want} (tolerance {tol})",
                    strategy.name(),
                    rep.rank
                );
            }
        }
    }
}

#[test]
fn data_parallel_loads_device_0_more_and_ddp_does_not() {
    let dims = [64, 128, 32];
    let batches: Vec<Rows> = (0..2).map(|s| rows(s, 32, 64, 32)).collect();
    let peaks = |s| {
        run(4, &dims, DType::F32, DpConfig::new(s), &batches, |_| Device::host(64 << 20))
            .into_iter()
            .map(|r| r.unwrap().0.peak_allocated)
            .collect::<Vec<_>>()
    };
    let dp = peaks(Strategy::DataParallel);
    assert!(dp[1..].iter().all(|&p| dp[0] > p), "{dp:?}");
    let ddp = peaks(Strategy::Ddp);
    assert!(ddp.iter().all(|&p| p == ddp[0]), "{ddp:?}");
}

#[test]
fn an_out_of_memory_rank_is_a_clear_error_on_every_rank_without_hanging() {
    let dims = [256, 1024, 10];
    let batches: Vec<Rows> = (0..2).map(|s| rows(s, 64, 256, 10)).collect();
    for strategy in Strategy::ALL {
        let t0 = std::time::Instant::now();
        // Device 2 (one 2 MiB segment) holds the 1 MiB of weights but not a training step.
        let out = run(4, &dims, DType::F32, DpConfig::new(strategy), &batches, |r| {
            Device::host(if r == 2 { 2 << 20 } else { 64 << 20 })
        });
        assert!(t0.elapsed() < T / 2, "{}: took {:?}", strategy.name(), t0.elapsed());
        for (r, o) in out.into_iter().enumerate() {
            let e = o.expect_err("every rank fails");
            assert!(e.is_out_of_memory(), "{} rank {r}: {e}", strategy.name());
            if r == 2 {
                assert!(matches!(e, DistError::Kernel(_)), "{e}");
            } else {
                match e {
                    DistError::Comm(CommError::Aborted { by: 2, reason }) => {
                        assert!(reason.starts_with("rank 2: out of memory"), "{reason}")
                    }
                    e => {
                        panic!("{} rank {r}: expected an abort by rank 2, got {e}", strategy.name())
                    }
                }
            }
        }
    }
}

#[test]
fn virtual_devices_allocate_what_host_devices_allocate() {
    let dims = [32, 48, 7];
    let batches: Vec<Rows> = (0..2).map(|s| rows(s, 16, 32, 7)).collect();
    for strategy in Strategy::ALL {
        for dtype in [DType::F32, DType::BF16] {
            let figures = |virt: bool| {
                run(4, &dims, dtype, DpConfig::new(strategy), &batches, |_| {
                    let v = Device::virtual_device(64 << 20);
                    if virt {
                        return v;
                    }
                    // The virtual device stands for a GPU, whose cuBLAS workspace the host
                    // lacks: give the host the same.
                    let h = Device::host(64 << 20);
                    h.set_blas_workspace_size(v.blas_workspace_size());
                    h
                })
                .into_iter()
                .map(|r| {
                    let rep = r.unwrap().0;
                    (rep.peak_allocated, rep.peak_reserved, rep.state_bytes)
                })
                .collect::<Vec<_>>()
            };
            assert_eq!(figures(true), figures(false), "{} {dtype}", strategy.name());
        }
    }
}

#[test]
fn a_batch_that_does_not_split_evenly_is_refused_on_every_rank() {
    let batches = vec![rows(0, 6, 4, 2)];
    let out = run(4, &[4, 2], DType::F32, DpConfig::new(Strategy::Ddp), &batches, |_| {
        Device::host(16 << 20)
    });
    for o in out {
        let e = o.unwrap_err();
        assert!(e.to_string().contains("do not split") || matches!(e, DistError::Comm(_)), "{e}");
    }
}

#[test]
fn metered_collectives_move_the_ring_bytes_per_parameter_per_step_of_each_strategy() {
    // Every parameter divides by 4 ranks: no shard padding, so the counts are exact.
    let dims = [8, 12, 4];
    let n = 4;
    let batches: Vec<Rows> = (0..3).map(|s| rows(s, 16, 8, 4)).collect();
    let p = Mlp::new(&Device::host(16 << 20), &dims, DType::F32).param_count() as u64;
    for dtype in [DType::F32, DType::BF16] {
        let bytes = dtype.size_in_bytes();
        for strategy in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
            let comms: Vec<Box<dyn Collective>> = InProcessGroup::connect(n, T)
                .unwrap()
                .into_iter()
                .map(|c| Box::new(Metered::new(HostCollective::new(c))) as Box<dyn Collective>)
                .collect();
            let replicas =
                (0..n).map(|_| Mlp::new(&Device::host(16 << 20), &dims, dtype)).collect();
            let want = ring_bytes_per_param(strategy, n, bytes).unwrap() * (p * 3) as f64;
            for r in train(replicas, comms, DpConfig::new(strategy), &batches, |_| Ok(())) {
                let t = r.unwrap().0.step_traffic.unwrap();
                assert_eq!(t.sent as f64, want, "{} {dtype}", strategy.name());
            }
        }
    }
    // ZeRO-3 moves 1.5 times DDP's bytes; ZeRO-1 and 2 the same as DDP.
    assert_eq!(ring_bytes_per_param(Strategy::Zero3, 8, 2), Some(1.5 * 2.0 * 2.0 * 7.0 / 8.0));
}

/// A group whose collectives return as if they had run but which reports an abort when
/// checked: NCCL's case, where an abort ends a collective's kernel early and the device's
/// synchronization returns as if it had finished.
struct AbortedUnseen(Box<dyn Collective>);

impl Collective for AbortedUnseen {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce(
        &self,
        t: &mut vram_kernels::Tensor,
        op: vram_parallel::ReduceOp,
    ) -> Result<(), DistError> {
        self.0.all_reduce(t, op)
    }
    fn reduce_scatter(
        &self,
        input: &vram_kernels::Tensor,
        output: &mut vram_kernels::Tensor,
        op: vram_parallel::ReduceOp,
    ) -> Result<(), DistError> {
        self.0.reduce_scatter(input, output, op)
    }
    fn all_gather(
        &self,
        input: &vram_kernels::Tensor,
        output: &mut vram_kernels::Tensor,
    ) -> Result<(), DistError> {
        self.0.all_gather(input, output)
    }
    fn broadcast(&self, t: &mut vram_kernels::Tensor, root: usize) -> Result<(), DistError> {
        self.0.broadcast(t, root)
    }
    fn reduce(&self, t: &mut vram_kernels::Tensor, root: usize) -> Result<(), DistError> {
        self.0.reduce(t, root)
    }
    fn gather(
        &self,
        input: &vram_kernels::Tensor,
        output: Option<&mut vram_kernels::Tensor>,
        root: usize,
    ) -> Result<(), DistError> {
        self.0.gather(input, output, root)
    }
    fn scatter(
        &self,
        input: Option<&vram_kernels::Tensor>,
        output: &mut vram_kernels::Tensor,
        root: usize,
    ) -> Result<(), DistError> {
        self.0.scatter(input, output, root)
    }
    fn copy_elements(
        &self,
        src: &vram_kernels::Tensor,
        src_offset: usize,
        dst: &mut vram_kernels::Tensor,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DistError> {
        self.0.copy_elements(src, src_offset, dst, dst_offset, len)
    }
    fn abort(&self, reason: &str) {
        self.0.abort(reason);
    }
    fn check(&self) -> Result<(), DistError> {
        Err(DistError::Comm(CommError::Aborted {
            by: 1,
            reason: "a peer ran out of memory".into(),
        }))
    }
}

/// A rank whose collectives seemed to finish checks the group after each step's
/// synchronization: an abort it finds there is its error, not values it trusts.
#[test]
fn an_abort_seen_only_after_the_device_waited_is_an_error() {
    let d = Device::host(1 << 30);
    let dims = [6, 10, 3];
    let batches: Vec<Rows> = (0..2).map(|s| rows(s, 8, 6, 3)).collect();
    let comm = host_comms(1).pop().unwrap();
    let results = train(
        vec![Mlp::new(&d, &dims, DType::F32)],
        vec![Box::new(AbortedUnseen(comm)) as Box<dyn Collective>],
        DpConfig { adamw: adamw(), ..DpConfig::new(Strategy::Ddp) },
        &batches,
        |_| Ok(()),
    );
    match &results[0] {
        Err(DistError::Comm(CommError::Aborted { by: 1, reason })) => {
            assert!(reason.contains("out of memory"), "{reason}");
        }
        other => panic!("expected the abort, got {other:?}"),
    }
}
