//! The ZeRO-2 data flow on the collectives alone: reduce-scatter the flat gradient, update
//! this rank's shard, all-gather the parameters; equals the all-reduce (DDP) update.

use std::time::Duration;

use vram_parallel::{Communicator, InProcessGroup, ReduceOp};

#[test]
fn reduce_scatter_update_all_gather_equals_all_reduce_update() {
    let n = 4;
    let shard = 5;
    let len = n * shard;
    let comms = InProcessGroup::connect(n, Duration::from_secs(20)).unwrap();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let mut p_ddp: Vec<f32> = (0..len).map(|i| i as f32 * 0.01).collect();
                let mut p_zero = p_ddp.clone();
                for step in 0..3 {
                    let g: Vec<f32> =
                        (0..len).map(|i| ((i * (c.rank() + 1) + step) % 7) as f32 - 3.0).collect();
                    // DDP: average everything, update everything.
                    let mut avg = g.clone();
                    c.all_reduce(&mut avg, ReduceOp::Average).unwrap();
                    p_ddp.iter_mut().zip(&avg).for_each(|(p, g)| *p -= 0.1 * g);
                    // ZeRO-2: own shard of the averaged gradient, update it, gather params.
                    let mut gs = vec![0.0; shard];
                    c.reduce_scatter(&g, &mut gs, ReduceOp::Average).unwrap();
                    let mine: Vec<f32> = p_zero[c.rank() * shard..(c.rank() + 1) * shard]
                        .iter()
                        .zip(&gs)
                        .map(|(p, g)| p - 0.1 * g)
                        .collect();
                    c.all_gather(&mine, &mut p_zero).unwrap();
                }
                (p_ddp, p_zero)
            })
        })
        .collect();
    for h in handles {
        let (a, b) = h.join().unwrap();
        assert_eq!(a, b);
    }
}
