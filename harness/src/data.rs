//! Synthetic, learnable data sets generated from a fixed seed, and a loader that prepares the
//! next batches on a worker thread.
//!
//! A batch depends only on (seed, batch index, batch size), so every variant of an
//! experiment sees the same data.

use crate::rng::Rng;
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::JoinHandle;

/// One batch on the host.
#[derive(Clone, Debug)]
pub struct Batch {
    /// Inputs: features `[b, d]` or images `[b, c, h, w]` as f32, or token ids as u32.
    pub input: Input,
    /// Class per sample, or next token per position.
    pub targets: Vec<u32>,
}

impl Batch {
    /// `parts` consecutive slices of the batch (the last takes the remainder): the
    /// micro-batches of gradient accumulation.
    pub fn split(&self, parts: usize) -> Vec<Batch> {
        let n = self.targets.len();
        let per_sample = match &self.input {
            Input::Dense { values, .. } => values.len() / n.max(1),
            Input::Tokens(_) => 1,
            Input::Shape(shape) => shape.iter().skip(1).product(),
        };
        let step = n.div_ceil(parts.max(1)).max(1);
        (0..n)
            .step_by(step)
            .map(|lo| {
                let hi = (lo + step).min(n);
                let input = match &self.input {
                    Input::Dense { values, shape } => {
                        let mut shape = shape.clone();
                        shape[0] = hi - lo;
                        Input::Dense {
                            values: values[lo * per_sample..hi * per_sample].to_vec(),
                            shape,
                        }
                    }
                    Input::Tokens(ids) => Input::Tokens(ids[lo..hi].to_vec()),
                    Input::Shape(shape) => {
                        let mut shape = shape.clone();
                        shape[0] = hi - lo;
                        Input::Shape(shape)
                    }
                };
                Batch { input, targets: self.targets[lo..hi].to_vec() }
            })
            .collect()
    }
}

/// A batch's inputs.
#[derive(Clone, Debug)]
pub enum Input {
    /// Real-valued inputs with their shape.
    Dense {
        /// Row-major values.
        values: Vec<f32>,
        /// Shape, batch first.
        shape: Vec<usize>,
    },
    /// Token ids `[b * s]`.
    Tokens(Vec<u32>),
    /// Real-valued inputs of this shape whose values were not generated: a virtual device
    /// (which keeps no values) allocates them without the host drawing any. From
    /// [`Dataset::batch_without_values`].
    Shape(Vec<usize>),
}

/// A source of batches.
#[derive(Clone, Debug)]
pub enum Dataset {
    /// Gaussian clusters: `classes` centres in `dim` dimensions, unit noise.
    Clusters {
        /// Feature dimension.
        dim: usize,
        /// Number of classes.
        classes: usize,
    },
    /// Images whose class sets the orientation and frequency of a stripe pattern, plus noise.
    Stripes {
        /// Image side (square images, 3 channels).
        side: usize,
        /// Number of classes.
        classes: usize,
    },
    /// Token sequences where each token follows from the previous by a fixed affine rule
    /// modulo the vocabulary, with 10% random tokens.
    Sequences {
        /// Vocabulary size.
        vocab: usize,
        /// Sequence length.
        seq: usize,
    },
}

