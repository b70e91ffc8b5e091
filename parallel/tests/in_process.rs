//! The in-process backend: correct collectives, and no hang when a rank fails.

use std::time::Duration;

use vram_parallel::{CommError, Communicator, InProcessComm, InProcessGroup, ReduceOp};

/// Runs `f` on every rank of a fresh group, returns the results in rank order.
fn on_ranks<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    f: impl Fn(InProcessComm) -> T + Send + Sync + Clone + 'static,
) -> Vec<std::thread::Result<T>> {
    let comms = InProcessGroup::connect(n, timeout).unwrap();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    handles.into_iter().map(|h| h.join()).collect()
}

const T: Duration = Duration::from_secs(20);

#[test]
fn all_reduce_sums_and_averages() {
    for n in [1, 2, 3, 4, 8] {
        let out = on_ranks(n, T, |c| {
            let r = c.rank() as f32;
            let mut s = vec![r, 2.0 * r, 1.0];
            c.all_reduce(&mut s, ReduceOp::Sum).unwrap();
            let mut a = vec![r; 5];
            c.all_reduce(&mut a, ReduceOp::Average).unwrap();
            (s, a)
        });
        let tot: f32 = (0..n).map(|r| r as f32).sum();
        for o in out {
            let (s, a) = o.unwrap();
            assert_eq!(s, vec![tot, 2.0 * tot, n as f32]);
            assert_eq!(a, vec![tot / n as f32; 5]);
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_chunk() {
    let n = 4;
    let out = on_ranks(n, T, move |c| {
        let input: Vec<f32> = (0..n * 3).map(|i| (i + c.rank()) as f32).collect();
        let mut out = vec![0.0; 3];
        c.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap();
        (c.rank(), out)
    });
    let rank_sum: usize = (0..n).sum();
    for o in out {
        let (r, got) = o.unwrap();
        let want: Vec<f32> = (0..3).map(|j| (n * (r * 3 + j) + rank_sum) as f32).collect();
        assert_eq!(got, want);
    }
}

#[test]
fn all_gather_concatenates_in_rank_order_and_broadcast_copies_root() {
    let n = 3;
    let out = on_ranks(n, T, move |c| {
        let mut g = vec![0.0; 2 * n];
        c.all_gather(&[c.rank() as f32, 10.0 + c.rank() as f32], &mut g).unwrap();
        let mut b = vec![c.rank() as f32; 4];
        c.broadcast(&mut b, 2).unwrap();
        (g, b)
    });
    for o in out {
        let (g, b) = o.unwrap();
        assert_eq!(g, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        assert_eq!(b, vec![2.0; 4]);
    }
}

#[test]
fn many_collectives_in_a_row_stay_in_step() {
    let out = on_ranks(4, T, |c| {
        let mut acc = 0.0;
        for k in 0..200 {
            let mut x = vec![(c.rank() * k) as f32];
            c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            acc += x[0];
        }
        acc
    });
    let want: f32 = (0..200).map(|k| (6 * k) as f32).sum();
    for o in out {
        assert_eq!(o.unwrap(), want);
    }
}

#[test]
fn a_failed_rank_is_an_error_on_every_rank() {
    // Rank 1 fails (say, out of memory) before the collective and aborts the group.
    let out = on_ranks(4, T, |c| {
        if c.rank() == 1 {
            c.abort("out of memory on device 1");
        }
        let mut x = vec![1.0; 8];
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    for o in out {
        match o.unwrap() {
            Err(CommError::Aborted { by: 1, reason }) => assert!(reason.contains("out of memory")),
            other => panic!("expected an abort by rank 1, got {other:?}"),
        }
    }
}

#[test]
fn a_panicking_rank_aborts_the_others() {
    let out = on_ranks(3, T, |c| {
        if c.rank() == 0 {
            panic!("rank 0 fails");
        }
        let mut x = vec![1.0];
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    assert!(out[0].is_err());
    for o in &out[1..] {
        assert!(matches!(o.as_ref().unwrap(), Err(CommError::Aborted { by: 0, .. })));
    }
}

#[test]
fn a_missing_rank_times_out_instead_of_hanging() {
    let out = on_ranks(3, Duration::from_millis(200), |c| {
        if c.rank() == 2 {
            return Ok(()); // never joins the collective
        }
        let mut x = vec![1.0];
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    for o in &out[..2] {
        let e = o.as_ref().unwrap().as_ref().unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
    }
}

#[test]
fn mismatched_lengths_abort_the_group() {
    let out = on_ranks(2, T, |c| {
        let mut x = vec![1.0; 2 + c.rank()];
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    for o in out {
        assert!(o.unwrap().is_err());
    }
}

#[test]
fn an_empty_group_is_refused() {
    assert!(InProcessGroup::connect(0, T).is_err());
}
