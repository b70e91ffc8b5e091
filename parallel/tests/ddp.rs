//! DDP with buckets on N in-process ranks equals single-device training on the global batch.

use std::time::Duration;

use vram_parallel::{BucketPlan, Communicator, InProcessGroup};

/// A two-parameter-tensor linear model y = W x + b, mean squared error; returns the
/// gradients of the mean loss over `batch`.
fn grads(w: &[f32], b: &[f32], batch: &[(Vec<f32>, Vec<f32>)]) -> Vec<Vec<f32>> {
    let (o, i) = (b.len(), w.len() / b.len());
    let mut gw = vec![0.0; w.len()];
    let mut gb = vec![0.0; o];
    for (x, y) in batch {
        for r in 0..o {
            let pred: f32 = (0..i).map(|c| w[r * i + c] * x[c]).sum::<f32>() + b[r];
            let d = 2.0 * (pred - y[r]) / batch.len() as f32;
            gb[r] += d;
            for c in 0..i {
                gw[r * i + c] += d * x[c];
            }
        }
    }
    vec![gw, gb]
}

fn data(n: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..n)
        .map(|k| {
            let x: Vec<f32> = (0..6).map(|c| ((k * 7 + c * 3) % 11) as f32 / 11.0 - 0.5).collect();
            let y: Vec<f32> = (0..3).map(|r| x[r] - 0.5 * x[r + 3] + 0.1 * r as f32).collect();
            (x, y)
        })
        .collect()
}

fn sgd(params: &mut [Vec<f32>], grads: &[Vec<f32>], lr: f32) {
    for (p, g) in params.iter_mut().zip(grads) {
        p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g);
    }
}

#[test]
fn ddp_with_any_bucket_size_matches_single_device() {
    let global = 16;
    let steps = 5;
    let init = vec![vec![0.1f32; 18], vec![0.0f32; 3]];
    let batches: Vec<_> = (0..steps).map(|s| data(global + s)[s..].to_vec()).collect();

    let mut single = init.clone();
    for b in &batches {
        let g = grads(&single[0], &single[1], b);
        sgd(&mut single, &g, 0.1);
    }

    for n in [1, 2, 4, 8] {
        for cap in [4, 12, 80, 1 << 20] {
            let comms = InProcessGroup::connect(n, Duration::from_secs(20)).unwrap();
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let (mut p, batches) = (init.clone(), batches.clone());
                    std::thread::spawn(move || {
                        let plan = BucketPlan::new(&[18, 3], cap);
                        let per = global / c.world_size();
                        for b in &batches {
                            let shard = &b[c.rank() * per..(c.rank() + 1) * per];
                            let mut g = grads(&p[0], &p[1], shard);
                            plan.all_reduce(&c, &mut g).unwrap();
                            sgd(&mut p, &g, 0.1);
                        }
                        p
                    })
                })
                .collect();
            for h in handles {
                let p = h.join().unwrap();
                for (a, b) in p.iter().flatten().zip(single.iter().flatten()) {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                        "n={n} cap={cap}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn buckets_follow_reverse_parameter_order_and_the_cap() {
    // 4-byte elements: 10, 20, 30 elements = 40, 80, 120 bytes.
    assert_eq!(BucketPlan::new(&[10, 20, 30], 200).buckets, vec![vec![2, 1], vec![0]]);
    assert_eq!(BucketPlan::new(&[10, 20, 30], 1).buckets, vec![vec![2], vec![1], vec![0]]);
    assert_eq!(
        BucketPlan::new(&[10, 20, 30], vram_parallel::DEFAULT_BUCKET_CAP_BYTES).buckets,
        vec![vec![2, 1, 0]]
    );
}
