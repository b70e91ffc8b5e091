//! Reading `torch.cuda.memory._dump_snapshot` pickles.
//!
//! The file is the pickled dict `torch.cuda.memory._snapshot()` returns: `segments` (the
//! cache at dump time), `device_traces` (one list of entries per device: `action`, `addr` or
//! for `oom` `device_free`, `size`, `stream`, `time_us`, `frames`), `allocator_settings`
//! and more. Keys this reader does not need are ignored.

use super::{Action, Event, PriorBlock, PriorSegment, Recording, scan};
use crate::block::MempoolId;
use serde_pickle::{DeOptions, HashableValue, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// What is wrong with a snapshot file.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The bytes are not a pickle.
    #[error("not a pickle ({0}); expected a file written by torch.cuda.memory._dump_snapshot()")]
    NotAPickle(String),
    /// The file ends before the pickle does.
    #[error(
        "the file is truncated: its {bytes} bytes end before the pickle does (was _dump_snapshot interrupted, or the copy cut short?)"
    )]
    Truncated {
        /// The file's size.
        bytes: u64,
    },
    /// The pickle is built in a way that would take unbounded memory or recursion to read,
    /// which no memory snapshot needs (see the limits in the message).
    #[error("refused: {0}")]
    Limit(String),
    /// The file is larger than the reader accepts.
    #[error(
        "{path} has {bytes} bytes; the reader accepts snapshots of up to {limit} bytes          (record fewer entries: _record_memory_history(max_entries=...))"
    )]
    TooBig {
        /// The file.
        path: String,
        /// Its size.
        bytes: u64,
        /// The most accepted.
        limit: u64,
    },
    /// An integer does not fit in 64 bits.
    #[error(
        "`{path}` is {value}, too {}: sizes, addresses and streams fit in 64 bits",
        if .value.starts_with('-') { "small" } else { "large" }
    )]
    TooLarge {
        /// Where, e.g. `device_traces[0][12].size`.
        path: String,
        /// The value, in decimal.
        value: String,
    },
    /// The pickle holds something other than a dict.
    #[error(
        "the pickle holds {0}, not a dict; expected the dict torch.cuda.memory._snapshot() returns"
    )]
    NotADict(String),
    /// The dict has no `device_traces`.
    #[error(
        "the snapshot has no `device_traces` (it has {0}): it was taken without recording \
         history; call torch.cuda.memory._record_memory_history() before the workload"
    )]
    NoDeviceTraces(String),
    /// A value has the wrong type.
    #[error("`{path}` is {found}, expected {expected}")]
    WrongType {
        /// Where, e.g. `device_traces[0][12].size`.
        path: String,
        /// What was expected.
        expected: &'static str,
        /// What was found.
        found: String,
    },
    /// A trace entry lacks a field.
    #[error("trace entry device_traces[{device}][{index}] ({action}) has no `{field}`")]
    MissingField {
        /// The device.
        device: usize,
        /// The entry's index in that device's trace.
        index: usize,
        /// The entry's action (`?` when that is what is missing).
        action: String,
        /// The missing key.
        field: &'static str,
    },
    /// A trace entry has an action PyTorch does not record.
    #[error(
        "trace entry device_traces[{device}][{index}] has an unknown action `{action}` \
         (known: alloc, free_requested, free_completed, segment_alloc, segment_free, \
         segment_map, segment_unmap, oom, snapshot)"
    )]
    UnknownAction {
        /// The device.
        device: usize,
        /// The entry's index.
        index: usize,
        /// The action found.
        action: String,
    },
    /// A size or address is negative.
    #[error(
        "trace entry device_traces[{device}][{index}] ({action}) has a negative `{field}`: {value}"
    )]
    Negative {
        /// The device.
        device: usize,
        /// The entry's index.
        index: usize,
        /// The entry's action.
        action: String,
        /// The key.
        field: &'static str,
        /// The value.
        value: i128,
    },
    /// No device has a trace entry.
    #[error(
        "the trace is empty ({devices} device trace(s), none with an entry): record with \
         torch.cuda.memory._record_memory_history(max_entries=...) before the workload, and \
         dump before stopping the recording"
    )]
    EmptyTrace {
        /// How many device traces the snapshot has.
        devices: usize,
    },
    /// The device asked for has no trace, or an empty one.
    #[error("device {device} has no trace entries; devices with entries: {with_entries:?}")]
    NoSuchDevice {
        /// The device asked for.
        device: usize,
        /// The devices whose traces have entries.
        with_entries: Vec<usize>,
    },
}

