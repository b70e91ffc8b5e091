//! vram-accum: a layer-chain executor with gradient accumulation and activation
//! checkpointing, trading compute for memory.

mod layer;

pub use layer::{ForwardCtx, Layer, Mode, Param, Saved};