impl Dataset {
    /// Batch number `index` of `size` samples, for data seed `seed`.
    pub fn batch(&self, seed: u64, index: u64, size: usize) -> Batch {
        let mut rng = Rng::new(seed ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        match *self {
            Dataset::Clusters { dim, classes } => {
                let centres = centres(seed, dim, classes);
                let mut values = Vec::with_capacity(size * dim);
                let mut targets = Vec::with_capacity(size);
                for _ in 0..size {
                    let y = rng.below(classes as u64) as usize;
                    targets.push(y as u32);
                    values.extend((0..dim).map(|j| centres[y * dim + j] + rng.normal()));
                }
                Batch { input: Input::Dense { values, shape: vec![size, dim] }, targets }
            }
            Dataset::Stripes { side, classes } => {
                let mut values = Vec::with_capacity(size * 3 * side * side);
                let mut targets = Vec::with_capacity(size);
                for _ in 0..size {
                    let y = rng.below(classes as u64) as usize;
                    targets.push(y as u32);
                    let angle = std::f32::consts::PI * y as f32 / classes as f32;
                    let freq = 0.25 + 0.5 * (y % 3) as f32 / 3.0;
                    let (s, c) = angle.sin_cos();
                    for ch in 0..3 {
                        for i in 0..side {
                            for j in 0..side {
                                let t = (i as f32 * c + j as f32 * s) * freq + ch as f32;
                                values.push(t.sin() + 0.5 * rng.normal());
                            }
                        }
                    }
                }
                Batch { input: Input::Dense { values, shape: vec![size, 3, side, side] }, targets }
            }
            Dataset::Sequences { vocab, seq } => {
                let (a, c) = (5u64, 3u64);
                let mut ids = Vec::with_capacity(size * seq);
                let mut targets = Vec::with_capacity(size * seq);
                for _ in 0..size {
                    let mut t = rng.below(vocab as u64);
                    for _ in 0..seq {
                        let next = if rng.below(10) == 0 {
                            rng.below(vocab as u64)
                        } else {
                            (a * t + c) % vocab as u64
                        };
                        ids.push(t as u32);
                        targets.push(next as u32);
                        t = next;
                    }
                }
                Batch { input: Input::Tokens(ids), targets }
            }
        }
    }
}

impl Dataset {
    /// [`Dataset::batch`] without the input values where they are real numbers (clusters,
    /// images): the same targets, and an [`Input::Shape`] in place of the values, for a
    /// model on a virtual device (a ResNet-50 batch of 64 at 224 px would be 9.6 M values
    /// drawn for nothing). Token ids are generated as usual (an embedding reads them).
    pub fn batch_without_values(&self, seed: u64, index: u64, size: usize) -> Batch {
        let mut rng = Rng::new(seed ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let (shape, classes) = match *self {
            Dataset::Sequences { .. } => return self.batch(seed, index, size),
            Dataset::Clusters { dim, classes } => (vec![size, dim], classes),
            Dataset::Stripes { side, classes } => (vec![size, 3, side, side], classes),
        };
        let per_sample: usize = shape[1..].iter().product();
        // Per sample, `batch` draws the class, then one normal per value: skip those.
        let targets = (0..size)
            .map(|_| {
                let y = rng.below(classes as u64) as u32;
                rng.skip_normals(per_sample);
                y
            })
            .collect();
        Batch { input: Input::Shape(shape), targets }
    }
}

fn centres(seed: u64, dim: usize, classes: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed.wrapping_add(0xC3A5_C85C_97CB_3127));
    (0..dim * classes).map(|_| 2.0 * rng.normal()).collect()
}

/// Prepares batches `first, first + 1, ...` on a worker thread, `prefetch` ahead.
pub struct Loader {
    rx: Receiver<Batch>,
    worker: Option<JoinHandle<()>>,
}

impl Loader {
    /// Starts the worker.
    pub fn new(
        dataset: Dataset,
        seed: u64,
        batch_size: usize,
        first: u64,
        prefetch: usize,
    ) -> Self {
        let (tx, rx) = sync_channel(prefetch.max(1));
        let worker = std::thread::spawn(move || {
            for index in first.. {
                if tx.send(dataset.batch(seed, index, batch_size)).is_err() {
                    break;
                }
            }
        });
        Loader { rx, worker: Some(worker) }
    }

    /// The next batch.
    pub fn next_batch(&mut self) -> Batch {
        self.rx.recv().expect("the loader's worker lives as long as the loader")
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Closing the channel makes the worker's next send fail, ending it.
        let (_, closed) = sync_channel(1);
        self.rx = closed;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_depend_only_on_seed_index_and_size() {
        let d = Dataset::Stripes { side: 8, classes: 4 };
        let a = d.batch(1, 5, 3);
        let b = d.batch(1, 5, 3);
        assert_eq!(a.targets, b.targets);
        let (Input::Dense { values: va, .. }, Input::Dense { values: vb, .. }) =
            (&a.input, &b.input)
        else {
            panic!("stripes are dense");
        };
        assert_eq!(va, vb);
        assert_ne!(d.batch(1, 6, 3).targets, a.targets);
    }

    #[test]
    fn batches_without_values_have_the_same_targets_and_shape() {
        for d in
            [Dataset::Stripes { side: 8, classes: 5 }, Dataset::Clusters { dim: 7, classes: 3 }]
        {
            let (full, bare) = (d.batch(3, 9, 6), d.batch_without_values(3, 9, 6));
            assert_eq!(full.targets, bare.targets);
            let Input::Dense { shape, .. } = &full.input else { panic!("dense") };
            assert!(matches!(&bare.input, Input::Shape(s) if s == shape));
            let parts = bare.split(4);
            assert!(
                matches!(&parts[1].input, Input::Shape(s) if s[0] == 2 && s[1..] == shape[1..])
            );
        }
        let s = Dataset::Sequences { vocab: 9, seq: 4 };
        assert_eq!(s.batch(1, 2, 3).targets, s.batch_without_values(1, 2, 3).targets);
    }

    #[test]
    fn loader_yields_the_same_batches_as_direct_generation() {
        let d = Dataset::Sequences { vocab: 50, seq: 8 };
        let mut loader = Loader::new(d.clone(), 9, 4, 10, 2);
        for i in 10..14 {
            assert_eq!(loader.next_batch().targets, d.batch(9, i, 4).targets);
        }
    }
}