/// One segment of the snapshot (`segments` entry).
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotSegment {
    /// Device index.
    pub device: usize,
    /// Base address.
    pub address: u64,
    /// Bytes (for expandable segments: of the mapped run).
    pub total_size: u64,
    /// The stream the segment belongs to.
    pub stream: u64,
    /// `"small"` or `"large"`.
    pub segment_type: String,
    /// Whether it is (part of) an expandable segment.
    pub is_expandable: bool,
    /// The memory pool that owns it (`segment_pool_id`; (0, 0) for the default pools, or
    /// when the snapshot does not say).
    pub pool: MempoolId,
    /// The blocks tiling it, by address.
    pub blocks: Vec<SnapshotBlock>,
}

/// One block of a snapshot segment.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotBlock {
    /// Address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes requested (0 when free).
    pub requested_size: u64,
    /// `"active_allocated"`, `"active_pending_free"` or `"inactive"`.
    pub state: String,
}

/// The settings a snapshot records (`allocator_settings`).
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedSettings {
    /// `PYTORCH_CUDA_ALLOC_CONF` as the program set it (may be empty).
    pub alloc_conf: String,
    /// `max_split_size` in bytes; `None` when unlimited.
    pub max_split_size: Option<u64>,
    /// `garbage_collection_threshold`; `None` when off (0).
    pub garbage_collection_threshold: Option<f64>,
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `roundup_power2_divisions` per power-of-two interval from 1 MiB.
    pub roundup_power2_divisions: Vec<u64>,
}

impl RecordedSettings {
    /// The settings in `VRAM_ALLOC_CONF` syntax (empty for PyTorch's defaults).
    pub fn to_conf(&self) -> String {
        let mut parts = Vec::new();
        if let Some(b) = self.max_split_size {
            parts.push(format!("max_split_size_mb:{}", b >> 20));
        }
        let d = &self.roundup_power2_divisions;
        if d.iter().any(|&x| x != 0) {
            if d.iter().all(|&x| x == d[0]) {
                parts.push(format!("roundup_power2_divisions:{}", d[0]));
            } else {
                let mut items: Vec<String> =
                    d.iter().enumerate().map(|(i, v)| format!("{}:{v}", 1u64 << i)).collect();
                if let Some(last) = d.last() {
                    // PyTorch's last interval covers every larger size.
                    items.push(format!(">:{last}"));
                }
                parts.push(format!("roundup_power2_divisions:[{}]", items.join(",")));
            }
        }
        if let Some(t) = self.garbage_collection_threshold {
            parts.push(format!("garbage_collection_threshold:{t}"));
        }
        if self.expandable_segments {
            parts.push("expandable_segments:True".into());
        }
        parts.join(",")
    }

    /// Whether the program used `cudaMallocAsync` instead of the caching allocator (its
    /// trace then has no policy to reproduce).
    pub fn uses_cuda_malloc_async(&self) -> bool {
        self.alloc_conf.replace(' ', "").contains("backend:cudaMallocAsync")
    }
}

/// A `torch.cuda.memory._dump_snapshot` file, read.
#[derive(Clone, Debug, PartialEq)]
pub struct PyTorchSnapshot {
    /// The cache when the snapshot was taken, all devices.
    pub segments: Vec<SnapshotSegment>,
    /// The recorded trace of each device, oldest entry first.
    pub device_traces: Vec<Vec<Event>>,
    /// The allocator settings, when the snapshot records them (recent PyTorch versions do).
    pub settings: Option<RecordedSettings>,
}

