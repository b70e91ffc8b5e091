//! The TCP backend: one process per rank, on one machine or several, for host devices (and
//! tests) where NCCL has no GPU to run on.
//!
//! The ranks form a star around rank 0 (the connections of the rendezvous, see
//! [`ProcessGroupConfig`]). In each collective every other rank sends its values to rank 0,
//! which reads them in rank order, reduces them in rank order from zero (as the in-process
//! group does: the results are the same bits) and sends each rank its result. A rank whose
//! connection closes (its process died) or that stays silent past the timeout fails the
//! collective on every rank with an error naming it; an abort travels the same way.
//!
//! Rank 0 moves `N - 1` times what the others move: fine for tests and small jobs on a few
//! hosts, not a replacement for NCCL's rings on GPUs.

mod rendezvous;
pub(crate) mod wire;

use std::cell::{Cell, RefCell};
use std::net::TcpStream;
use std::time::Duration;

pub(crate) use rendezvous::{Links, rendezvous};
use wire::{ABORT, DATA, HEADER_BYTES, Reader};

use crate::comm::{CommError, Communicator, ReduceOp, Traffic, reduce_in_rank_order};
use crate::process_group::ProcessGroupConfig;

/// The collectives, as they travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
        }
    }

    fn from_u8(v: u8) -> Option<Op> {
        [Op::AllReduce, Op::ReduceScatter, Op::AllGather, Op::Broadcast]
            .into_iter()
            .find(|o| *o as u8 == v)
    }
}

/// One collective call as every rank must make it.
#[derive(Debug, Clone, Copy)]
struct Call {
    op: Op,
    seq: u64,
    /// The element count the call is about (buffer, output chunk, or input).
    count: usize,
    /// The reduce op (0 sum, 1 average) or the broadcast root.
    arg: u64,
}

impl Call {
    fn label(&self) -> String {
        format!("{} #{}", self.op.name(), self.seq)
    }
}

/// One process's rank of a TCP group. The ranks form a star around rank 0: in each
/// collective every other rank sends its values to rank 0, which reduces them in rank order
/// from zero (the in-process group's bits) and answers each rank. A rank whose process dies
/// (its connection closes) or that stays silent past the timeout fails the collective on
/// every rank with an error naming it. Values travel as f32; [`Communicator::traffic`]
/// counts the bytes on this rank's connections.
///
/// ```no_run
/// use vram_parallel::{Communicator, ProcessGroupConfig, ReduceOp, TcpComm};
///
/// // In each process started by `cargo xtask launch --nproc 2 -- <this program>`:
/// let comm = TcpComm::connect(&ProcessGroupConfig::from_env()?)?;
/// let mut x = vec![comm.rank() as f32; 4];
/// comm.all_reduce(&mut x, ReduceOp::Sum)?;
/// assert_eq!(x, vec![1.0; 4]);
/// # Ok::<(), vram_parallel::CommError>(())
/// ```
#[derive(Debug)]
pub struct TcpComm {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    links: Links,
    seq: Cell<u64>,
    aborted: RefCell<Option<CommError>>,
    traffic: Cell<Traffic>,
}

impl TcpComm {
    /// Bytes of a frame before its values: every message of a collective carries them, so a
    /// collective moving `k` values over one connection puts `FRAME_HEADER_BYTES + 4 * k`
    /// bytes on it (values travel as f32, whatever the tensors' dtype).
    pub const FRAME_HEADER_BYTES: u64 = HEADER_BYTES;

