//! Time per op: what [`Device::start_op_profile`](crate::Device::start_op_profile) collects.
//!
//! While a device profiles, every op on it (each goes through one dispatch function) is
//! timed from just before its allocations to the end of its work: on a GPU the device is
//! synchronized before and after, so each op's time is its own, launch overhead included,
//! and the ops run one at a time (a profiled step is slower than a plain one; compare ops
//! within it, not against plain steps). On the host the time is the CPU reference's; on a
//! virtual device only allocation time. Off (the default), an op pays one relaxed atomic
//! load.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// One op's total over a profile.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// The op's name, as in its errors (`matmul`, `conv2d_backward`, ...).
    pub name: &'static str,
    /// Calls while profiling.
    pub calls: u64,
    /// Their total time.
    pub total: Duration,
}

/// The per-device table behind [`OpTime`].
#[derive(Default)]
pub(crate) struct OpProfiler {
    on: AtomicBool,
    table: Mutex<Vec<OpTime>>,
}

impl OpProfiler {
    /// Whether ops are being timed.
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Clears the table and starts timing.
    pub(crate) fn start(&self) {
        self.lock().clear();
        self.on.store(true, Ordering::Relaxed);
    }

    /// Stops timing; the table, longest total first (then by name).
    pub(crate) fn stop(&self) -> Vec<OpTime> {
        self.on.store(false, Ordering::Relaxed);
        let mut ops = std::mem::take(&mut *self.lock());
        ops.sort_by(|a, b| b.total.cmp(&a.total).then(a.name.cmp(b.name)));
        ops
    }

    /// Adds one call of `name` that took `took`.
    pub(crate) fn record(&self, name: &'static str, took: Duration) {
        let mut table = self.lock();
        match table.iter_mut().find(|o| o.name == name) {
            Some(o) => {
                o.calls += 1;
                o.total += took;
            }
            None => table.push(OpTime { name, calls: 1, total: took }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<OpTime>> {
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Tensor, ops};

    /// Only ops between start and stop are counted, on every clone of the device, and a new
    /// profile starts from an empty table; a failed op is not counted.
    #[test]
    fn ops_are_counted_between_start_and_stop_only() {
        for dev in [Device::host(64 << 20), Device::virtual_device(64 << 20)] {
            let a = Tensor::zeros(&dev, &[8, 8], DType::F32).unwrap();
            let _ = ops::add(&a, &a).unwrap();
            assert!(dev.stop_op_profile().is_empty());
            let clone = dev.clone();
            clone.start_op_profile();
            let b = ops::add(&a, &a).unwrap();
            let _ = ops::matmul(&b, &a, false, false).unwrap();
            let _ = ops::matmul(&b, &a, true, false).unwrap();
            let wrong = Tensor::zeros(&dev, &[3, 5], DType::F32).unwrap();
            assert!(ops::add(&a, &wrong).is_err());
            let ops = dev.stop_op_profile();
            let calls: Vec<(&str, u64)> = {
                let mut c: Vec<_> = ops.iter().map(|o| (o.name, o.calls)).collect();
                c.sort();
                c
            };
            // (Making `wrong` was an op too; the failed add is not counted.)
            assert!(calls.contains(&("add", 1)) && calls.contains(&("matmul", 2)), "{calls:?}");
            assert!(ops.windows(2).all(|w| w[0].total >= w[1].total), "longest first");
            let _ = ops::add(&a, &a).unwrap();
            assert!(dev.stop_op_profile().is_empty(), "nothing after stop");
            dev.start_op_profile();
            assert!(dev.stop_op_profile().is_empty(), "a new profile starts empty");
        }
    }
}
