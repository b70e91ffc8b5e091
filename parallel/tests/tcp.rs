//! The TCP backend with its ranks on threads of this process (the multi-process tests are
//! in `multi_process.rs`): every collective gives the in-process group's bits, counts its
//! bytes on the wire, and every way a rendezvous can fail is an error naming the culprit.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use vram_parallel::{
    CommError, Communicator, InProcessGroup, ProcessGroupConfig, ReduceOp, TcpComm,
};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn config(rank: usize, n: usize, port: u16, timeout: Duration) -> ProcessGroupConfig {
    ProcessGroupConfig { timeout, ..ProcessGroupConfig::new(rank, n, "127.0.0.1", port) }
}

/// Runs `f(rank, comm)` on `n` ranks: TCP ranks connected on threads, or in-process ones.
fn on_ranks<T: Send>(
    n: usize,
    tcp: bool,
    f: impl Fn(usize, &dyn Communicator) -> T + Sync,
) -> Vec<T> {
    let port = free_port();
    let in_process =
        if tcp { None } else { Some(InProcessGroup::connect(n, Duration::from_secs(10)).unwrap()) };
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = match in_process {
            Some(comms) => {
                comms.into_iter().enumerate().map(|(r, c)| s.spawn(move || f(r, &c))).collect()
            }
            None => (0..n)
                .map(|r| {
                    s.spawn(move || {
                        let c =
                            TcpComm::connect(&config(r, n, port, Duration::from_secs(10))).unwrap();
                        f(r, &c)
                    })
                })
                .collect(),
        };
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Values whose sums depend on the order of addition.
fn values(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 31 + rank * 17) % 23) as f32 * 0.1 + 1e-7 * (rank + 1) as f32 / 3.0)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn every_collective_gives_the_in_process_groups_bits() {
    for n in [1, 2, 3] {
        let run = |tcp| {
            on_ranks(n, tcp, |r, c| {
                let mut out = Vec::new();
                for op in [ReduceOp::Sum, ReduceOp::Average] {
                    let mut v = values(r, 37);
                    c.all_reduce(&mut v, op).unwrap();
                    out.push(bits(&v));
                    let mut chunk = vec![0.0; 5];
                    c.reduce_scatter(&values(r, 5 * n), &mut chunk, op).unwrap();
                    out.push(bits(&chunk));
                }
                let mut all = vec![0.0; 4 * n];
                c.all_gather(&values(r, 4), &mut all).unwrap();
                out.push(bits(&all));
                for root in 0..n {
                    let mut v = values(r, 6);
                    c.broadcast(&mut v, root).unwrap();
                    out.push(bits(&v));
                }
                let mut empty: Vec<f32> = Vec::new();
                c.all_reduce(&mut empty, ReduceOp::Sum).unwrap();
                out
            })
        };
        assert_eq!(run(true), run(false), "n = {n}");
    }
}

#[test]
fn the_wire_carries_each_collectives_values_once_each_way() {
    // 3 ranks, all-reduce of 10 values: ranks 1 and 2 send and receive one frame of 10;
    // rank 0 receives two and sends two.
    let traffic = on_ranks(3, true, |r, c| {
        let mut v = values(r, 10);
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let mut b = values(r, 10);
        c.broadcast(&mut b, 0).unwrap();
        c.traffic().unwrap()
    });
    let frame = |k: u64| TcpComm::FRAME_HEADER_BYTES + 4 * k;
    // all-reduce: 10 up, 10 down; broadcast from 0: an empty frame up, 10 down.
    let spoke_sent = frame(10) + frame(0);
    let spoke_received = frame(10) + frame(10);
    for t in &traffic[1..] {
        assert_eq!((t.sent, t.received, t.calls), (spoke_sent, spoke_received, 2));
    }
    assert_eq!((traffic[0].sent, traffic[0].received), (2 * spoke_received, 2 * spoke_sent));
}

#[test]
fn a_collective_of_the_wrong_length_or_out_of_step_fails_on_every_rank() {
    let out = on_ranks(3, true, |r, c| {
        let mut v = values(r, if r == 2 { 4 } else { 3 });
        let first = c.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        // The group stays aborted.
        let later = c.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        (first.to_string(), later.to_string())
    });
    for (r, (first, later)) in out.iter().enumerate() {
        assert!(first.contains("rank 2"), "rank {r}: {first}");
        assert!(later.contains("rank 2") || later.contains("aborted"), "rank {r}: {later}");
    }
    let out = on_ranks(2, true, |r, c| {
        let mut v = values(r, 3);
        let e = if r == 0 {
            c.all_reduce(&mut v, ReduceOp::Sum).unwrap_err()
        } else {
            c.broadcast(&mut v, 0).unwrap_err()
        };
        e.to_string()
    });
    assert!(out[0].contains("rank 1") && out[0].contains("out of step"), "{}", out[0]);
    assert!(out[1].contains("out of step"), "{}", out[1]);
}

#[test]
fn an_abort_reaches_every_rank_with_its_reason() {
    let out = on_ranks(3, true, |r, c| {
        if r == 1 {
            c.abort("rank 1: out of memory");
        }
        let mut v = values(r, 3);
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap_err()
    });
    for e in out {
        match e {
            CommError::Aborted { by: 1, reason } => assert!(reason.contains("out of memory")),
            e => panic!("{e}"),
        }
    }
}

#[test]
fn a_rank_that_never_comes_is_named_by_every_rank_that_did() {
    let port = free_port();
    let t = Duration::from_millis(600);
    let started = Instant::now();
    let errors: Vec<CommError> = std::thread::scope(|s| {
        let h: Vec<_> = [0, 1]
            .into_iter()
            .map(|r| s.spawn(move || TcpComm::connect(&config(r, 3, port, t)).unwrap_err()))
            .collect();
        h.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    for e in errors {
        match &e {
            CommError::MissingRanks { missing, world_size: 3, .. } => assert_eq!(missing, &[2]),
            e => panic!("{e}"),
        }
        assert!(e.to_string().contains("[2]"), "{e}");
    }
}

#[test]
fn ranks_that_disagree_on_the_world_size_fail_naming_the_rank() {
    let port = free_port();
    let t = Duration::from_secs(5);
    let errors: Vec<String> = std::thread::scope(|s| {
        let h: Vec<_> = [(0, 2), (1, 3)]
            .into_iter()
            .map(|(r, n)| {
                s.spawn(move || TcpComm::connect(&config(r, n, port, t)).unwrap_err().to_string())
            })
            .collect();
        h.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.contains("rank 1 says WORLD_SIZE=3, rank 0 says WORLD_SIZE=2"), "{e}");
    }
}

#[test]
fn a_taken_port_is_an_error_naming_it_and_the_other_ranks_do_not_hang() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let t = Duration::from_millis(500);
    let e = TcpComm::connect(&config(0, 2, port, t)).unwrap_err();
    assert!(matches!(e, CommError::Listen { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains(&format!("127.0.0.1:{port}")) && text.contains("MASTER_PORT"), "{text}");
    // Rank 1 reaches the stranger holding the port, which never answers: a timeout.
    let started = Instant::now();
    let e = TcpComm::connect(&config(1, 2, port, t)).unwrap_err();
    assert!(matches!(e, CommError::Timeout { rank: 0, .. }), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // And a rank with nobody at the address at all says it could not reach rank 0.
    drop(taken);
    let e = TcpComm::connect(&config(1, 2, port, t)).unwrap_err();
    assert!(matches!(e, CommError::Unreachable { rank: 1, .. }), "{e}");
}