type Dict = BTreeMap<HashableValue, Value>;

fn get<'a>(d: &'a Dict, key: &str) -> Option<&'a Value> {
    d.get(&HashableValue::String(key.to_string()))
}

fn describe(v: &Value) -> String {
    match v {
        Value::None => "None".into(),
        Value::Bool(b) => format!("a bool ({})", if *b { "True" } else { "False" }),
        Value::I64(i) => format!("an int ({i})"),
        Value::Int(i) => format!("an int ({i})"),
        Value::F64(x) => format!("a float ({x})"),
        Value::Bytes(_) => "bytes".into(),
        Value::String(s) => format!("a str ({s:?})"),
        Value::List(l) => format!("a list of {}", l.len()),
        Value::Tuple(t) => format!("a tuple of {}", t.len()),
        Value::Set(_) | Value::FrozenSet(_) => "a set".into(),
        Value::Dict(d) => format!("a dict of {} keys", d.len()),
    }
}

fn int_of(v: &Value) -> Option<i128> {
    match v {
        Value::I64(i) => Some(*i as i128),
        Value::Int(i) => i.to_string().parse().ok(),
        Value::Bool(b) => Some(*b as i128),
        _ => None,
    }
}

fn wrong(path: impl Into<String>, expected: &'static str, found: &Value) -> SnapshotError {
    match found {
        // A big int (past 64 bits) is out of range, not of the wrong type.
        Value::Int(i) if expected.contains("int") => {
            SnapshotError::TooLarge { path: path.into(), value: i.to_string() }
        }
        _ => SnapshotError::WrongType { path: path.into(), expected, found: describe(found) },
    }
}

fn as_list<'a>(v: &'a Value, path: &str) -> Result<&'a [Value], SnapshotError> {
    match v {
        Value::List(l) | Value::Tuple(l) => Ok(l),
        _ => Err(wrong(path, "a list", v)),
    }
}

fn as_dict<'a>(v: &'a Value, path: &str) -> Result<&'a Dict, SnapshotError> {
    match v {
        Value::Dict(d) => Ok(d),
        _ => Err(wrong(path, "a dict", v)),
    }
}

/// A non-negative integer field of a segment or block, 0 when absent.
fn uint_field(d: &Dict, key: &str, path: &str) -> Result<u64, SnapshotError> {
    match get(d, key) {
        None => Ok(0),
        Some(v) => match int_of(v) {
            Some(i) if (0..=u64::MAX as i128).contains(&i) => Ok(i as u64),
            _ => Err(wrong(format!("{path}.{key}"), "a non-negative int", v)),
        },
    }
}

/// A stream value: an `int64` in PyTorch (a `cudaStream_t`), kept as its bit pattern.
fn stream_of(v: &Value, path: &str) -> Result<u64, SnapshotError> {
    match int_of(v) {
        Some(i) if i < 0 && i >= i64::MIN as i128 => Ok(i as i64 as u64),
        Some(i) if (0..=u64::MAX as i128).contains(&i) => Ok(i as u64),
        _ => Err(wrong(path, "an int", v)),
    }
}

fn str_field(d: &Dict, key: &str) -> String {
    match get(d, key) {
        Some(Value::String(s)) => s.clone(),
        _ => String::new(),
    }
}

