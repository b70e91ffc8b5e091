//! A small replica for the trainer's tests: an MLP (linear + ReLU, linear head), one
//! parameter group per layer, trained with the mean cross-entropy.

#![allow(dead_code)]

use vram_amp::{AdamW, Optimizer, Param};
use vram_kernels::{AdamWConfig, DType, Device, Tensor, ops};
use vram_parallel::{DistError, GroupHooks, NoHooks, Pass, Replica};

/// Rows of features with one class each.
#[derive(Clone, Debug)]
pub struct Rows {
    pub x: Vec<f32>,
    pub dim: usize,
    pub targets: Vec<u32>,
}

/// A deterministic batch: `rows` rows of `dim` features, `classes` classes.
pub fn rows(seed: u64, rows: usize, dim: usize, classes: usize) -> Rows {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f32 / (1u64 << 53) as f32
    };
    let targets: Vec<u32> =
        (0..rows).map(|_| (next() * classes as f32) as u32 % classes as u32).collect();
    let x = (0..rows * dim)
        .map(|i| next() - 0.5 + 0.3 * (targets[i / dim] as f32 - (i % dim) as f32 * 0.1))
        .collect();
    Rows { x, dim, targets }
}

pub struct Mlp {
    device: Device,
    /// Per layer: weight `[out, in]`, bias `[out]`.
    layers: Vec<[Param; 2]>,
}

impl Mlp {
    /// Widths `dims` (input first, classes last), deterministic weights.
    pub fn new(device: &Device, dims: &[usize], dtype: DType) -> Mlp {
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(l, w)| {
                let (i, o) = (w[0], w[1]);
                let vals: Vec<f32> = (0..i * o)
                    .map(|k| ((k * 7 + l * 3) % 13) as f32 / 13.0 - 0.45)
                    .map(|v| v * (2.0 / i as f32).sqrt())
                    .collect();
                let bias: Vec<f32> = (0..o).map(|k| 0.01 * (k % 3) as f32).collect();
                let w = if device.is_virtual() {
                    Tensor::zeros(device, &[o, i], dtype).unwrap()
                } else {
                    Tensor::from_f32_slice(device, &[o, i], &vals, dtype).unwrap()
                };
                let b = if device.is_virtual() {
                    Tensor::zeros(device, &[o], dtype).unwrap()
                } else {
                    Tensor::from_f32_slice(device, &[o], &bias, dtype).unwrap()
                };
                [Param::new(format!("fc{l}.weight"), w), Param::new(format!("fc{l}.bias"), b)]
            })
            .collect();
        Mlp { device: device.clone(), layers }
    }

    pub fn values(&self) -> Vec<Vec<f32>> {
        self.layers.iter().flatten().map(|p| p.value.to_f32_vec().unwrap()).collect()
    }

    pub fn param_count(&self) -> usize {
        self.layers.iter().flatten().map(|p| p.value.numel()).sum()
    }

    pub fn tensor_count(&self) -> usize {
        2 * self.layers.len()
    }
}

impl Replica for Mlp {
    type Batch = Rows;
    type Tape = Vec<(Tensor, Option<Tensor>)>;

    fn device(&self) -> &Device {
        &self.device
    }

    fn group_sizes(&self) -> Vec<usize> {
        vec![2; self.layers.len()]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.layers.iter_mut().flatten().collect()
    }

    fn split(batch: &Rows, parts: usize) -> Result<Vec<Rows>, DistError> {
        let n = batch.targets.len();
        if parts == 0 || !n.is_multiple_of(parts) {
            return Err(DistError::Invalid(format!("{n} rows do not split into {parts}")));
        }
        let k = n / parts;
        Ok((0..parts)
            .map(|p| Rows {
                x: batch.x[p * k * batch.dim..(p + 1) * k * batch.dim].to_vec(),
                dim: batch.dim,
                targets: batch.targets[p * k..(p + 1) * k].to_vec(),
            })
            .collect())
    }

    fn targets(batch: &Rows) -> &[u32] {
        &batch.targets
    }

    fn forward(
        &mut self,
        batch: &Rows,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(Tensor, Self::Tape), DistError> {
        let dtype = self.layers[0][0].value.dtype();
        let rows = batch.targets.len();
        let mut x = if self.device.is_virtual() {
            Tensor::zeros(&self.device, &[rows, batch.dim], dtype)?
        } else {
            Tensor::from_f32_slice(&self.device, &[rows, batch.dim], &batch.x, dtype)?
        };
        let last = self.layers.len() - 1;
        let mut tape = Vec::new();
        for (g, [w, b]) in self.layers.iter_mut().enumerate() {
            hooks.before(Pass::Forward, g, &mut [&mut *w, &mut *b])?;
            let z = ops::linear(&x, &w.value, Some(&b.value))?;
            hooks.after(Pass::Forward, g, &mut [&mut *w, &mut *b])?;
            let (y, kept) = if g == last { (z, None) } else { (ops::relu(&z)?, Some(z)) };
            tape.push((x, kept));
            x = y;
        }
        Ok((x, tape))
    }

    fn backward(
        &mut self,
        tape: Self::Tape,
        dlogits: &Tensor,
        hooks: &mut dyn GroupHooks,
    ) -> Result<(), DistError> {
        let mut dy = dlogits.clone();
        for (g, ([w, b], (x, z))) in self.layers.iter_mut().zip(tape).enumerate().rev() {
            hooks.before(Pass::Backward, g, &mut [&mut *w, &mut *b])?;
            let dz = match z {
                Some(z) => ops::relu_backward(&z, &dy)?,
                None => dy,
            };
            let grads = ops::linear_backward(&x, &w.value, &dz, true)?;
            w.accumulate_grad(grads.dw)?;
            if let Some(db) = grads.dbias {
                b.accumulate_grad(db)?;
            }
            hooks.after(Pass::Backward, g, &mut [&mut *w, &mut *b])?;
            dy = grads.dx;
        }
        Ok(())
    }
}

/// Single-device training on the global batches: the reference.
pub fn single_device(dims: &[usize], batches: &[Rows], cfg: AdamWConfig) -> Vec<Vec<f32>> {
    let dev = Device::host(256 << 20);
    let mut m = Mlp::new(&dev, dims, DType::F32);
    let mut opt = AdamW::new(cfg);
    for b in batches {
        let mut params: Vec<Param> = Vec::new();
        let (logits, tape) = m.forward(b, &mut NoHooks).unwrap();
        let ce = ops::cross_entropy(&logits, &b.targets, None).unwrap();
        let dl = ops::cross_entropy_backward(&logits, &b.targets, None, &ce.lse, 1.0).unwrap();
        m.backward(tape, &dl, &mut NoHooks).unwrap();
        let mut all: Vec<Param> = m.layers.drain(..).flatten().collect();
        opt.step(&mut all).unwrap();
        all.iter_mut().for_each(Param::zero_grad);
        params.append(&mut all);
        let mut it = params.into_iter();
        while let (Some(w), Some(bias)) = (it.next(), it.next()) {
            m.layers.push([w, bias]);
        }
    }
    m.values()
}
