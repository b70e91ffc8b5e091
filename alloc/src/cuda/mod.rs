//! CUDA memory through cudarc's driver API, loaded at run time.

mod probe;

pub use probe::{CudaDeviceInfo, probe};