fn parse_event(v: &Value, device: usize, index: usize) -> Result<Event, SnapshotError> {
    let path = format!("device_traces[{device}][{index}]");
    let d = as_dict(v, &path)?;
    let missing = |action: &str, field| SnapshotError::MissingField {
        device,
        index,
        action: action.to_string(),
        field,
    };
    let name = match get(d, "action") {
        None => return Err(missing("?", "action")),
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(wrong(format!("{path}.action"), "a str", other)),
    };
    let action = Action::from_name(name).ok_or_else(|| SnapshotError::UnknownAction {
        device,
        index,
        action: name.to_string(),
    })?;
    let uint = |field: &'static str, v: &Value| -> Result<u64, SnapshotError> {
        match int_of(v) {
            Some(i) if i < 0 => Err(SnapshotError::Negative {
                device,
                index,
                action: name.to_string(),
                field,
                value: i,
            }),
            Some(i) if i <= u64::MAX as i128 => Ok(i as u64),
            _ => Err(wrong(format!("{path}.{field}"), "an int", v)),
        }
    };
    let size = uint("size", get(d, "size").ok_or_else(|| missing(name, "size"))?)?;
    let (addr, device_free) = if action == Action::Oom {
        // PyTorch stores the device's free bytes where other entries have the address.
        let v = get(d, "device_free")
            .or_else(|| get(d, "addr"))
            .ok_or_else(|| missing(name, "device_free"))?;
        (0, uint("device_free", v)?)
    } else {
        (uint("addr", get(d, "addr").ok_or_else(|| missing(name, "addr"))?)?, 0)
    };
    let stream = match get(d, "stream") {
        Some(v) => stream_of(v, &format!("{path}.stream"))?,
        None => 0,
    };
    let time_us = match get(d, "time_us") {
        Some(v) => int_of(v).map_or(0, |t| t.clamp(0, u64::MAX as i128) as u64),
        None => 0,
    };
    Ok(Event { action, addr, size, stream, time_us, device_free, pool: MempoolId::DEFAULT })
}

/// Reads a list of trace entries (a device trace, or vram's own `trace()` as a value).
pub(crate) fn parse_trace(v: &Value, device: usize) -> Result<Vec<Event>, SnapshotError> {
    let list = as_list(v, &format!("device_traces[{device}]"))?;
    list.iter().enumerate().map(|(i, e)| parse_event(e, device, i)).collect()
}

fn parse_segment(v: &Value, i: usize) -> Result<SnapshotSegment, SnapshotError> {
    let path = format!("segments[{i}]");
    let d = as_dict(v, &path)?;
    let mut blocks = Vec::new();
    if let Some(b) = get(d, "blocks") {
        for (j, b) in as_list(b, &format!("{path}.blocks"))?.iter().enumerate() {
            let bpath = format!("{path}.blocks[{j}]");
            let bd = as_dict(b, &bpath)?;
            blocks.push(SnapshotBlock {
                address: uint_field(bd, "address", &bpath)?,
                size: uint_field(bd, "size", &bpath)?,
                requested_size: uint_field(bd, "requested_size", &bpath)?,
                state: str_field(bd, "state"),
            });
        }
    }
    Ok(SnapshotSegment {
        device: uint_field(d, "device", &path)? as usize,
        address: uint_field(d, "address", &path)?,
        total_size: uint_field(d, "total_size", &path)?,
        stream: match get(d, "stream") {
            Some(s) => stream_of(s, &format!("{path}.stream"))?,
            None => 0,
        },
        segment_type: str_field(d, "segment_type"),
        is_expandable: matches!(get(d, "is_expandable"), Some(Value::Bool(true))),
        pool: match get(d, "segment_pool_id") {
            None | Some(Value::None) => MempoolId::DEFAULT,
            Some(v) => {
                let ppath = format!("{path}.segment_pool_id");
                let pair = as_list(v, &ppath)?;
                let part = |i: usize| -> Result<u64, SnapshotError> {
                    match pair.get(i).and_then(int_of) {
                        Some(x) if (0..=u64::MAX as i128).contains(&x) => Ok(x as u64),
                        _ => Err(wrong(ppath.clone(), "a pair of non-negative ints", v)),
                    }
                };
                if pair.len() != 2 {
                    return Err(wrong(ppath, "a pair of non-negative ints", v));
                }
                MempoolId(part(0)?, part(1)?)
            }
        },
        blocks,
    })
}

