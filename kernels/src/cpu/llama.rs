//! The Llama family's own ops: RMS normalization over the last dimension (Hugging Face's
//! `LlamaRMSNorm`) and rotary position embeddings in the `rotate_half` layout (`LlamaRotary
//! Embedding` and `apply_rotary_pos_emb` of `modeling_llama.py`), with the tables of
//! `modeling_rope_utils.py` (`rope_theta`, and the `linear` and `llama3` forms of
//! `rope_scaling`).
//!
//! Layout: RMS norm's `x`, `y`, `dy`, `dx` are row-major `[n, d]`, `weight` and `dweight`
//! `[d]`, the saved `rstd` `[n]` f32. Rotary embeddings act on `[b, s, h, dh]` (tokens as
//! rows, heads inside a row: the projections' output as it comes), with `cos` and `sin`
//! tables of `[s, dh / 2]` f32: the first half of a head's features pairs with the second
//! half (HF's `rotate_half`), both halves at the same frequency (HF's `cat(freqs, freqs)`).

use super::check_len;
use super::norm::check_rows;
use crate::Element;
use crate::cpu::elementwise::{COLUMN_SUM_ROWS, PAR_THRESHOLD};
use crate::error::{Error, Result};
use rayon::prelude::*;

/// `1 / sqrt(mean(x^2) + eps)` of one row, in f32.
fn row_rstd<T: Element>(x: &[T], eps: f32) -> f32 {
    let ss = x.iter().map(|v| {
        let v = v.to_f32();
        v * v
    });
    let mean = ss.sum::<f32>() / x.len() as f32;
    1.0 / (mean + eps).sqrt()
}

/// RMS norm forward, HF's `LlamaRMSNorm`: per row `xhat = x * rstd` with
/// `rstd = 1 / sqrt(mean(x^2) + eps)` in f32, rounded to `T` (HF's `.to(input_dtype)`), then
/// `y = weight * xhat` rounded to `T`. Writes `y` and the per-row `rstd`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for `d == 0` or lengths that do not fit the layout.
pub fn rms_norm<T: Element>(
    x: &[T],
    weight: &[T],
    eps: f32,
    y: &mut [T],
    rstd: &mut [f32],
) -> Result<()> {
    const OP: &str = "cpu::rms_norm";
    let d = weight.len();
    let rows = check_rows(OP, x.len(), d)?;
    check_len(OP, "y", y.len(), x.len())?;
    check_len(OP, "rstd", rstd.len(), rows)?;
    let row = |y: &mut [T], x: &[T], r: &mut f32| {
        *r = row_rstd(x, eps);
        for ((o, &v), &w) in y.iter_mut().zip(x).zip(weight) {
            let xhat = T::from_f32(v.to_f32() * *r).to_f32();
            *o = T::from_f32(w.to_f32() * xhat);
        }
    };
    if x.len() >= PAR_THRESHOLD {
        y.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .zip(rstd.par_iter_mut())
            .for_each(|((y, x), r)| row(y, x, r));
    } else {
        y.chunks_mut(d).zip(x.chunks(d)).zip(rstd.iter_mut()).for_each(|((y, x), r)| row(y, x, r));
    }
    Ok(())
}