    /// Joins the job `config` describes: rank 0 listens at `MASTER_ADDR:MASTER_PORT`, the
    /// others connect (retrying until rank 0 is up); returns once all have arrived.
    ///
    /// # Errors
    ///
    /// [`CommError::Listen`] (rank 0: the port is taken), [`CommError::Unreachable`]
    /// (rank 0 never answered), [`CommError::MissingRanks`] (ranks that did not arrive
    /// within the timeout), [`CommError::WorldSizeMismatch`], [`CommError::Protocol`]
    /// (duplicate ranks, a stranger on the port); every rank that arrived gets rank 0's
    /// error.
    pub fn connect(config: &ProcessGroupConfig) -> Result<TcpComm, CommError> {
        let (links, _) = rendezvous(config, &[])?;
        let t = config.timeout;
        let streams: Vec<&TcpStream> = match &links {
            Links::Hub(peers) => peers.iter().collect(),
            Links::Spoke(s) => vec![s],
        };
        // Rank 0 waits a timeout for each rank; the others wait for rank 0, which may
        // itself be waiting a timeout for a silent rank before it tells them.
        let read = if config.rank == 0 { t } else { 2 * t + Duration::from_secs(1) };
        for (i, s) in streams.into_iter().enumerate() {
            let peer = if config.rank == 0 { i + 1 } else { 0 };
            wire::configure(s, read, 2 * t)
                .map_err(|e| wire::io_error(peer, "connection setup", t, &e))?;
        }
        Ok(TcpComm {
            rank: config.rank,
            world_size: config.world_size,
            timeout: t,
            links,
            seq: Cell::new(0),
            aborted: RefCell::new(None),
            traffic: Cell::new(Traffic::default()),
        })
    }

    fn count(&self, sent: u64, received: u64, calls: u64) {
        let mut t = self.traffic.get();
        t.sent += sent;
        t.received += received;
        t.calls += calls;
        self.traffic.set(t);
    }

    fn next_call(&self, op: Op, count: usize, arg: u64) -> Result<Call, CommError> {
        if let Some(e) = self.aborted.borrow().as_ref() {
            return Err(e.clone());
        }
        let seq = self.seq.get() + 1;
        self.seq.set(seq);
        self.count(0, 0, 1);
        Ok(Call { op, seq, count, arg })
    }

    /// Marks the group aborted by `by` and tells the other ranks (rank 0 tells every other
    /// rank; the others tell rank 0, which tells the rest). Returns the error.
    fn fail(&self, e: CommError, by: usize) -> CommError {
        let relayed = match &e {
            CommError::Aborted { .. } => e.clone(),
            other => CommError::Aborted { by, reason: other.to_string() },
        };
        let first = self.aborted.borrow().is_none();
        if first {
            *self.aborted.borrow_mut() = Some(relayed.clone());
            let (by, reason) = match &relayed {
                CommError::Aborted { by, reason } => (*by, reason.as_str()),
                _ => (by, ""),
            };
            let frame = wire::abort_frame(by, reason);
            let streams: Vec<&TcpStream> = match &self.links {
                Links::Hub(peers) => peers.iter().collect(),
                Links::Spoke(s) => vec![s],
            };
            for s in streams {
                if wire::send(s, &frame).is_ok() {
                    self.count(frame.len() as u64, 0, 0);
                }
            }
        }
        e
    }

    /// Another rank: sends `values` for `call`, then reads rank 0's answer into `out`.
    fn spoke_round(
        &self,
        hub: &TcpStream,
        call: Call,
        values: &[f32],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        let frame = wire::data_frame(call.op as u8, call.seq, call.count as u64, call.arg, values);
        let label = call.label();
        let wait = 2 * self.timeout;
        let sent = wire::send(hub, &frame);
        if sent.is_ok() {
            self.count(frame.len() as u64, 0, 0);
        }
        // Even when the send failed, rank 0 may have said why before it went.
        let mut r = Reader::new(hub);
        let answer = (|| -> std::io::Result<Result<(), CommError>> {
            match r.u8()? {
                DATA => {
                    let (op, seq) = (r.u8()?, r.u64()?);
                    let (_count, _arg, len) = (r.u64()?, r.u64()?, r.u64()?);
                    if op != call.op as u8 || seq != call.seq || len != out.len() as u64 {
                        return Ok(Err(CommError::Protocol {
                            rank: 0,
                            reason: format!(
                                "answered op {op} #{seq} with {len} values to {label} of {}",
                                out.len()
                            ),
                        }));
                    }
                    r.values(out)?;
                    Ok(Ok(()))
                }
                ABORT => {
                    let by = r.u64()? as usize;
                    Ok(Err(CommError::Aborted { by, reason: r.string()? }))
                }
                t => Ok(Err(CommError::Protocol {
                    rank: 0,
                    reason: format!("unknown frame tag {t}"),
                })),
            }
        })();
        self.count(0, r.bytes, 0);
        match (answer, sent) {
            (Ok(Ok(())), _) => Ok(()),
            (Ok(Err(e)), _) => {
                let by = match &e {
                    CommError::Aborted { by, .. } => *by,
                    _ => 0,
                };
                if matches!(e, CommError::Aborted { .. }) {
                    *self.aborted.borrow_mut() = Some(e.clone());
                    return Err(e);
                }
                Err(self.fail(e, by))
            }
            (Err(e), sent) => {
                let cause = match sent {
                    Err(s) if wire::is_timeout(&e) && !wire::is_timeout(&s) => s,
                    _ => e,
                };
                Err(self.fail(wire::io_error(0, &label, wait, &cause), 0))
            }
        }
    }

