//! Snapshots of the cache: segments, blocks, states and the trace, in the layout of
//! `torch.cuda.memory._snapshot()`, exported as JSON or as the pickle
//! `torch.cuda.memory._dump_snapshot()` writes, which PyTorch's memory visualizer
//! (<https://pytorch.org/memory_viz>) and `torch/cuda/_memory_viz.py` read.
//!
//! The dict has PyTorch's keys, in PyTorch's order, with PyTorch's value types (as PyTorch 2.11
//! builds it in `torch/csrc/cuda/Module.cpp` without recorded stacks):
//!
//! ```text
//! {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
//!                "requested_size", "stream", "segment_type": "small"|"large",
//!                "segment_pool_id": (0, 0), "is_expandable", "frames": [],
//!                "blocks": [{"address", "size", "requested_size",
//!                            "state": "active_allocated"|"active_pending_free"|"inactive",
//!                            "frames": []}]}],
//!  "device_traces": [[{"action", "addr" (or "device_free" for "oom"), "size", "stream",
//!                      "time_us", "compile_context": "N/A", "user_metadata": "",
//!                      "frames": []}]],
//!  "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF", "max_split_size",
//!                         "garbage_collection_threshold", "expandable_segments",
//!                         "pinned_num_register_threads", "release_lock_on_cudamalloc",
//!                         "pinned_use_cuda_host_register",
//!                         "graph_capture_record_stream_reuse",
//!                         "roundup_power2_divisions": {"1": .., "2": .., ... "32768": ..}},
//!  "external_annotations": []}
//! ```
//!
//! As in PyTorch, a trace entry's `size` is what its action is about: the bytes the caller
//! asked for (`alloc`, `free_requested`, `free_completed`), the rounded request (`oom`), the
//! segment's or mapped range's size (segment actions). An expandable segment shows as one
//! segment per mapped range, and its reservation of address space is not traced (PyTorch
//! traces only `segment_map`/`segment_unmap` for it). vram records no stacks, so every
//! `frames` is empty (PyTorch adds `frames` to trace entries only when it records stacks;
//! with them on, it comes last, as here).

use crate::block::BlockState;
use crate::config::AllocatorConfig;
use crate::memory::{DeviceMemory, DevicePtr};
use crate::pickle;
use crate::state::State;
use crate::trace::{TraceAction, TraceEntry};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The state of the cache at one moment: `torch.cuda.memory._snapshot()`'s dict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The device, in words (not part of PyTorch's dict, so neither exported form has it).
    #[serde(skip)]
    pub device_name: String,
    /// Every segment (for expandable segments: every mapped range), by address.
    pub segments: Vec<SegmentInfo>,
    /// The recorded trace, one list per device (one device here); empty unless recording.
    pub device_traces: Vec<Vec<TraceInfo>>,
    /// The allocator's settings, under PyTorch's names.
    pub allocator_settings: AllocatorSettings,
    /// User annotations (`torch.cuda.memory._record_memory_history` has them; vram records
    /// none, so this is always empty).
    pub external_annotations: Vec<serde_json::Value>,
}

/// One segment (PyTorch's `SegmentInfo`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SegmentInfo {
    /// Device index (always 0: one allocator per device).
    pub device: u32,
    /// Base address.
    pub address: DevicePtr,
    /// Bytes in the segment.
    pub total_size: u64,
    /// Bytes in allocated blocks.
    pub allocated_size: u64,
    /// Bytes in active blocks (allocated or waiting for other streams).
    pub active_size: u64,
    /// Bytes requested by the owners of active blocks.
    pub requested_size: u64,
    /// Stream the segment belongs to.
    pub stream: u64,
    /// `"small"` or `"large"`.
    pub segment_type: String,
    /// The memory pool that owns the segment: `(0, 0)` for the default pools, else the
    /// private pool's id ([`crate::MempoolId`]).
    pub segment_pool_id: (i64, i64),
    /// Whether the segment is part of an expandable segment.
    pub is_expandable: bool,
    /// Call stack of the segment's allocation (vram records none).
    pub frames: Vec<Frame>,
    /// The blocks that tile the segment, by address.
    pub blocks: Vec<BlockInfo>,
}

/// One block (PyTorch's `BlockInfo`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// Address.
    pub address: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// Bytes its owner asked for (0 when inactive).
    pub requested_size: u64,
    /// `"active_allocated"`, `"active_pending_free"` or `"inactive"`.
    pub state: String,
    /// Call stack of the block's allocation (vram records none).
    pub frames: Vec<Frame>,
}

/// A stack frame (vram records none; the type exists for PyTorch's layout).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Frame {
    /// Function name.
    pub name: String,
    /// File name.
    pub filename: String,
    /// Line number.
    pub line: u32,
}