fn parse_settings(v: &Value) -> Result<RecordedSettings, SnapshotError> {
    let path = "allocator_settings";
    let d = as_dict(v, path)?;
    let max_split_size = match get(d, "max_split_size").and_then(int_of) {
        // PyTorch writes int64(SIZE_MAX), i.e. -1, when there is no limit.
        Some(b) if b > 0 && b < (1 << 62) => Some(b as u64),
        _ => None,
    };
    let garbage_collection_threshold = match get(d, "garbage_collection_threshold") {
        Some(Value::F64(t)) if *t > 0.0 => Some(*t),
        Some(v) => int_of(v).filter(|&t| t > 0).map(|t| t as f64),
        None => None,
    };
    let mut divisions: Vec<(u64, u64)> = Vec::new();
    if let Some(r) = get(d, "roundup_power2_divisions") {
        let rd = as_dict(r, "allocator_settings.roundup_power2_divisions")?;
        for (k, v) in rd {
            let key = match k {
                HashableValue::String(s) => s.parse().ok(),
                HashableValue::I64(i) => u64::try_from(*i).ok(),
                _ => None,
            };
            if let (Some(key), Some(v)) = (key, int_of(v)) {
                divisions.push((key, v.max(0) as u64));
            }
        }
    }
    divisions.sort_unstable();
    Ok(RecordedSettings {
        alloc_conf: str_field(d, "PYTORCH_CUDA_ALLOC_CONF"),
        max_split_size,
        garbage_collection_threshold,
        expandable_segments: matches!(get(d, "expandable_segments"), Some(Value::Bool(true))),
        roundup_power2_divisions: divisions.into_iter().map(|(_, v)| v).collect(),
    })
}

