//! The rendezvous at `MASTER_ADDR:MASTER_PORT`: rank 0 listens, every other rank connects
//! and says who it is; rank 0 checks the world size and the ranks, and answers every rank
//! with a payload (NCCL's unique id, or nothing) or with the error that stops the job. The
//! connections stay open: the TCP backend's collectives and NCCL's watchdog run on them.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::wire::{self, MAGIC, MISMATCH, MISSING, OK, OTHER, Reader};
use crate::comm::CommError;
use crate::process_group::ProcessGroupConfig;

/// This process's connections after the rendezvous.
#[derive(Debug)]
pub(crate) enum Links {
    /// Rank 0: the connection to rank `r` at index `r - 1`.
    Hub(Vec<TcpStream>),
    /// Another rank: its connection to rank 0.
    Spoke(TcpStream),
}

fn resolve(cfg: &ProcessGroupConfig) -> io::Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> =
        (cfg.master_addr.trim_matches(['[', ']']), cfg.master_port).to_socket_addrs()?.collect();
    if addrs.is_empty() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address"));
    }
    Ok(addrs)
}

/// Meets the other ranks of `cfg`'s job. Rank 0 hands `payload` to every rank; the others
/// return what they received (rank 0 returns `payload`).
pub(crate) fn rendezvous(
    cfg: &ProcessGroupConfig,
    payload: &[u8],
) -> Result<(Links, Vec<u8>), CommError> {
    cfg.check()?;
    if cfg.rank == 0 { hub(cfg, payload) } else { spoke(cfg) }
}

fn hub(cfg: &ProcessGroupConfig, payload: &[u8]) -> Result<(Links, Vec<u8>), CommError> {
    let addr = cfg.master();
    let listen = |reason: String| CommError::Listen { addr: addr.clone(), reason };
    let addrs = resolve(cfg).map_err(|e| listen(e.to_string()))?;
    let listener = TcpListener::bind(&addrs[..]).map_err(|e| listen(e.to_string()))?;
    listener.set_nonblocking(true).map_err(|e| listen(e.to_string()))?;
    let n = cfg.world_size;
    let started = Instant::now();
    let deadline = started + cfg.timeout;
    let mut peers: Vec<Option<TcpStream>> = (1..n).map(|_| None).collect();
    let fail = |peers: &mut Vec<Option<TcpStream>>, e: CommError, extra: Option<TcpStream>| {
        let answer = error_answer(&e);
        for s in peers.iter().flatten().chain(extra.as_ref()) {
            let _ = wire::send(s, &answer);
        }
        Err(e)
    };
    while peers.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> =
                (1..n).filter(|r| peers.get(r - 1).is_some_and(Option::is_none)).collect();
            let e = CommError::MissingRanks { missing, world_size: n, addr, waited: cfg.timeout };
            return fail(&mut peers, e, None);
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return fail(&mut peers, listen(e.to_string()), None),
        };
        // A connection that does not say hello in time, or says something else, is not one
        // of ours (a port scanner, a stale client): drop it and keep waiting.
        let hello = (|| -> io::Result<(usize, usize)> {
            stream.set_nonblocking(false)?;
            stream.set_read_timeout(Some((deadline - now).max(Duration::from_millis(1))))?;
            let mut r = Reader::new(&stream);
            let mut magic = [0; 8];
            r.exact(&mut magic)?;
            if magic != MAGIC {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "not vram"));
            }
            Ok((r.u64()? as usize, r.u64()? as usize))
        })();
        let Ok((rank, world_size)) = hello else { continue };
        if world_size != n || rank >= n {
            let e = CommError::WorldSizeMismatch { rank, world_size, expected: n };
            return fail(&mut peers, e, Some(stream));
        }
        let slot = rank.checked_sub(1).and_then(|i| peers.get_mut(i));
        match slot {
            Some(s @ None) => *s = Some(stream),
            _ => {
                let e = CommError::Protocol {
                    rank,
                    reason: format!("two processes say RANK={rank}: every RANK must be unique"),
                };
                return fail(&mut peers, e, Some(stream));
            }
        }
    }
    drop(listener);
    let peers: Vec<TcpStream> = peers.into_iter().flatten().collect();
    let mut answer = MAGIC.to_vec();
    answer.push(OK);
    answer.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    answer.extend_from_slice(payload);
    for (i, s) in peers.iter().enumerate() {
        wire::send(s, &answer).map_err(|e| wire::io_error(i + 1, "rendezvous", cfg.timeout, &e))?;
    }
    Ok((Links::Hub(peers), payload.to_vec()))
}

