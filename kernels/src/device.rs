//! Devices: where tensors live and which allocator counts their bytes.
//!
//! Only the host backend computes today. Its memory is a [`CachingAllocator`] over
//! [`HostMemory`], so every tensor's bytes pass through PyTorch's caching policy and show in
//! the same statistics a GPU run would give.

use crate::error::{Error, Result};
use std::fmt;
use std::sync::Arc;
use vram_alloc::{AllocatorConfig, CachingAllocator, HostMemory, MemoryStats, Snapshot};

/// The environment variable [`Device::from_env`] reads: `cpu` or `cuda`.
pub const DEVICE_ENV_VAR: &str = "VRAM_DEVICE";

/// Host capacity used by [`Device::auto`] and [`Device::from_env`] when the machine's
/// physical memory cannot be read.
const FALLBACK_HOST_CAPACITY: u64 = 16 << 30;

const CUDA_UNSUPPORTED: &str = "CUDA kernels are not implemented yet; use the host device";

/// A compute device: a cheap-to-clone handle (clones share one allocator).
///
/// Two handles are the same device ([`PartialEq`]) when one is a clone of the other; ops
/// refuse to combine tensors of different devices.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Backend>,
}

/// The backends. A CUDA variant joins once CUDA kernels exist.
enum Backend {
    Host(CachingAllocator<HostMemory>),
}

impl Device {
    /// A host device whose memory is capped at `capacity_bytes`, with the allocator's default
    /// settings.
    pub fn host(capacity_bytes: u64) -> Device {
        Device::from_allocator(CachingAllocator::new(HostMemory::new(capacity_bytes)))
    }

    /// A host device with the given allocator settings.
    ///
    /// # Errors
    ///
    /// [`Error::Allocator`] if the host backend cannot honour `config`.
    pub fn host_with_config(capacity_bytes: u64, config: AllocatorConfig) -> Result<Device> {
        let alloc = CachingAllocator::with_config(HostMemory::new(capacity_bytes), config)?;
        Ok(Device::from_allocator(alloc))
    }

    /// The best device available. CUDA kernels do not exist yet, so this is always the
    /// host, capped at the machine's physical memory and configured from
    /// [`vram_alloc::ENV_VAR`] (`VRAM_ALLOC_CONF`).
    ///
    /// # Errors
    ///
    /// [`Error::Allocator`] if `VRAM_ALLOC_CONF` is invalid.
    pub fn auto() -> Result<Device> {
        let alloc = CachingAllocator::from_env(HostMemory::new(physical_memory()))?;
        Ok(Device::from_allocator(alloc))
    }

    /// The device named by [`DEVICE_ENV_VAR`] (`VRAM_DEVICE`): `cpu` for the host, `cuda`
    /// for a GPU; unset or empty means [`Device::auto`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for any other value, [`Error::Unsupported`] for `cuda`
    /// (CUDA kernels are not implemented yet), and [`Device::auto`]'s errors.
    pub fn from_env() -> Result<Device> {
        Device::from_name(&std::env::var(DEVICE_ENV_VAR).unwrap_or_default())
    }

    /// The device named `name` (case-insensitive): `cpu` (or `host`) for the host, `cuda`
    /// for a GPU; empty means [`Device::auto`].
    ///
    /// # Errors
    ///
    /// As [`Device::from_env`].
    pub fn from_name(name: &str) -> Result<Device> {
        match name.trim().to_ascii_lowercase().as_str() {
            "" | "cpu" | "host" => Device::auto(),
            "cuda" => Err(Error::Unsupported(CUDA_UNSUPPORTED.to_string())),
            other => Err(Error::InvalidArgument {
                op: "Device::from_env",
                reason: format!("{DEVICE_ENV_VAR}={other:?} is not a device; use `cpu` or `cuda`"),
            }),
        }
    }

    fn from_allocator(alloc: CachingAllocator<HostMemory>) -> Device {
        Device { inner: Arc::new(Backend::Host(alloc)) }
    }

    /// The host allocator that holds this device's tensors.
    pub fn host_allocator(&self) -> &CachingAllocator<HostMemory> {
        match &*self.inner {
            Backend::Host(alloc) => alloc,
        }
    }

