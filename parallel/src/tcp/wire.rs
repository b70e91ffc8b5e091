//! The bytes on the TCP connections (little-endian throughout).
//!
//! Rendezvous: a rank sends `MAGIC, rank u64, world_size u64`; rank 0 answers `MAGIC` and a
//! status byte: `OK` then `u32` length and a payload (NCCL's unique id, or nothing), or one
//! of the errors below.
//!
//! Collectives: frames of `tag u8`. `DATA`: `op u8, seq u64, count u64, arg u64,
//! elements u64` then that many f32 ([`HEADER_BYTES`] before the values). `ABORT`:
//! `by u64, reason (u32 length + UTF-8)`.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::comm::CommError;

/// Opens every rendezvous message, so that a stranger on the port is told apart.
pub(crate) const MAGIC: [u8; 8] = *b"vram-pg1";

/// Rendezvous answer: welcome, then the payload.
pub(crate) const OK: u8 = 0;
/// Rendezvous answer: ranks missing (`count u64`, ranks u64..., `world u64`, `waited ms u64`).
pub(crate) const MISSING: u8 = 1;
/// Rendezvous answer: a rank's world size differs (`rank u64, world u64, expected u64`).
pub(crate) const MISMATCH: u8 = 2;
/// Rendezvous answer: another error (`rank u64`, reason).
pub(crate) const OTHER: u8 = 3;

/// Frame tag: a collective's values.
pub(crate) const DATA: u8 = 1;
/// Frame tag: the group is aborted.
pub(crate) const ABORT: u8 = 2;

/// Bytes of a `DATA` frame before its values.
pub(crate) const HEADER_BYTES: u64 = 1 + 1 + 8 + 8 + 8 + 8;

/// Appends `v`.
pub(crate) fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

/// Appends a length-prefixed string.
pub(crate) fn put_str(buf: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(u32::MAX as usize)];
    buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// A `DATA` frame.
pub(crate) fn data_frame(op: u8, seq: u64, count: u64, arg: u64, values: &[f32]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER_BYTES as usize + 4 * values.len());
    buf.push(DATA);
    buf.push(op);
    for v in [seq, count, arg, values.len() as u64] {
        put_u64(&mut buf, v);
    }
    for v in values {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    buf
}

/// An `ABORT` frame.
pub(crate) fn abort_frame(by: usize, reason: &str) -> Vec<u8> {
    let mut buf = vec![ABORT];
    put_u64(&mut buf, by as u64);
    put_str(&mut buf, reason);
    buf
}

/// Reads from one connection, counting the bytes.
pub(crate) struct Reader<'a> {
    pub(crate) stream: &'a TcpStream,
    pub(crate) bytes: u64,
}

impl Reader<'_> {
    pub(crate) fn new(stream: &TcpStream) -> Reader<'_> {
        Reader { stream, bytes: 0 }
    }

    pub(crate) fn exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.stream.read_exact(buf)?;
        self.bytes += buf.len() as u64;
        Ok(())
    }

    pub(crate) fn u8(&mut self) -> io::Result<u8> {
        let mut b = [0; 1];
        self.exact(&mut b)?;
        Ok(b[0])
    }

    pub(crate) fn u64(&mut self) -> io::Result<u64> {
        let mut b = [0; 8];
        self.exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// A length-prefixed string of at most 64 KiB (longer is a protocol error).
    pub(crate) fn string(&mut self) -> io::Result<String> {
        let mut b = [0; 4];
        self.exact(&mut b)?;
        let len = u32::from_le_bytes(b) as usize;
        if len > 1 << 16 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a string over 64 KiB"));
        }
        let mut s = vec![0; len];
        self.exact(&mut s)?;
        Ok(String::from_utf8_lossy(&s).into_owned())
    }

    /// `n` f32 values into `out` (`out.len() == n`).
    pub(crate) fn values(&mut self, out: &mut [f32]) -> io::Result<()> {
        let mut bytes = vec![0; 4 * out.len()];
        self.exact(&mut bytes)?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
}

/// Writes all of `buf`.
pub(crate) fn send(mut stream: &TcpStream, buf: &[u8]) -> io::Result<()> {
    stream.write_all(buf)?;
    stream.flush()
}

/// Whether an I/O error is a read or write timeout.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// The error for an I/O failure on the connection to `rank` during `op`.
pub(crate) fn io_error(rank: usize, op: &str, waited: Duration, e: &io::Error) -> CommError {
    if is_timeout(e) {
        CommError::Timeout { rank, op: op.to_owned(), waited }
    } else if e.kind() == io::ErrorKind::InvalidData {
        CommError::Protocol { rank, reason: format!("{op}: {e}") }
    } else {
        let reason = match e.kind() {
            io::ErrorKind::UnexpectedEof => "connection closed".to_owned(),
            _ => e.to_string(),
        };
        CommError::RankLost { rank, op: op.to_owned(), reason }
    }
}

/// Socket settings for the collectives: no Nagle delay, reads and writes bounded.
pub(crate) fn configure(stream: &TcpStream, read: Duration, write: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(read.max(Duration::from_millis(1))))?;
    stream.set_write_timeout(Some(write.max(Duration::from_millis(1))))
}