impl PyTorchSnapshot {
    /// Reads a snapshot file.
    pub fn load(path: impl AsRef<Path>) -> Result<PyTorchSnapshot, SnapshotError> {
        let path = path.as_ref();
        let io = |source| SnapshotError::Io { path: path.display().to_string(), source };
        let bytes = std::fs::metadata(path).map_err(io)?.len();
        if bytes > scan::MAX_FILE_BYTES {
            return Err(SnapshotError::TooBig {
                path: path.display().to_string(),
                bytes,
                limit: scan::MAX_FILE_BYTES,
            });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        PyTorchSnapshot::from_pickle(&bytes)
    }

    /// Reads a snapshot from the bytes of its pickle. The pickle is checked first: at most
    /// 64 `MARK`s open at once and containers nested at most 64 deep (a snapshot needs 7 of
    /// each), no container changed after it was shared, no persistent ids or out-of-band
    /// buffers; a file that ends early is [`SnapshotError::Truncated`].
    pub fn from_pickle(bytes: &[u8]) -> Result<PyTorchSnapshot, SnapshotError> {
        scan::check(bytes)?;
        // serde-pickle counts the references to a memoized object, and a shared container
        // (PyTorch deduplicates `frames`: one list or frame dict serves many entries) makes
        // it resolve the objects inside more often than counted, then fail with "recursive
        // structure found". Replacing those with None only touches the insides of `frames`,
        // which this reader ignores: everything it reads sits directly in entries, segments
        // and blocks, which are never shared.
        let options = DeOptions::new()
            .decode_strings()
            .replace_recursive_structures()
            .replace_unresolved_globals();
        let value = serde_pickle::value_from_slice(bytes, options)
            .map_err(|e| SnapshotError::NotAPickle(e.to_string()))?;
        PyTorchSnapshot::from_value(&value)
    }

    /// Reads a snapshot from an unpickled value.
    pub fn from_value(value: &Value) -> Result<PyTorchSnapshot, SnapshotError> {
        let Value::Dict(top) = value else {
            return Err(SnapshotError::NotADict(describe(value)));
        };
        let Some(traces) = get(top, "device_traces") else {
            let keys: Vec<String> = top
                .keys()
                .map(|k| match k {
                    HashableValue::String(s) => format!("`{s}`"),
                    other => format!("{other:?}"),
                })
                .collect();
            let keys = if keys.is_empty() { "no keys".to_string() } else { keys.join(", ") };
            return Err(SnapshotError::NoDeviceTraces(keys));
        };
        let device_traces = as_list(traces, "device_traces")?
            .iter()
            .enumerate()
            .map(|(d, t)| parse_trace(t, d))
            .collect::<Result<Vec<_>, _>>()?;
        let segments = match get(top, "segments") {
            Some(s) => as_list(s, "segments")?
                .iter()
                .enumerate()
                .map(|(i, s)| parse_segment(s, i))
                .collect::<Result<Vec<_>, _>>()?,
            None => Vec::new(),
        };
        let settings = get(top, "allocator_settings").map(parse_settings).transpose()?;
        Ok(PyTorchSnapshot { segments, device_traces, settings })
    }

    /// The devices whose traces have entries.
    pub fn devices_with_entries(&self) -> Vec<usize> {
        (0..self.device_traces.len()).filter(|&d| !self.device_traces[d].is_empty()).collect()
    }

    /// The recording of `device` (`None`: the first device whose trace has entries), with
    /// the recorded settings (PyTorch's defaults when the snapshot does not record them) and
    /// the blocks and reserved bytes from before the trace began. Fails on an empty trace.
    pub fn recording(&self, device: Option<usize>) -> Result<Recording, SnapshotError> {
        let with_entries = self.devices_with_entries();
        let device = match device {
            Some(d) if with_entries.contains(&d) => d,
            Some(d) => return Err(SnapshotError::NoSuchDevice { device: d, with_entries }),
            None => *with_entries
                .first()
                .ok_or(SnapshotError::EmptyTrace { devices: self.device_traces.len() })?,
        };
        Ok(self.recording_of(device))
    }

    /// The recording of `device`, even if its trace is empty.
    pub(crate) fn recording_of(&self, device: usize) -> Recording {
        let mut entries = self.device_traces.get(device).cloned().unwrap_or_default();
        let segments: Vec<&SnapshotSegment> =
            self.segments.iter().filter(|s| s.device == device).collect();
        let mut before = before_trace(&entries, &segments);
        label_pools(&mut entries, &mut before, &segments);
        Recording {
            device_total: 0,
            config: self.settings.as_ref().map(RecordedSettings::to_conf).unwrap_or_default(),
            entries,
            prior_blocks: before.blocks,
            prior_segments: before.segments,
            reserved_before: before.reserved,
        }
    }
}

struct Before {
    blocks: Vec<PriorBlock>,
    segments: Vec<PriorSegment>,
    reserved: u64,
}

/// Disjoint address ranges (start -> end), merged where they touch.
#[derive(Default)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    /// The parts of `[start, end)` not in the set, in address order.
    fn missing(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = start;
        // The range that may cover `start`, then every range starting inside.
        let first = self.0.range(..=start).next_back().map(|(&s, &e)| (s, e));
        for (s, e) in first.into_iter().chain(self.0.range(start + 1..end).map(|(&s, &e)| (s, e))) {
            if e <= at {
                continue;
            }
            if s > at {
                out.push((at, s.min(end)));
            }
            at = at.max(e);
            if at >= end {
                break;
            }
        }
        if at < end {
            out.push((at, end));
        }
        out
    }

    /// Adds `[start, end)`.
    fn add(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        if let Some((&s, &e)) = self.0.range(..=start).next_back()
            && e >= start
        {
            start = s;
            end = end.max(e);
        }
        let inside: Vec<u64> = self.0.range(start..=end).map(|(&s, _)| s).collect();
        for s in inside {
            if let Some(e) = self.0.remove(&s) {
                end = end.max(e);
            }
        }
        self.0.insert(start, end);
    }
}

