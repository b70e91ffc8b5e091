//! DDP gradient buckets: gradients grouped in reverse parameter order (the order backward
//! produces them) into buckets of at most `cap_bytes`, each all-reduced as one buffer.

use crate::comm::{CommError, Communicator, ReduceOp};

/// PyTorch DDP's default `bucket_cap_mb` (25 MiB), in bytes.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// Which parameters (indices into the parameter list) share each bucket, in reduction order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// Buckets in the order they are reduced; each lists parameter indices.
    pub buckets: Vec<Vec<usize>>,
}

impl BucketPlan {
    /// Plans buckets for parameters of `numels` f32 elements: reverse parameter order, a new
    /// bucket whenever adding the next gradient would pass `cap_bytes` (a gradient larger
    /// than the cap gets a bucket of its own).
    pub fn new(numels: &[usize], cap_bytes: usize) -> Self {
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut bytes = 0usize;
        for i in (0..numels.len()).rev() {
            let b = numels[i] * std::mem::size_of::<f32>();
            match buckets.last_mut() {
                Some(cur) if bytes + b <= cap_bytes => {
                    cur.push(i);
                    bytes += b;
                }
                _ => {
                    buckets.push(vec![i]);
                    bytes = b;
                }
            }
        }
        Self { buckets }
    }

    /// Averages `grads` over all ranks, bucket by bucket (flatten, all-reduce, unflatten).
    pub fn all_reduce(
        &self,
        comm: &dyn Communicator,
        grads: &mut [Vec<f32>],
    ) -> Result<(), CommError> {
        let mut flat = Vec::new();
        for bucket in &self.buckets {
            flat.clear();
            for &i in bucket {
                flat.extend_from_slice(&grads[i]);
            }
            comm.all_reduce(&mut flat, ReduceOp::Average)?;
            let mut off = 0;
            for &i in bucket {
                let n = grads[i].len();
                grads[i].copy_from_slice(&flat[off..off + n]);
                off += n;
            }
        }
        Ok(())
    }
}