/// One trace entry in PyTorch's layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceInfo {
    /// The action (`alloc`, `free_requested`, ...).
    pub action: TraceAction,
    /// Address of the block, segment or mapped range (every action but `oom`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<DevicePtr>,
    /// Free device memory when the allocation failed (`oom` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
    /// Bytes: requested (`alloc`, `free_requested`, `free_completed`), the rounded request
    /// (`oom`), or the segment's or mapped range's size.
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// The `torch.compile` context (PyTorch writes `"N/A"` outside one).
    pub compile_context: String,
    /// User metadata set with `torch.cuda.memory._set_memory_metadata` (empty).
    pub user_metadata: String,
    /// Call stack (vram records none).
    pub frames: Vec<Frame>,
}

/// The allocator settings under PyTorch's names (`allocator_settings` of the snapshot).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocatorSettings {
    /// The settings string (`VRAM_ALLOC_CONF` syntax, which is PyTorch's).
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF")]
    pub alloc_conf: String,
    /// `max_split_size_mb` in bytes; -1 when unlimited (PyTorch's `int64_t(SIZE_MAX)`).
    pub max_split_size: i64,
    /// The garbage-collection threshold; 0.0 when off.
    pub garbage_collection_threshold: f64,
    /// Whether expandable segments are on.
    pub expandable_segments: bool,
    /// PyTorch's pinned-memory setting (not used by vram; PyTorch's default, 1).
    pub pinned_num_register_threads: i64,
    /// PyTorch's setting (not used by vram; false).
    pub release_lock_on_cudamalloc: bool,
    /// PyTorch's pinned-memory setting (not used by vram; false).
    pub pinned_use_cuda_host_register: bool,
    /// PyTorch's CUDA-graph setting (not used by vram; false).
    pub graph_capture_record_stream_reuse: bool,
    /// Divisions per power-of-two size interval, keyed by the interval's start in MiB
    /// (1, 2, 4, ... 32768, as PyTorch keys its 16 intervals; 0 = no rounding).
    pub roundup_power2_divisions: BTreeMap<u64, i64>,
}

/// PyTorch's number of `roundup_power2_divisions` intervals (1 MiB ... 32 GiB and over).
const ROUNDUP_INTERVALS: u32 = 16;

impl AllocatorSettings {
    /// `config` under PyTorch's names.
    pub fn from_config(config: &AllocatorConfig) -> Self {
        AllocatorSettings {
            alloc_conf: config.to_string(),
            max_split_size: config.max_split_size().try_into().unwrap_or(-1),
            garbage_collection_threshold: config.garbage_collection_threshold().unwrap_or(0.0),
            expandable_segments: config.expandable_segments(),
            pinned_num_register_threads: 1,
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: false,
            graph_capture_record_stream_reuse: false,
            roundup_power2_divisions: (0..ROUNDUP_INTERVALS)
                .map(|i| {
                    let divisions = config.roundup_power2_divisions(1usize << (20 + i));
                    (1u64 << i, divisions as i64)
                })
                .collect(),
        }
    }
}

impl TraceInfo {
    /// The entry as PyTorch reports it, or `None` for what PyTorch does not trace (the
    /// reservation and release of an expandable segment's address space, which vram records
    /// as a `segment_alloc`/`segment_free` of 0 bytes).
    pub fn from_entry(e: &TraceEntry) -> Option<TraceInfo> {
        let size = match e.action {
            TraceAction::Alloc | TraceAction::FreeRequested | TraceAction::FreeCompleted => {
                e.requested
            }
            TraceAction::SegmentAlloc | TraceAction::SegmentFree if e.size == 0 => return None,
            _ => e.size,
        };
        let oom = e.action == TraceAction::Oom;
        Some(TraceInfo {
            action: e.action,
            addr: (!oom).then_some(e.addr),
            device_free: oom.then_some(e.device_free),
            size: size as u64,
            stream: e.stream,
            time_us: e.time_us,
            compile_context: "N/A".into(),
            user_metadata: String::new(),
            frames: Vec::new(),
        })
    }
}

impl Snapshot {
    pub(crate) fn capture<M: DeviceMemory>(state: &State<M>, device_name: &str) -> Snapshot {
        let mut segments = Vec::new();
        for seg in state.segments.values() {
            let mut current: Option<SegmentInfo> = None;
            let mut cursor = Some(seg.head);
            while let Some(id) = cursor {
                let b = &state.arena[id];
                cursor = b.next;
                let block_state = match b.state {
                    BlockState::Unmapped => {
                        segments.extend(current.take());
                        continue;
                    }
                    BlockState::Allocated => "active_allocated",
                    BlockState::PendingFree => "active_pending_free",
                    BlockState::Free => "inactive",
                };
                let s = current.get_or_insert_with(|| SegmentInfo {
                    device: 0,
                    address: b.ptr,
                    total_size: 0,
                    allocated_size: 0,
                    active_size: 0,
                    requested_size: 0,
                    stream: seg.stream.0,
                    segment_type: seg.pool.kind().name().to_string(),
                    segment_pool_id: {
                        let id = state.mempool_id(seg.pool);
                        (id.0 as i64, id.1 as i64)
                    },
                    is_expandable: seg.expandable,
                    frames: Vec::new(),
                    blocks: Vec::new(),
                });
                let size = b.size as u64;
                let active = b.state != BlockState::Free;
                let requested = if active { b.requested as u64 } else { 0 };
                s.total_size += size;
                if b.state == BlockState::Allocated {
                    s.allocated_size += size;
                }
                if active {
                    s.active_size += size;
                    s.requested_size += requested;
                }
                s.blocks.push(BlockInfo {
                    address: b.ptr,
                    size,
                    requested_size: requested,
                    state: block_state.to_string(),
                    frames: Vec::new(),
                });
            }
            segments.extend(current);
        }
        let trace = state.trace.entries().iter().filter_map(TraceInfo::from_entry).collect();
        Snapshot {
            device_name: device_name.to_string(),
            segments,
            device_traces: vec![trace],
            allocator_settings: AllocatorSettings::from_config(&state.config),
            external_annotations: Vec::new(),
        }
    }