/// The blocks and segments that existed when the trace began, and the bytes then reserved,
/// from the trace and the segments at its end.
///
/// Which memory was reserved before the trace is decided by address ranges, not by segment
/// starts: every address the trace maps or allocates, or unmaps or frees, is *touched*; memory
/// that a `segment_free`/`segment_unmap` gives back, or that a segment at the end holds, and
/// that no earlier entry touched, was reserved before the trace began. This matters for
/// expandable segments, whose entries and snapshot segments are ranges of one reserved
/// address space: PyTorch's `map_block` and `unmap_block` record the mapped or unmapped
/// range (`SEGMENT_MAP`/`SEGMENT_UNMAP`), which may start inside an earlier mapped range and
/// end beyond it, and `DeviceCachingAllocator::snapshot` reports one segment per contiguous
/// mapped run. A trace that starts with an empty cache touches everything it later releases.
fn before_trace(entries: &[Event], segments: &[&SnapshotSegment]) -> Before {
    #[derive(PartialEq)]
    enum State {
        Live,
        Freeing,
    }
    let mut known: HashMap<u64, State> = HashMap::new();
    let mut blocks = Vec::new();
    let mut prior_segments = Vec::new();
    // Address ranges the trace mapped, allocated, unmapped or freed so far.
    let mut touched = Ranges::default();
    let mut growth: i128 = 0;
    for e in entries {
        match e.action {
            Action::Alloc => {
                known.insert(e.addr, State::Live);
            }
            Action::FreeRequested | Action::FreeCompleted => {
                // A block freed without having been allocated in the trace existed before it;
                // freed only to the cache (`free_completed`), it was waiting for streams.
                let pending_free = e.action == Action::FreeCompleted;
                let unknown = if pending_free {
                    known.remove(&e.addr).is_none()
                } else {
                    known.insert(e.addr, State::Freeing).is_none()
                };
                if unknown {
                    blocks.push(PriorBlock {
                        addr: e.addr,
                        size: e.size,
                        stream: e.stream,
                        pending_free,
                        pool: MempoolId::DEFAULT,
                    });
                }
            }
            a if a.grows() && e.size > 0 => {
                growth += e.size as i128;
                touched.add(e.addr, e.addr.saturating_add(e.size));
            }
            a if a.shrinks() && e.size > 0 => {
                growth -= e.size as i128;
                let end = e.addr.saturating_add(e.size);
                for (s, t) in touched.missing(e.addr, end) {
                    prior_segments.push(PriorSegment {
                        addr: s,
                        size: t - s,
                        stream: e.stream,
                        pool: MempoolId::DEFAULT,
                    });
                }
                touched.add(e.addr, end);
            }
            _ => {}
        }
    }
    for s in segments {
        let end = s.address.saturating_add(s.total_size);
        for (a, t) in touched.missing(s.address, end) {
            prior_segments.push(PriorSegment {
                addr: a,
                size: t - a,
                stream: s.stream,
                pool: MempoolId::DEFAULT,
            });
        }
        for b in &s.blocks {
            let pending_free = match b.state.as_str() {
                "active_allocated" => false,
                "active_pending_free" | "active_awaiting_free" => true,
                _ => continue,
            };
            if !known.contains_key(&b.address) {
                let size = if b.requested_size > 0 { b.requested_size } else { b.size };
                blocks.push(PriorBlock {
                    addr: b.address,
                    size,
                    stream: s.stream,
                    pending_free,
                    pool: MempoolId::DEFAULT,
                });
            }
        }
    }
    blocks.sort_by_key(|b| b.addr);
    prior_segments.sort_by_key(|s| s.addr);
    let reserved_now: i128 = segments.iter().map(|s| s.total_size as i128).sum();
    let reserved = (reserved_now - growth).clamp(0, u64::MAX as i128) as u64;
    Before { blocks, segments: prior_segments, reserved }
}

