//! A bounded first pass over a pickle, before serde-pickle builds its value tree.
//!
//! serde-pickle trusts its input: each open `MARK` costs it a fresh stack (a 1 MB file of
//! nested marks took 4 GB of memory), and deeply nested containers recurse (a few bytes a
//! level). This pass walks the opcodes with a model of the pickle machine that keeps, for
//! each stack item, only which container it is and how deeply containers nest below it, and
//! refuses what no memory snapshot needs: more than [`MAX_MARKS`] open marks, containers
//! nested deeper than [`MAX_DEPTH`], a container changed after it was shared (which would
//! hide nesting from the count), persistent ids and out-of-band buffers. It also tells a
//! truncated file (no `STOP`, or an opcode cut short) from other damage.
//!
//! `torch.cuda.memory._dump_snapshot` writes containers about 7 deep (the dict, `segments`,
//! a segment, its `blocks`, a block, its `frames`, a frame) and opens one mark per level.

use super::SnapshotError;
use std::collections::HashMap;

/// The most `MARK`s open at once.
pub const MAX_MARKS: usize = 64;
/// The deepest nesting of containers accepted.
pub const MAX_DEPTH: u32 = 64;
/// The largest snapshot file accepted, in bytes.
pub const MAX_FILE_BYTES: u64 = 4 << 30;

/// What a stack item is: a container or object (by number), or a plain value.
#[derive(Clone, Copy)]
struct Item {
    /// `u32::MAX` for a plain value.
    id: u32,
    /// Whether this is the only reference to the container (fresh from its opcode): only
    /// then may it change.
    owned: bool,
}

const PLAIN: Item = Item { id: u32::MAX, owned: false };

struct Machine {
    stack: Vec<Item>,
    marks: Vec<usize>,
    /// Nesting depth of each container (1 for an empty one).
    depth: Vec<u32>,
    memo: HashMap<u64, Item>,
}

fn limit(what: String) -> SnapshotError {
    SnapshotError::Limit(what)
}

impl Machine {
    fn depth_of(&self, item: Item) -> u32 {
        if item.id == u32::MAX { 0 } else { self.depth[item.id as usize] }
    }

    /// A new container holding items of at most `inner` depth.
    fn container(&mut self, inner: u32) -> Result<Item, SnapshotError> {
        let d = inner + 1;
        if d > MAX_DEPTH {
            return Err(limit(format!(
                "containers nest deeper than {MAX_DEPTH} levels (a memory snapshot nests about 7)"
            )));
        }
        self.depth.push(d);
        Ok(Item { id: (self.depth.len() - 1) as u32, owned: true })
    }

    fn pop(&mut self) -> Result<Item, SnapshotError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(SnapshotError::NotAPickle("an opcode found an empty stack".into()));
        }
        Ok(self.stack.pop().expect("length checked"))
    }

    /// Pops the items since the last mark and the mark; returns their deepest nesting.
    fn pop_mark(&mut self) -> Result<u32, SnapshotError> {
        let at = self.marks.pop().ok_or_else(|| {
            SnapshotError::NotAPickle("an opcode needs a MARK that is missing".into())
        })?;
        let deepest = self.stack[at..].iter().map(|&i| self.depth_of(i)).max().unwrap_or(0);
        self.stack.truncate(at);
        Ok(deepest)
    }

    /// Puts items of depth `inner` into the container on top of the stack.
    fn fill_top(&mut self, inner: u32) -> Result<(), SnapshotError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        let Some(&top) =
            self.stack.get(self.stack.len().wrapping_sub(1)).filter(|_| self.stack.len() > floor)
        else {
            return Err(SnapshotError::NotAPickle("an opcode found an empty stack".into()));
        };
        if top.id == u32::MAX {
            return Err(SnapshotError::NotAPickle(
                "items added to something not a container".into(),
            ));
        }
        if !top.owned {
            return Err(limit(
                "a container changes after it was shared (memo or DUP): its nesting cannot be \
                 bounded in advance, and memory snapshots never do this"
                    .into(),
            ));
        }
        let d = &mut self.depth[top.id as usize];
        *d = (*d).max(inner + 1);
        if *d > MAX_DEPTH {
            return Err(limit(format!(
                "containers nest deeper than {MAX_DEPTH} levels (a memory snapshot nests about 7)"
            )));
        }
        Ok(())
    }

    fn push(&mut self, item: Item) {
        self.stack.push(item);
    }
}