/// RMS norm backward from the forward input `x`, `weight`, the saved `rstd` and the upstream
/// `dy`: per row, with `g = dy * weight` and `xhat = x * rstd`,
/// `dx = rstd * (g - xhat * mean(g * xhat))`; `dweight = sum over rows of dy * xhat` (xhat
/// rounded to `T` as the forward multiplied it), in f32 in the order of every column sum
/// (`COLUMN_SUM_ROWS` rows at a time, then the chunks in order), which the GPU follows.
///
/// # Errors
///
/// As [`rms_norm`].
pub fn rms_norm_backward<T: Element>(
    x: &[T],
    weight: &[T],
    rstd: &[f32],
    dy: &[T],
    dx: &mut [T],
    dweight: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::rms_norm_backward";
    let d = weight.len();
    let rows = check_rows(OP, x.len(), d)?;
    check_len(OP, "dy", dy.len(), x.len())?;
    check_len(OP, "dx", dx.len(), x.len())?;
    check_len(OP, "dweight", dweight.len(), d)?;
    check_len(OP, "rstd", rstd.len(), rows)?;
    let row = |dx: &mut [T], x: &[T], dy: &[T], r: f32| {
        let mut s = 0.0f32;
        for ((&v, &w), &g) in x.iter().zip(weight).zip(dy) {
            s += g.to_f32() * w.to_f32() * (v.to_f32() * r);
        }
        let m = s / d as f32;
        for (((o, &v), &w), &g) in dx.iter_mut().zip(x).zip(weight).zip(dy) {
            let xhat = v.to_f32() * r;
            *o = T::from_f32(r * (g.to_f32() * w.to_f32() - xhat * m));
        }
    };
    if x.len() >= PAR_THRESHOLD {
        dx.par_chunks_mut(d)
            .zip(x.par_chunks(d).zip(dy.par_chunks(d)))
            .zip(rstd.par_iter())
            .for_each(|((dx, (x, dy)), &r)| row(dx, x, dy, r));
    } else {
        dx.chunks_mut(d)
            .zip(x.chunks(d).zip(dy.chunks(d)))
            .zip(rstd.iter())
            .for_each(|((dx, (x, dy)), &r)| row(dx, x, dy, r));
    }
    let chunk = |c: usize| {
        let mut a = vec![0.0f32; d];
        for r in c * COLUMN_SUM_ROWS..((c + 1) * COLUMN_SUM_ROWS).min(rows) {
            let (x, dy, rs) = (&x[r * d..][..d], &dy[r * d..][..d], rstd[r]);
            for ((a, &v), &g) in a.iter_mut().zip(x).zip(dy) {
                *a += g.to_f32() * T::from_f32(v.to_f32() * rs).to_f32();
            }
        }
        a
    };
    let chunks = rows.div_ceil(COLUMN_SUM_ROWS);
    let partials: Vec<Vec<f32>> = if x.len() >= PAR_THRESHOLD {
        (0..chunks).into_par_iter().map(chunk).collect()
    } else {
        (0..chunks).map(chunk).collect()
    };
    let mut dw = vec![0.0f32; d];
    for a in &partials {
        dw.iter_mut().zip(a).for_each(|(t, &v)| *t += v);
    }
    dweight.iter_mut().zip(dw).for_each(|(o, v)| *o = T::from_f32(v));
    Ok(())
}

/// Rotary embedding of `x: [b, s, h, dh]` by the tables `cos`, `sin`: `[s, dh / 2]`, in f32
/// with one rounding per output: for each head and `j < dh / 2`, with `x1 = x[j]`,
/// `x2 = x[j + dh/2]`, `c = cos[t, j]`, `s = sign * sin[t, j]` at position `t`:
/// `y[j] = x1 c - x2 s`, `y[j + dh/2] = x2 c + x1 s` (HF's `x * cos + rotate_half(x) * sin`).
/// `sign = -1` rotates back: the gradient (the rotation's transpose).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for lengths that do not fit the layout or an odd `dh`.
#[allow(clippy::too_many_arguments)]
pub fn rope<T: Element>(
    x: &[T],
    cos: &[f32],
    sin: &[f32],
    seq: usize,
    heads: usize,
    head_dim: usize,
    sign: f32,
    y: &mut [T],
) -> Result<()> {
    const OP: &str = "cpu::rope";
    if head_dim == 0 || !head_dim.is_multiple_of(2) || seq == 0 || heads == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!(
                "rotary embeddings need a positive even head width and positive seq and heads, \
                 got head width {head_dim}, seq {seq}, heads {heads}"
            ),
        });
    }
    let half = head_dim / 2;
    check_len(OP, "cos", cos.len(), seq * half)?;
    check_len(OP, "sin", sin.len(), seq * half)?;
    check_len(OP, "y", y.len(), x.len())?;
    let token = heads * head_dim;
    super::rows_of(OP, "x", x.len(), seq * token)?;
    let tok = |(i, (y, x)): (usize, (&mut [T], &[T]))| {
        let t = i % seq;
        let (c, s) = (&cos[t * half..][..half], &sin[t * half..][..half]);
        for (y, x) in y.chunks_mut(head_dim).zip(x.chunks(head_dim)) {
            let (y1, y2) = y.split_at_mut(half);
            for j in 0..half {
                let (x1, x2) = (x[j].to_f32(), x[j + half].to_f32());
                let (c, s) = (c[j], sign * s[j]);
                y1[j] = T::from_f32(x1 * c - x2 * s);
                y2[j] = T::from_f32(x2 * c + x1 * s);
            }
        }
    };
    if x.len() >= PAR_THRESHOLD {
        y.par_chunks_mut(token).zip(x.par_chunks(token)).enumerate().for_each(tok);
    } else {
        y.chunks_mut(token).zip(x.chunks(token)).enumerate().for_each(tok);
    }
    Ok(())
}

