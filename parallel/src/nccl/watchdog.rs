//! The watchdog of a multi-process NCCL group: the TCP rendezvous connections, read by one
//! thread per connection. An abort frame, or a connection that closes without a goodbye
//! (the peer's process died), aborts this process's communicator (which ends NCCL kernels
//! waiting on the peer) and marks the group failed with an error naming the rank; rank 0
//! passes it on to every other rank.

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::CommHandle;
use crate::comm::CommError;
use crate::tcp::Links;
use crate::tcp::wire::{self, ABORT, Reader};

/// Frame tag: this rank is done (its connection closes normally).
const BYE: u8 = 3;

#[derive(Debug)]
pub(crate) struct Watchdog {
    /// Where abort frames go: every other rank (rank 0), or rank 0.
    peers: Arc<Vec<(usize, Mutex<TcpStream>)>>,
    done: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// One message per thread that ended.
    ended: Receiver<()>,
}

/// How long [`Watchdog::stop`] waits for the other ranks' goodbyes.
const GOODBYE_WAIT: Duration = Duration::from_secs(10);

struct Shared {
    rank: usize,
    peers: Arc<Vec<(usize, Mutex<TcpStream>)>>,
    handle: Arc<CommHandle>,
    aborted: Arc<Mutex<Option<CommError>>>,
    done: Arc<AtomicBool>,
}

impl Shared {
    /// Records `e` (the first error wins), aborts the communicator, and (rank 0) tells
    /// every rank but `from`.
    fn fail(&self, e: CommError, by: usize, from: usize) {
        let mut st = self.aborted.lock().unwrap_or_else(|p| p.into_inner());
        let first = st.is_none();
        if first {
            *st = Some(e.clone());
        }
        drop(st);
        self.handle.abort();
        if first && self.rank == 0 {
            let reason = match &e {
                CommError::Aborted { reason, .. } => reason.clone(),
                other => other.to_string(),
            };
            send_all(&self.peers, &wire::abort_frame(by, &reason), Some(from));
        }
    }

    fn watch(&self, peer: usize, stream: TcpStream) {
        let mut r = Reader::new(&stream);
        let outcome = (|| -> std::io::Result<Option<CommError>> {
            Ok(match r.u8()? {
                BYE => None,
                ABORT => {
                    let by = r.u64()? as usize;
                    Some(CommError::Aborted { by, reason: r.string()? })
                }
                t => Some(CommError::Protocol {
                    rank: peer,
                    reason: format!("unknown frame tag {t}"),
                }),
            })
        })();
        if self.done.load(Ordering::SeqCst) {
            return;
        }
        let e = match outcome {
            Ok(None) => return,
            Ok(Some(e)) => e,
            Err(e) => CommError::RankLost {
                rank: peer,
                op: "an NCCL job".into(),
                reason: if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    "its connection to the watchdog closed".into()
                } else {
                    e.to_string()
                },
            },
        };
        let by = match &e {
            CommError::Aborted { by, .. } => *by,
            _ => peer,
        };
        self.fail(e, by, peer);
    }
}

fn send_all(peers: &[(usize, Mutex<TcpStream>)], frame: &[u8], except: Option<usize>) {
    for (rank, s) in peers {
        if Some(*rank) != except {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            let _ = wire::send(&s, frame);
        }
    }
}

impl Watchdog {
    /// Watches `links` for rank `rank` of the group whose communicator is `handle`.
    pub(crate) fn start(
        links: Links,
        rank: usize,
        handle: Arc<CommHandle>,
        aborted: Arc<Mutex<Option<CommError>>>,
    ) -> Result<Watchdog, CommError> {
        let streams: Vec<(usize, TcpStream)> = match links {
            Links::Hub(peers) => peers.into_iter().enumerate().map(|(i, s)| (i + 1, s)).collect(),
            Links::Spoke(s) => vec![(0, s)],
        };
        let mut readers = Vec::with_capacity(streams.len());
        let mut writers = Vec::with_capacity(streams.len());
        for (peer, s) in streams {
            let setup =
                |e: std::io::Error| wire::io_error(peer, "watchdog setup", Default::default(), &e);
            // NCCL work may take any time: the watchdog waits for an event, not for data.
            s.set_read_timeout(None).map_err(setup)?;
            readers.push((peer, s.try_clone().map_err(setup)?));
            writers.push((peer, Mutex::new(s)));
        }
        let peers = Arc::new(writers);
        let done = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            rank,
            peers: Arc::clone(&peers),
            handle,
            aborted,
            done: Arc::clone(&done),
        });
        let (tx, ended) = channel();
        let threads = readers
            .into_iter()
            .map(|(peer, s)| {
                let (shared, tx) = (Arc::clone(&shared), tx.clone());
                std::thread::spawn(move || {
                    shared.watch(peer, s);
                    let _ = tx.send(());
                })
            })
            .collect();
        Ok(Watchdog { peers, done, threads, ended })
    }

    /// Tells the other ranks that `rank` aborted (rank 0 tells all; the others tell rank 0,
    /// which tells the rest).
    pub(crate) fn tell(&self, rank: usize, reason: &str) {
        send_all(&self.peers, &wire::abort_frame(rank, reason), None);
    }

    /// Says goodbye on every connection, waits (a while) for the other ranks' goodbyes, so
    /// that no connection closes with a goodbye unread (which would reset it and look like
    /// a death to the peer), then closes them and joins the threads.
    pub(crate) fn stop(self) {
        self.done.store(true, Ordering::SeqCst);
        send_all(&self.peers, &[BYE], None);
        let deadline = Instant::now() + GOODBYE_WAIT;
        for _ in 0..self.threads.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.ended.recv_timeout(left).is_err() {
                break;
            }
        }
        for (_, s) in self.peers.iter() {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}