/// Reads `n` bytes at `*at`, advancing; `None` past the end.
fn take<'a>(bytes: &'a [u8], at: &mut usize, n: u64) -> Option<&'a [u8]> {
    let n = usize::try_from(n).ok()?;
    let end = at.checked_add(n)?;
    let s = bytes.get(*at..end)?;
    *at = end;
    Some(s)
}

fn uint_le(b: &[u8]) -> u64 {
    b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | x as u64)
}

/// Checks that `bytes` is one complete pickle within the limits above.
pub fn check(bytes: &[u8]) -> Result<(), SnapshotError> {
    let truncated = || SnapshotError::Truncated { bytes: bytes.len() as u64 };
    let mut m =
        Machine { stack: Vec::new(), marks: Vec::new(), depth: Vec::new(), memo: HashMap::new() };
    let mut at = 0usize;
    loop {
        let Some(&op) = bytes.get(at) else {
            return Err(truncated());
        };
        let op_at = at;
        at += 1;
        let mut arg = |n: u64| take(bytes, &mut at, n).ok_or_else(truncated);
        match op {
            // MARK
            b'(' => {
                if m.marks.len() >= MAX_MARKS {
                    return Err(limit(format!(
                        "more than {MAX_MARKS} MARKs are open at once (a memory snapshot opens \
                         about 7)"
                    )));
                }
                m.marks.push(m.stack.len());
            }
            // STOP
            b'.' => {
                return if m.stack.len() == 1 && m.marks.is_empty() {
                    Ok(())
                } else {
                    Err(SnapshotError::NotAPickle("the pickle stops with a malformed stack".into()))
                };
            }
            // POP, POP_MARK, DUP
            b'0' => {
                m.pop()?;
            }
            b'1' => {
                m.pop_mark()?;
            }
            b'2' => {
                let mut top = m.pop()?;
                top.owned = false;
                m.push(top);
                m.push(top);
            }
            // Newline-terminated arguments: FLOAT, INT, LONG, STRING, UNICODE, GET, PUT, and
            // GLOBAL/INST (two lines).
            b'F' | b'I' | b'L' | b'S' | b'V' | b'g' | b'p' | b'c' | b'i' => {
                let lines = if matches!(op, b'c' | b'i') { 2 } else { 1 };
                let mut text = Vec::new();
                for _ in 0..lines {
                    let rest = bytes.get(at..).unwrap_or_default();
                    let n = rest.iter().position(|&b| b == b'\n').ok_or_else(truncated)?;
                    text = rest[..n].to_vec();
                    at += n + 1;
                }
                match op {
                    b'g' => {
                        let key =
                            std::str::from_utf8(&text).ok().and_then(|t| t.trim().parse().ok());
                        let item = key.and_then(|k| m.memo.get(&k).copied()).ok_or_else(|| {
                            SnapshotError::NotAPickle(
                                "a memo entry is read before it is stored".into(),
                            )
                        })?;
                        m.push(Item { owned: false, ..item });
                    }
                    b'p' => {
                        let key =
                            std::str::from_utf8(&text).ok().and_then(|t| t.trim().parse().ok());
                        let top = *m.stack.last().ok_or_else(|| {
                            SnapshotError::NotAPickle("PUT on an empty stack".into())
                        })?;
                        m.memo.insert(key.unwrap_or(u64::MAX), top);
                    }
                    b'i' => {
                        let inner = m.pop_mark()?;
                        let c = m.container(inner)?;
                        m.push(c);
                    }
                    _ => m.push(PLAIN),
                }
            }
            // BININT, BININT1, BININT2, BINFLOAT, NONE, NEWTRUE, NEWFALSE
            b'J' => {
                arg(4)?;
                m.push(PLAIN);
            }
            b'K' => {
                arg(1)?;
                m.push(PLAIN);
            }
            b'M' => {
                arg(2)?;
                m.push(PLAIN);
            }
            b'G' => {
                arg(8)?;
                m.push(PLAIN);
            }
            b'N' | 0x88 | 0x89 => m.push(PLAIN),
            // Length-prefixed data: BINSTRING, BINUNICODE, BINBYTES (4 bytes), SHORT_*
            // (1 byte), LONG1 (1), LONG4 (4), *8 (8).
            b'T' | b'X' | b'B' | 0x8b => {
                let n = uint_le(arg(4)?);
                arg(n)?;
                m.push(PLAIN);
            }
            b'U' | b'C' | 0x8c | 0x8a => {
                let n = uint_le(arg(1)?);
                arg(n)?;
                m.push(PLAIN);
            }
            0x8d | 0x8e | 0x96 => {
                let n = uint_le(arg(8)?);
                arg(n)?;
                m.push(PLAIN);
            }
            // PROTO, FRAME
            0x80 => {
                arg(1)?;
            }
            0x95 => {
                arg(8)?;
            }
            // EMPTY_LIST, EMPTY_DICT, EMPTY_TUPLE, EMPTY_SET
            b']' | b'}' | b')' | 0x8f => {
                let c = m.container(0)?;
                m.push(c);
            }
            // LIST, DICT, TUPLE, FROZENSET, OBJ (from the items since the mark)
            b'l' | b'd' | b't' | 0x91 | b'o' => {
                let inner = m.pop_mark()?;
                let c = m.container(inner)?;
                m.push(c);
            }
            // TUPLE1, TUPLE2, TUPLE3; STACK_GLOBAL (2 -> plain); REDUCE, NEWOBJ (2 -> object);
            // NEWOBJ_EX (3 -> object)
            0x85..=0x87 | 0x93 | b'R' | 0x81 | 0x92 => {
                let n = match op {
                    0x85 => 1,
                    0x86 | 0x93 | b'R' | 0x81 => 2,
                    _ => 3,
                };
                let mut inner = 0;
                for _ in 0..n {
                    let item = m.pop()?;
                    inner = inner.max(m.depth_of(item));
                }
                let item = if op == 0x93 { PLAIN } else { m.container(inner)? };
                m.push(item);
            }
            // APPEND, BUILD (one item into the top), SETITEM (two)
            b'a' | b'b' => {
                let v = m.pop()?;
                let d = m.depth_of(v);
                m.fill_top(d)?;
            }
            b's' => {
                let v = m.pop()?;
                let k = m.pop()?;
                let d = m.depth_of(v).max(m.depth_of(k));
                m.fill_top(d)?;
            }
            // APPENDS, SETITEMS, ADDITEMS (the items since the mark into the container below)
            b'e' | b'u' | 0x90 => {
                let inner = m.pop_mark()?;
                m.fill_top(inner)?;
            }
            // BINGET, LONG_BINGET
            b'h' | b'j' => {
                let key = uint_le(arg(if op == b'h' { 1 } else { 4 })?);
                let item = m.memo.get(&key).copied().ok_or_else(|| {
                    SnapshotError::NotAPickle("a memo entry is read before it is stored".into())
                })?;
                m.push(Item { owned: false, ..item });
            }
            // BINPUT, LONG_BINPUT, MEMOIZE
            b'q' | b'r' | 0x94 => {
                let key = match op {
                    b'q' => uint_le(arg(1)?),
                    b'r' => uint_le(arg(4)?),
                    _ => m.memo.len() as u64,
                };
                let top = *m
                    .stack
                    .last()
                    .ok_or_else(|| SnapshotError::NotAPickle("PUT on an empty stack".into()))?;
                m.memo.insert(key, top);
            }
            // EXT1, EXT2, EXT4: a registered object
            0x82 => {
                arg(1)?;
                m.push(PLAIN);
            }
            0x83 => {
                arg(2)?;
                m.push(PLAIN);
            }
            0x84 => {
                arg(4)?;
                m.push(PLAIN);
            }
            // PERSID, BINPERSID, NEXT_BUFFER, READONLY_BUFFER
            b'P' | b'Q' | 0x97 | 0x98 => {
                return Err(limit(format!(
                    "opcode {op:#04x} at byte {op_at} (persistent ids, out-of-band buffers) has \
                     no place in a memory snapshot"
                )));
            }
            _ => {
                return Err(SnapshotError::NotAPickle(format!(
                    "byte {op_at} is {op:#04x}, not a pickle opcode"
                )));
            }
        }
    }
}
