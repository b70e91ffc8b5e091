//! Snapshots of the cache: segments, blocks, states and the trace, in the layout of
//! `torch.cuda.memory._snapshot()`, exported as JSON or as a pickle that PyTorch's memory
//! visualizer (<https://pytorch.org/memory_viz>) opens.

use crate::block::BlockState;
use crate::memory::{DeviceMemory, DevicePtr};
use crate::state::State;
use crate::trace::{TraceAction, TraceEntry};
use serde::{Deserialize, Serialize};

/// The state of the cache at one moment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The device, in words.
    pub device_name: String,
    /// Every segment (for expandable segments: every mapped run), by address.
    pub segments: Vec<SegmentInfo>,
    /// The recorded trace, one list per device (PyTorch's layout); empty unless recording.
    pub device_traces: Vec<Vec<TraceInfo>>,
}

/// One segment.
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
    /// Bytes requested by the owners of allocated blocks.
    pub requested_size: u64,
    /// Stream the segment belongs to.
    pub stream: u64,
    /// `"small"` or `"large"`.
    pub segment_type: String,
    /// Whether the segment is part of an expandable segment.
    pub is_expandable: bool,
    /// Call stacks (not recorded; present for memory_viz).
    pub frames: Vec<Frame>,
    /// The blocks that tile the segment, by address.
    pub blocks: Vec<BlockInfo>,
}

/// One block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// Address.
    pub address: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// Bytes requested (0 when free).
    pub requested_size: u64,
    /// `"active_allocated"`, `"active_pending_free"` or `"inactive"`.
    pub state: String,
    /// Call stacks (not recorded; present for memory_viz).
    pub frames: Vec<Frame>,
}

/// A stack frame (vram records none; the type exists for memory_viz's layout).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Frame {
    /// File name.
    pub filename: String,
    /// Line number.
    pub line: u32,
    /// Function name.
    pub name: String,
}

/// One trace entry in memory_viz's layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceInfo {
    /// The action (`alloc`, `free_requested`, ...).
    pub action: TraceAction,
    /// Address.
    pub addr: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// Bytes requested (`alloc` entries).
    pub requested_size: u64,
    /// Stream.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// Call stacks (not recorded).
    pub frames: Vec<Frame>,
}

impl From<TraceEntry> for TraceInfo {
    fn from(e: TraceEntry) -> Self {
        TraceInfo {
            action: e.action,
            addr: e.addr,
            size: e.size as u64,
            requested_size: e.requested as u64,
            stream: e.stream,
            time_us: e.time_us,
            frames: Vec::new(),
        }
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
                    segment_type: seg.pool.name().to_string(),
                    is_expandable: seg.expandable,
                    frames: Vec::new(),
                    blocks: Vec::new(),
                });
                let size = b.size as u64;
                let requested =
                    if b.state == BlockState::Allocated { b.requested as u64 } else { 0 };
                s.total_size += size;
                if b.state == BlockState::Allocated {
                    s.allocated_size += size;
                    s.requested_size += requested;
                }
                if b.state != BlockState::Free {
                    s.active_size += size;
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
        let trace: Vec<TraceInfo> =
            state.trace.entries().into_iter().map(TraceInfo::from).collect();
        Snapshot { device_name: device_name.to_string(), segments, device_traces: vec![trace] }
    }

    /// Bytes in all segments (equals `reserved_bytes.all.current`).
    pub fn reserved_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.total_size).sum()
    }

    /// Bytes in allocated blocks (equals `allocated_bytes.all.current`).
    pub fn allocated_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.allocated_size).sum()
    }

    /// The snapshot as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("snapshots serialize")
    }

    /// The snapshot as a Python pickle: `pickle.load` gives the dict PyTorch's
    /// `torch.cuda.memory._snapshot()` returns, which memory_viz opens.
    pub fn to_pickle(&self) -> Vec<u8> {
        serde_pickle::to_vec(self, serde_pickle::SerOptions::new()).expect("snapshots serialize")
    }
}