    /// Bytes in all segments (equals `reserved_bytes.all.current`).
    pub fn reserved_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.total_size).sum()
    }

    /// Bytes in allocated blocks (equals `allocated_bytes.all.current`).
    pub fn allocated_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.allocated_size).sum()
    }

    /// The snapshot as JSON: the same dict as [`Self::to_pickle`], tuples as arrays (the
    /// memory visualizer opens this too).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("snapshots serialize")
    }

    /// The snapshot as the pickle `torch.cuda.memory._dump_snapshot()` writes: the bytes
    /// Python's `pickle.dump` (protocol 4) gives for [`torch.cuda.memory._snapshot()`]'s dict,
    /// integers included, so PyTorch's memory visualizer and `_memory_viz.py` open it.
    ///
    /// [`torch.cuda.memory._snapshot()`]: https://pytorch.org/docs/stable/torch_cuda_memory.html
    pub fn to_pickle(&self) -> Vec<u8> {
        pickle::dumps(&pickle::to_value(self).expect("snapshots serialize"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(action: TraceAction, size: usize, requested: usize) -> TraceEntry {
        TraceEntry {
            action,
            addr: 0x7f00_0000_0000,
            size,
            requested,
            stream: 0,
            time_us: 1_700_000_000_000_000,
            device_free: 0,
        }
    }

    #[test]
    fn trace_entries_report_what_pytorch_reports() {
        let alloc = TraceInfo::from_entry(&entry(TraceAction::Alloc, 2 << 20, 1_500_000)).unwrap();
        assert_eq!(
            (alloc.addr, alloc.size, alloc.device_free),
            (Some(0x7f00_0000_0000), 1_500_000, None)
        );
        let mut oom = entry(TraceAction::Oom, 3 << 30, (3 << 30) - 5);
        oom.addr = 0;
        oom.device_free = 123;
        let oom = TraceInfo::from_entry(&oom).unwrap();
        assert_eq!((oom.addr, oom.device_free, oom.size), (None, Some(123), 3 << 30));
        let json = serde_json::to_value(&oom).unwrap();
        assert!(json.get("addr").is_none() && json["device_free"] == 123);
        let seg = TraceInfo::from_entry(&entry(TraceAction::SegmentAlloc, 20 << 20, 0)).unwrap();
        assert_eq!(seg.size, 20 << 20);
        assert!(TraceInfo::from_entry(&entry(TraceAction::SegmentAlloc, 0, 0)).is_none());
        assert!(TraceInfo::from_entry(&entry(TraceAction::SegmentFree, 0, 0)).is_none());
        let keys: Vec<String> =
            serde_json::to_value(&alloc).unwrap().as_object().unwrap().keys().cloned().collect();
        let mut expected = [
            "action",
            "addr",
            "size",
            "stream",
            "time_us",
            "compile_context",
            "user_metadata",
            "frames",
        ];
        expected.sort();
        assert_eq!(keys, expected);
    }

    #[test]
    fn settings_use_pytorch_names_and_defaults() {
        let s = AllocatorSettings::from_config(&AllocatorConfig::default());
        assert_eq!(s.max_split_size, -1);
        assert_eq!(s.garbage_collection_threshold, 0.0);
        assert_eq!(s.roundup_power2_divisions.len(), 16);
        assert_eq!(s.roundup_power2_divisions.keys().last(), Some(&32768));
        let c = AllocatorConfig::parse(
            "max_split_size_mb:256,expandable_segments:True,roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6",
        )
        .unwrap();
        let s = AllocatorSettings::from_config(&c);
        assert_eq!(s.max_split_size, 256 << 20);
        assert!(s.expandable_segments);
        assert_eq!(s.garbage_collection_threshold, 0.6);
        assert_eq!(s.roundup_power2_divisions[&1], 1);
        assert_eq!(s.roundup_power2_divisions[&256], 1);
        assert_eq!(s.roundup_power2_divisions[&512], 2);
        assert_eq!(s.roundup_power2_divisions[&1024], 4);
        assert_eq!(AllocatorConfig::parse(&s.alloc_conf).unwrap(), c);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["PYTORCH_CUDA_ALLOC_CONF"], s.alloc_conf);
        assert_eq!(json["roundup_power2_divisions"]["512"], 2);
    }
}