/// Rank 0's answer carrying `e`.
fn error_answer(e: &CommError) -> Vec<u8> {
    let mut buf = MAGIC.to_vec();
    match e {
        CommError::MissingRanks { missing, world_size, waited, .. } => {
            buf.push(MISSING);
            wire::put_u64(&mut buf, missing.len() as u64);
            for &r in missing {
                wire::put_u64(&mut buf, r as u64);
            }
            wire::put_u64(&mut buf, *world_size as u64);
            wire::put_u64(&mut buf, waited.as_millis() as u64);
        }
        CommError::WorldSizeMismatch { rank, world_size, expected } => {
            buf.push(MISMATCH);
            for v in [rank, world_size, expected] {
                wire::put_u64(&mut buf, *v as u64);
            }
        }
        CommError::Protocol { rank, reason } => {
            buf.push(OTHER);
            wire::put_u64(&mut buf, *rank as u64);
            wire::put_str(&mut buf, reason);
        }
        e => {
            buf.push(OTHER);
            wire::put_u64(&mut buf, 0);
            wire::put_str(&mut buf, &e.to_string());
        }
    }
    buf
}

fn spoke(cfg: &ProcessGroupConfig) -> Result<(Links, Vec<u8>), CommError> {
    let addr = cfg.master();
    let started = Instant::now();
    let deadline = started + cfg.timeout;
    let stream = loop {
        let attempt = resolve(cfg).and_then(|addrs| {
            let left = deadline.saturating_duration_since(Instant::now());
            let wait = left.clamp(Duration::from_millis(1), Duration::from_secs(1));
            let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
            for a in addrs {
                match TcpStream::connect_timeout(&a, wait) {
                    Ok(s) => return Ok(s),
                    Err(e) => last = e,
                }
            }
            Err(last)
        });
        match attempt {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(CommError::Unreachable {
                    rank: cfg.rank,
                    addr,
                    waited: cfg.timeout,
                    reason: e.to_string(),
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let setup = |e: io::Error| wire::io_error(0, "the rendezvous", 2 * cfg.timeout, &e);
    let mut hello = MAGIC.to_vec();
    wire::put_u64(&mut hello, cfg.rank as u64);
    wire::put_u64(&mut hello, cfg.world_size as u64);
    // Rank 0 answers once every rank has arrived, or its own timeout has passed: it may
    // have started up to a timeout after this rank.
    wire::configure(&stream, 2 * cfg.timeout, cfg.timeout).map_err(setup)?;
    wire::send(&stream, &hello).map_err(setup)?;
    let mut r = Reader::new(&stream);
    let mut magic = [0; 8];
    r.exact(&mut magic).map_err(setup)?;
    if magic != MAGIC {
        return Err(CommError::Protocol {
            rank: 0,
            reason: format!(
                "the process listening on {addr} is not a vram rendezvous (another program \
                 holds MASTER_PORT?)"
            ),
        });
    }
    let answer = (|| -> io::Result<Result<Vec<u8>, CommError>> {
        Ok(match r.u8()? {
            OK => {
                let mut len = [0; 4];
                r.exact(&mut len)?;
                let len = u32::from_le_bytes(len) as usize;
                if len > 1 << 16 {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "payload over 64 KiB"));
                }
                let mut payload = vec![0; len];
                r.exact(&mut payload)?;
                Ok(payload)
            }
            MISSING => {
                let k = r.u64()?.min(1 << 20) as usize;
                let missing =
                    (0..k).map(|_| r.u64().map(|v| v as usize)).collect::<Result<_, _>>()?;
                let world_size = r.u64()? as usize;
                let waited = Duration::from_millis(r.u64()?);
                Err(CommError::MissingRanks { missing, world_size, addr: addr.clone(), waited })
            }
            MISMATCH => Err(CommError::WorldSizeMismatch {
                rank: r.u64()? as usize,
                world_size: r.u64()? as usize,
                expected: r.u64()? as usize,
            }),
            OTHER => Err(CommError::Protocol { rank: r.u64()? as usize, reason: r.string()? }),
            s => Err(CommError::Protocol {
                rank: 0,
                reason: format!("unknown rendezvous status {s}"),
            }),
        })
    })()
    .map_err(setup)?;
    let payload = answer?;
    Ok((Links::Spoke(stream), payload))
}