/// Gives each `alloc` the memory pool of the segment that held its block, and each `oom` the
/// pool of the run of allocations it interrupted; likewise for the blocks and segments from
/// before the trace. PyTorch's trace entries name no pool; its snapshot's segments do
/// (`segment_pool_id`, from `DeviceCachingAllocator::snapshot`'s `owner_private_pool_id`).
/// A segment that the trace creates has the pool of the snapshot's segment at its address
/// if it is still there at the end (never freed afterwards); one freed before the end is
/// taken to be the default pools' (the snapshot no longer says).
fn label_pools(entries: &mut [Event], before: &mut Before, segments: &[&SnapshotSegment]) {
    if segments.iter().all(|s| !s.pool.is_private()) {
        return;
    }
    // The snapshot's segments by address: start -> (end, pool).
    let at_end: BTreeMap<u64, (u64, MempoolId)> = segments
        .iter()
        .map(|s| (s.address, (s.address.saturating_add(s.total_size), s.pool)))
        .collect();
    let pool_at_end = |addr: u64| {
        at_end
            .range(..=addr)
            .next_back()
            .filter(|(_, (end, _))| addr < *end)
            .map_or(MempoolId::DEFAULT, |(_, (_, p))| *p)
    };
    // The last release of each segment start: a segment created after it survives.
    let mut last_release: HashMap<u64, usize> = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        if e.action.shrinks() {
            last_release.insert(e.addr, i);
        }
    }
    // Segments live so far: start -> (end, pool); a new one replaces those it overlays.
    let mut live: BTreeMap<u64, (u64, MempoolId)> = BTreeMap::new();
    for s in &before.segments {
        live.insert(s.addr, (s.addr.saturating_add(s.size), pool_at_end(s.addr)));
    }
    let lookup = |live: &BTreeMap<u64, (u64, MempoolId)>, addr: u64| {
        live.range(..=addr)
            .rev()
            .find(|(_, (end, _))| addr < *end)
            .map(|(_, (_, p))| *p)
            .unwrap_or_else(|| pool_at_end(addr))
    };
    let mut last_alloc: Option<(u64, MempoolId)> = None;
    for (i, entry) in entries.iter_mut().enumerate() {
        let e = *entry;
        match e.action {
            a if a.grows() && e.size > 0 => {
                let end = e.addr.saturating_add(e.size);
                let survives = last_release.get(&e.addr).is_none_or(|&r| r < i);
                let pool = if survives { pool_at_end(e.addr) } else { MempoolId::DEFAULT };
                let inside: Vec<u64> = live.range(e.addr..end).map(|(&s, _)| s).collect();
                for s in inside {
                    live.remove(&s);
                }
                live.insert(e.addr, (end, pool));
            }
            Action::Alloc => {
                let pool = lookup(&live, e.addr);
                entry.pool = pool;
                last_alloc = Some((e.stream, pool));
            }
            Action::Oom => {
                if let Some((stream, pool)) = last_alloc
                    && stream == e.stream
                {
                    entry.pool = pool;
                }
            }
            _ => {}
        }
    }
    for s in &mut before.segments {
        s.pool = pool_at_end(s.addr);
    }
    for b in &mut before.blocks {
        b.pool = pool_at_end(b.addr);
    }
}

#[cfg(test)]
mod tests {
    use super::Ranges;

    #[test]
    fn ranges_merge_and_say_what_is_missing() {
        let mut r = Ranges::default();
        r.add(100, 300);
        r.add(120, 140); // inside: the nearest start (120) does not cover 200
        assert_eq!(r.missing(200, 250), vec![]);
        assert_eq!(r.missing(50, 350), vec![(50, 100), (300, 350)]);
        r.add(400, 500);
        assert_eq!(r.missing(250, 450), vec![(300, 400)]);
        r.add(300, 400);
        assert_eq!(r.0.len(), 1, "touching ranges merge");
        assert_eq!(r.missing(0, 600), vec![(0, 100), (500, 600)]);
    }
}