    /// The device in words, e.g. `cpu (host memory (16.00 GiB cap))`.
    pub fn name(&self) -> String {
        match &*self.inner {
            Backend::Host(alloc) => {
                format!("cpu ({})", vram_alloc::DeviceMemory::name(alloc.memory()))
            }
        }
    }

    /// Whether this is a CUDA device (never, until CUDA kernels exist).
    pub fn is_cuda(&self) -> bool {
        match &*self.inner {
            Backend::Host(_) => false,
        }
    }

    /// The allocator's statistics, with PyTorch's key names.
    pub fn memory_stats(&self) -> MemoryStats {
        self.host_allocator().memory_stats()
    }

    /// Bytes held by live tensors (`torch.cuda.memory_allocated`).
    pub fn memory_allocated(&self) -> u64 {
        self.host_allocator().memory_allocated()
    }

    /// Bytes reserved from the device, live plus cached (`torch.cuda.memory_reserved`).
    pub fn memory_reserved(&self) -> u64 {
        self.host_allocator().memory_reserved()
    }

    /// Peak of [`memory_allocated`](Self::memory_allocated) since creation or the last
    /// [`reset_peak_stats`](Self::reset_peak_stats).
    pub fn max_memory_allocated(&self) -> u64 {
        self.host_allocator().max_memory_allocated()
    }

    /// Peak of [`memory_reserved`](Self::memory_reserved).
    pub fn max_memory_reserved(&self) -> u64 {
        self.host_allocator().max_memory_reserved()
    }

    /// Restarts the peak statistics from the current values.
    pub fn reset_peak_stats(&self) {
        self.host_allocator().reset_peak_stats();
    }

    /// Returns cached, unused memory to the device; live tensors are untouched.
    pub fn empty_cache(&self) {
        self.host_allocator().empty_cache();
    }

    /// Caps reserved memory at `fraction` (in `[0, 1]`) of the device's capacity.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if `fraction` is outside `[0, 1]`.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        self.host_allocator().set_memory_fraction(fraction).map_err(|e| Error::InvalidArgument {
            op: "set_memory_fraction",
            reason: e.to_string(),
        })
    }

    /// The allocator's statistics as a table (`torch.cuda.memory_summary`).
    pub fn memory_summary(&self) -> String {
        self.host_allocator().memory_summary()
    }

    /// Segments and blocks of the allocator (`torch.cuda.memory._snapshot`).
    pub fn snapshot(&self) -> Snapshot {
        self.host_allocator().snapshot()
    }

    /// Whether `self` and `other` are handles to one device.
    pub fn same_device(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Device) -> bool {
        self.same_device(other)
    }
}

impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("allocated", &self.memory_allocated())
            .field("reserved", &self.memory_reserved())
            .finish()
    }
}

/// The machine's physical memory (`MemTotal` of `/proc/meminfo`), or a fallback.
fn physical_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        })
        .unwrap_or(FALLBACK_HOST_CAPACITY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_are_one_device_and_new_devices_are_distinct() {
        let a = Device::host(1 << 20);
        let b = a.clone();
        assert_eq!(a, b);
        assert_ne!(a, Device::host(1 << 20));
        assert!(!a.is_cuda());
        assert!(a.name().starts_with("cpu"), "{}", a.name());
    }

    #[test]
    fn memory_fraction_outside_unit_interval_is_rejected() {
        let d = Device::host(1 << 20);
        assert!(matches!(d.set_memory_fraction(1.5), Err(Error::InvalidArgument { .. })));
        d.set_memory_fraction(0.5).unwrap();
    }

    #[test]
    fn device_names_parse_and_cuda_is_reported_unsupported() {
        assert!(!Device::from_name("CPU").unwrap().is_cuda());
        let cuda = Device::from_name("cuda").unwrap_err();
        assert!(matches!(cuda, Error::Unsupported(_)));
        assert!(cuda.to_string().contains("not implemented yet"), "{cuda}");
        let bad = Device::from_name("tpu").unwrap_err();
        assert!(bad.to_string().contains("VRAM_DEVICE") && bad.to_string().contains("tpu"));
    }

    #[test]
    fn auto_picks_the_host() {
        assert!(!Device::auto().unwrap().is_cuda());
    }
}
