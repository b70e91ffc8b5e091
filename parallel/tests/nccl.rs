//! NCCL on CUDA devices: one rank per GPU of this machine (1 when there is one), DDP and
//! ZeRO-3 steps equal single-device training on the host. Skips without a CUDA device or
//! without the NCCL library, saying so on stderr; with `VRAM_REQUIRE_NCCL=1` (set by the GPU
//! kit's `env.sh` where it found NCCL) a missing library fails instead. (Not yet run on a
//! GPU.)

#![cfg(feature = "cuda")]

mod common;

use std::io::Write as _;

use common::{Mlp, Rows, rows, single_device};
use vram_kernels::{AdamWConfig, DType, Device};
use vram_parallel::{Collective, DpConfig, NCCL_MISSING, NcclCollective, Strategy, train};

#[test]
fn nccl_ranks_train_like_a_single_host_device() {
    let devices: Vec<Device> = (0..8).map_while(|i| Device::cuda(i).ok()).collect();
    if devices.is_empty() {
        let _ = writeln!(std::io::stderr(), "skipped: no CUDA device");
        return;
    }
    if !NcclCollective::is_available() {
        let required = std::env::var("VRAM_REQUIRE_NCCL").is_ok_and(|v| !v.is_empty() && v != "0");
        assert!(!required, "VRAM_REQUIRE_NCCL is set: {NCCL_MISSING}");
        // Straight to stderr: the test harness does not capture it, and the GPU kit greps it.
        let _ = writeln!(std::io::stderr(), "skipped: no NCCL library ({NCCL_MISSING})");
        return;
    }
    let n = devices.len();
    println!("NCCL with {n} rank(s)");
    let dims = [6, 10, 3];
    let batches: Vec<Rows> = (0..3).map(|s| rows(s, 8 * n, 6, 3)).collect();
    let adamw = AdamWConfig { lr: 0.01, ..AdamWConfig::default() };
    let reference = single_device(&dims, &batches, adamw);
    for strategy in Strategy::ALL {
        let comms: Vec<Box<dyn Collective>> = NcclCollective::connect(&devices)
            .unwrap()
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Collective>)
            .collect();
        let replicas = devices.iter().map(|d| Mlp::new(d, &dims, DType::F32)).collect();
        let config = DpConfig { adamw, ..DpConfig::new(strategy) };
        for r in train(replicas, comms, config, &batches, |t| t.full_params()) {
            let (_, params) = r.unwrap();
            for (x, y) in params.iter().flatten().zip(reference.iter().flatten()) {
                assert!(
                    (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                    "{}: {x} vs {y}",
                    strategy.name()
                );
            }
        }
    }
}