/// How the rotary frequencies are scaled: HF's `rope_scaling` (`rope_type`, or `type` in older
/// configs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// None (`rope_type` `default`): `inv_freq[i] = 1 / theta^(2i / dim)`.
    Default,
    /// `linear`: every frequency divided by `factor` (positions interpolated).
    Linear {
        /// The divisor.
        factor: f32,
    },
    /// `llama3` (Llama 3.1 / 3.2): long wavelengths divided by `factor`, short ones kept, the
    /// ones between interpolated smoothly (`_compute_llama3_parameters`).
    Llama3 {
        /// The divisor of the low frequencies (32 for Llama-3.2-1B).
        factor: f32,
        /// `low_freq_factor` (1).
        low_freq_factor: f32,
        /// `high_freq_factor` (4).
        high_freq_factor: f32,
        /// `original_max_position_embeddings` (8192).
        original_max_position_embeddings: f32,
    },
}

/// The inverse frequencies of a head of `dim` features (`dim / 2` of them) for base `theta`,
/// scaled: HF's `_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`
/// and `_compute_llama3_parameters`, in f32 as HF computes them (the base's power in f32:
/// `base ** (arange(0, dim, 2).float() / dim)`).
pub fn rope_inv_freq(dim: usize, theta: f32, scaling: RopeScaling) -> Vec<f32> {
    let base: Vec<f32> =
        (0..dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / dim as f32)).collect();
    match scaling {
        RopeScaling::Default => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    // wavelen > low_wavelen: divided by factor; < high_wavelen: kept.
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    if medium {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    }
}

/// The `cos` and `sin` tables, `[seq, dim / 2]` f32 each, of positions `0..seq`:
/// `angle[t, i] = t * inv_freq[i]` (f32, as HF's `inv_freq @ position_ids` in f32).
pub fn rope_tables(
    seq: usize,
    dim: usize,
    theta: f32,
    scaling: RopeScaling,
) -> (Vec<f32>, Vec<f32>) {
    let inv = rope_inv_freq(dim, theta, scaling);
    let mut cos = Vec::with_capacity(seq * inv.len());
    let mut sin = Vec::with_capacity(seq * inv.len());
    for t in 0..seq {
        for &f in &inv {
            let a = t as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_frequencies_follow_hugging_faces_three_bands() {
        let s = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let (base, scaled) =
            (rope_inv_freq(64, 500_000.0, RopeScaling::Default), rope_inv_freq(64, 500_000.0, s));
        assert_eq!(base.len(), 32);
        // The highest frequencies (wavelength below 8192 / 4) are kept; the lowest
        // (wavelength above 8192) divided by 32; those between lie between the two.
        assert_eq!(scaled[0], base[0]);
        assert_eq!(scaled[31], base[31] / 32.0);
        for (i, (&b, &f)) in base.iter().zip(&scaled).enumerate() {
            let wl = 2.0 * std::f32::consts::PI / b;
            if wl < 2048.0 {
                assert_eq!(f, b, "{i}");
            } else if wl > 8192.0 {
                assert_eq!(f, b / 32.0, "{i}");
            } else {
                assert!(f <= b && f >= b / 32.0, "{i}");
            }
        }
        let lin = rope_inv_freq(8, 10_000.0, RopeScaling::Linear { factor: 4.0 });
        assert_eq!(lin[1], rope_inv_freq(8, 10_000.0, RopeScaling::Default)[1] / 4.0);
    }

    #[test]
    fn rope_backward_is_the_inverse_rotation() {
        let (seq, h, dh) = (5, 3, 8);
        let (cos, sin) = rope_tables(seq, dh, 10_000.0, RopeScaling::Default);
        let x: Vec<f32> =
            (0..2 * seq * h * dh).map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0).collect();
        let mut y = vec![0.0f32; x.len()];
        rope(&x, &cos, &sin, seq, h, dh, 1.0, &mut y).unwrap();
        let mut back = vec![0.0f32; x.len()];
        rope(&y, &cos, &sin, seq, h, dh, -1.0, &mut back).unwrap();
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() < 1e-5);
        }
        // Position 0 is the identity.
        assert_eq!(&y[..h * dh], &x[..h * dh]);
    }
}