    /// Rank 0: every rank's `mine.len()` values for `call` (its own first) reduced with `op`
    /// in rank order, as the in-process group reduces them.
    fn hub_reduce(
        &self,
        peers: &[TcpStream],
        call: Call,
        mine: &[f32],
        op: ReduceOp,
    ) -> Result<Vec<f32>, CommError> {
        let all = self.hub_gather(peers, call, |_| mine.len())?;
        let mut views: Vec<&[f32]> = vec![mine];
        views.extend(all[1..].iter().map(Vec::as_slice));
        let mut out = vec![0.0; mine.len()];
        reduce_in_rank_order(&views, 0..mine.len(), op, &mut out);
        Ok(out)
    }

    /// Rank 0: reads every other rank's values for `call` in rank order (`len(r)` values
    /// from rank `r`); index 0 of the result is empty.
    fn hub_gather(
        &self,
        peers: &[TcpStream],
        call: Call,
        len: impl Fn(usize) -> usize,
    ) -> Result<Vec<Vec<f32>>, CommError> {
        let mut all = vec![Vec::new()];
        let label = call.label();
        for (i, s) in peers.iter().enumerate() {
            let rank = i + 1;
            let mut r = Reader::new(s);
            let got = (|| -> std::io::Result<Result<Vec<f32>, CommError>> {
                match r.u8()? {
                    DATA => {
                        let (op, seq) = (r.u8()?, r.u64()?);
                        let (count, arg, n) = (r.u64()?, r.u64()?, r.u64()?);
                        if op != call.op as u8 || seq != call.seq || arg != call.arg {
                            let theirs = Op::from_u8(op).map_or("an unknown collective", Op::name);
                            return Ok(Err(CommError::Protocol {
                                rank,
                                reason: format!(
                                    "called {theirs} #{seq} (argument {arg}) where rank 0 \
                                     called {label} (argument {}): the ranks are out of step",
                                    call.arg
                                ),
                            }));
                        }
                        if count != call.count as u64 || n != len(rank) as u64 {
                            return Ok(Err(CommError::LengthMismatch {
                                op: call.op.name(),
                                rank,
                                got: count as usize,
                                expected: call.count,
                            }));
                        }
                        let mut v = vec![0.0; len(rank)];
                        r.values(&mut v)?;
                        Ok(Ok(v))
                    }
                    ABORT => {
                        let by = r.u64()? as usize;
                        Ok(Err(CommError::Aborted { by, reason: r.string()? }))
                    }
                    t => Ok(Err(CommError::Protocol {
                        rank,
                        reason: format!("unknown frame tag {t}"),
                    })),
                }
            })();
            self.count(0, r.bytes, 0);
            match got {
                Ok(Ok(v)) => all.push(v),
                Ok(Err(e)) => {
                    let by = match &e {
                        CommError::Aborted { by, .. } => *by,
                        _ => rank,
                    };
                    return Err(self.fail(e, by));
                }
                Err(e) => {
                    return Err(self.fail(wire::io_error(rank, &label, self.timeout, &e), rank));
                }
            }
        }
        Ok(all)
    }

