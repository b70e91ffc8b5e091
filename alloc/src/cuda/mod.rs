//! CUDA memory through cudarc's driver API, loaded at run time: the crate builds without
//! CUDA installed, and [`probe`] reports a missing driver instead of panicking.

mod memory;
mod probe;

pub use memory::{CudaEvent, CudaMemory, MAX_IDLE_EVENTS};
pub use probe::{CudaDeviceInfo, probe};
