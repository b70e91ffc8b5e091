//! Finding out, without panicking, whether a CUDA device can be used.

use cudarc::driver::{result, sys};

/// A usable CUDA device, as found by [`probe`].
#[derive(Clone, Debug)]
pub struct CudaDeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Total device memory in bytes.
    pub total_bytes: usize,
}

/// Looks for CUDA device `ordinal`. Returns why it cannot be used instead of panicking:
/// the driver library is loaded only after checking that it is present.
pub fn probe(ordinal: usize) -> Result<CudaDeviceInfo, String> {
    // SAFETY: only tries to open the driver library by its candidate names; no CUDA call.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda) was found".into());
    }
    result::init().map_err(|e| format!("cuInit failed: {e}"))?;
    let count = result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e}"))?;
    if ordinal >= count.max(0) as usize {
        return Err(format!("CUDA device {ordinal} requested but {count} device(s) present"));
    }
    let dev = result::device::get(ordinal as i32).map_err(|e| format!("cuDeviceGet: {e}"))?;
    let name = result::device::get_name(dev).map_err(|e| format!("cuDeviceGetName: {e}"))?;
    // SAFETY: `dev` is a valid device handle returned by cuDeviceGet above.
    let total_bytes =
        unsafe { result::device::total_mem(dev) }.map_err(|e| format!("cuDeviceTotalMem: {e}"))?;
    Ok(CudaDeviceInfo { ordinal, name, total_bytes })
}