    /// Rank 0: sends rank `rank` its result of `call`.
    fn hub_answer(
        &self,
        peers: &[TcpStream],
        rank: usize,
        call: Call,
        values: &[f32],
    ) -> Result<(), CommError> {
        let frame = wire::data_frame(call.op as u8, call.seq, call.count as u64, call.arg, values);
        match wire::send(&peers[rank - 1], &frame) {
            Ok(()) => {
                self.count(frame.len() as u64, 0, 0);
                Ok(())
            }
            Err(e) => Err(self.fail(wire::io_error(rank, &call.label(), self.timeout, &e), rank)),
        }
    }

    fn check(&self, op: &'static str, got: usize, expected: usize) -> Result<(), CommError> {
        if got != expected {
            let e = CommError::LengthMismatch { op, rank: self.rank, got, expected };
            return Err(self.fail(e, self.rank));
        }
        Ok(())
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.fail(CommError::Invalid("rank panicked".into()), self.rank);
        }
    }
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Average => 1,
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let call = self.next_call(Op::AllReduce, buf.len(), op_code(op))?;
        match &self.links {
            Links::Spoke(hub) => {
                let mine = buf.to_vec();
                self.spoke_round(hub, call, &mine, buf)
            }
            Links::Hub(peers) => {
                let out = self.hub_reduce(peers, call, buf, op)?;
                for r in 1..self.world_size {
                    self.hub_answer(peers, r, call, &out)?;
                }
                buf.copy_from_slice(&out);
                Ok(())
            }
        }
    }

    fn reduce_scatter(
        &self,
        input: &[f32],
        output: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let k = output.len();
        self.check("reduce_scatter", input.len(), k * self.world_size)?;
        let call = self.next_call(Op::ReduceScatter, k, op_code(op))?;
        match &self.links {
            Links::Spoke(hub) => self.spoke_round(hub, call, input, output),
            Links::Hub(peers) => {
                let full = self.hub_reduce(peers, call, input, op)?;
                for r in 1..self.world_size {
                    self.hub_answer(peers, r, call, &full[r * k..(r + 1) * k])?;
                }
                output.copy_from_slice(&full[..k]);
                Ok(())
            }
        }
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        let k = input.len();
        self.check("all_gather", output.len(), k * self.world_size)?;
        let call = self.next_call(Op::AllGather, k, 0)?;
        match &self.links {
            Links::Spoke(hub) => self.spoke_round(hub, call, input, output),
            Links::Hub(peers) => {
                let all = self.hub_gather(peers, call, |_| k)?;
                output[..k].copy_from_slice(input);
                for (r, v) in all.iter().enumerate().skip(1) {
                    output[r * k..(r + 1) * k].copy_from_slice(v);
                }
                for r in 1..self.world_size {
                    self.hub_answer(peers, r, call, output)?;
                }
                Ok(())
            }
        }
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.world_size {
            let e = CommError::Invalid(format!(
                "broadcast root {root} outside a group of {}",
                self.world_size
            ));
            return Err(self.fail(e, self.rank));
        }
        let call = self.next_call(Op::Broadcast, buf.len(), root as u64)?;
        match &self.links {
            Links::Spoke(hub) => {
                if self.rank == root {
                    let mine = buf.to_vec();
                    self.spoke_round(hub, call, &mine, &mut [])
                } else {
                    self.spoke_round(hub, call, &[], buf)
                }
            }
            Links::Hub(peers) => {
                let n = buf.len();
                let all = self.hub_gather(peers, call, |r| if r == root { n } else { 0 })?;
                if root != 0 {
                    buf.copy_from_slice(&all[root]);
                }
                for r in 1..self.world_size {
                    let values: &[f32] = if r == root { &[] } else { buf };
                    self.hub_answer(peers, r, call, values)?;
                }
                Ok(())
            }
        }
    }

    fn abort(&self, reason: &str) {
        let _ =
            self.fail(CommError::Aborted { by: self.rank, reason: reason.to_owned() }, self.rank);
    }

    fn traffic(&self) -> Option<Traffic> {
        Some(self.traffic.get())
    }
}
