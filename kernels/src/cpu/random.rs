//! Counter-based randomness: Philox4x32-10 and dropout built on it.
//!
//! Philox is stateless: a (key, counter) pair maps to four u32, so any element's random
//! number can be computed independently, on the CPU or in a CUDA thread, and recomputed
//! later (dropout's backward, activation checkpointing) without storing a mask.
//!
//! The mapping from a seed and a linear element index to a random word, shared with the CUDA
//! kernels: element `index` uses word `index % 4` of
//! `philox4x32_10([lo(index / 4), hi(index / 4), 0, 0], [lo(seed), hi(seed)])`.

use super::check_len;
use crate::Element;
use crate::cpu::elementwise::{PAR_CHUNK, PAR_THRESHOLD};
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Philox multipliers and Weyl key increments (Random123, curand).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// Philox4x32 with 10 rounds on a raw 128-bit counter and 64-bit key, bit-identical to
/// Random123's `philox4x32_R(10, ...)` and curand's Philox4_32_10 block function.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Four random words for `(seed, counter)`: the seed is the key, the counter fills the low
/// 64 bits of Philox's 128-bit counter (low word first).
pub fn philox(seed: u64, counter: u64) -> [u32; 4] {
    philox4x32_10(
        [counter as u32, (counter >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// A uniform f32 in `[0, 1)` from the top 24 bits of `x` (every value is exact, a multiple
/// of 2^-24).
pub fn uniform_f32(x: u32) -> f32 {
    (x >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// The uniform f32 of element `index` of the stream `seed` (see the module docs).
pub fn uniform_at(seed: u64, index: u64) -> f32 {
    uniform_f32(philox(seed, index / 4)[(index % 4) as usize])
}

/// Calls `f(i, u)` for `i in 0..len` with `u` the uniform of element `offset + i`, computing
/// one Philox block per four consecutive indices.
pub(crate) fn for_each_uniform(seed: u64, offset: u64, len: usize, mut f: impl FnMut(usize, f32)) {
    let mut block = u64::MAX;
    let mut words = [0u32; 4];
    for i in 0..len {
        let index = offset.wrapping_add(i as u64);
        if index / 4 != block {
            block = index / 4;
            words = philox(seed, block);
        }
        f(i, uniform_f32(words[(index % 4) as usize]));
    }
}

/// Whether dropout keeps element `index` of stream `seed` at drop probability `p`: kept iff
/// its uniform is `>= p`, so `p == 0` keeps everything.
pub fn dropout_keep(seed: u64, index: u64, p: f32) -> bool {
    uniform_at(seed, index) >= p
}

/// Writes the keep mask of elements `offset .. offset + mask.len()` of stream `seed`.
pub fn dropout_mask(mask: &mut [bool], p: f32, seed: u64, offset: u64) {
    for_each_uniform(seed, offset, mask.len(), |i, u| mask[i] = u >= p);
}

/// `out[i] = keep(offset + i) ? inp[i] / (1 - p) : 0`, in parallel chunks for large inputs.
fn apply_mask<T: Element>(
    op: &'static str,
    inp: &[T],
    out: &mut [T],
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<()> {
    check_probability(op, p)?;
    check_len(op, "the output", out.len(), inp.len())?;
    let scale = 1.0 / (1.0 - p);
    masked_map(out, p, seed, offset, |i, keep| {
        if keep { T::from_f32(inp[i].to_f32() * scale) } else { T::from_f32(0.0) }
    });
    Ok(())
}

/// `out[i] = f(i, keep(offset + i))` for `i` in `0..out.len()`, in parallel chunks for
/// large outputs.
fn masked_map<O: Element>(
    out: &mut [O],
    p: f32,
    seed: u64,
    offset: u64,
    f: impl Fn(usize, bool) -> O + Sync,
) {
    let run = |out: &mut [O], start: usize| {
        if p == 0.0 {
            // Every element is kept (a uniform is never below 0): no draw, as the CUDA kernels
            // and PyTorch skip it.
            out.iter_mut().enumerate().for_each(|(i, o)| *o = f(start + i, true));
            return;
        }
        for_each_uniform(seed, offset.wrapping_add(start as u64), out.len(), |i, u| {
            out[i] = f(start + i, u >= p);
        });
    };
    if out.len() >= PAR_THRESHOLD {
        out.par_chunks_mut(PAR_CHUNK).enumerate().for_each(|(c, o)| run(o, c * PAR_CHUNK));
    } else {
        run(out, 0);
    }
}

/// Dropout on a residual branch and the residual add in one pass:
/// `out[i] = R(residual[i] + B(dropout(branch)[i]))`, the branch's element kept as
/// [`dropout`] keeps it with the same `(p, seed, offset)`, scaled and rounded to the
/// branch's dtype `B` as [`dropout`] stores it, then added in f32 and rounded to the
/// residual's dtype `R`: bit for bit [`dropout`], a cast of its result to `R` and `add`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] unless `0 <= p < 1` and the lengths agree.
pub fn dropout_add<R: Element, B: Element>(
    residual: &[R],
    branch: &[B],
    out: &mut [R],
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<()> {
    const OP: &str = "cpu::dropout_add";
    check_probability(OP, p)?;
    check_len(OP, "the branch", branch.len(), residual.len())?;
    check_len(OP, "the output", out.len(), residual.len())?;
    let scale = 1.0 / (1.0 - p);
    masked_map(out, p, seed, offset, |i, keep| {
        let dropped = if keep { B::from_f32(branch[i].to_f32() * scale) } else { B::from_f32(0.0) };
        R::from_f32(residual[i].to_f32() + dropped.to_f32())
    });
    Ok(())
}

/// The branch's gradient of [`dropout_add`] from the sum's `dy`: `dy` rounded to the
/// branch's dtype `B`, then masked and scaled as [`dropout_backward`] does (bit for bit a
/// cast then [`dropout_backward`]). The residual's gradient is `dy` itself.
///
/// # Errors
///
/// As [`dropout_add`].
pub fn dropout_add_backward<R: Element, B: Element>(
    dy: &[R],
    dbranch: &mut [B],
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<()> {
    const OP: &str = "cpu::dropout_add_backward";
    check_probability(OP, p)?;
    check_len(OP, "the output", dbranch.len(), dy.len())?;
    let scale = 1.0 / (1.0 - p);
    masked_map(dbranch, p, seed, offset, |i, keep| {
        if keep {
            B::from_f32(B::from_f32(dy[i].to_f32()).to_f32() * scale)
        } else {
            B::from_f32(0.0)
        }
    });
    Ok(())
}

/// Checks that `p` is a drop probability: `0 <= p < 1`.
pub(crate) fn check_probability(op: &'static str, p: f32) -> Result<()> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(Error::InvalidArgument { op, reason: format!("drop probability {p} is not in [0, 1)") })
    }
}

/// Dropout forward: element `i` is kept iff [`dropout_keep`]`(seed, offset + i, p)`, and
/// kept values are scaled by `1 / (1 - p)`. `p` must be in `[0, 1)`; `p == 0` is the
/// identity. The mask depends only on `(seed, offset + i)`, so callers give each dropout
/// call a disjoint index range (advance `offset` by the element count).
///
/// # Errors
///
/// [`Error::InvalidArgument`] unless `0 <= p < 1` and the lengths agree.
pub fn dropout<T: Element>(x: &[T], y: &mut [T], p: f32, seed: u64, offset: u64) -> Result<()> {
    apply_mask("cpu::dropout", x, y, p, seed, offset)
}

/// Dropout backward: `dx = dy` masked and scaled exactly as the forward with the same
/// `(p, seed, offset)` masked and scaled `x`; the mask is recomputed, not stored.
///
/// # Errors
///
/// As [`dropout`].
pub fn dropout_backward<T: Element>(
    dy: &[T],
    dx: &mut [T],
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<()> {
    apply_mask("cpu::dropout_backward", dy, dx, p, seed, offset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use proptest::prelude::*;

    #[test]
    fn philox_matches_random123_known_answers() {
        // Random123 kat_vectors: counter, key -> output.
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn seed_and_counter_fill_key_and_counter_low_word_first() {
        let seed = 0x299f_31d0_a409_3822;
        let counter = 0x85a3_08d3_243f_6a88;
        assert_eq!(
            philox(seed, counter),
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0, 0], [0xa409_3822, 0x299f_31d0])
        );
    }

    #[test]
    fn uniform_covers_zero_to_just_below_one() {
        assert_eq!(uniform_f32(0), 0.0);
        assert_eq!(uniform_f32(u32::MAX), 1.0 - 1.0 / 16_777_216.0);
        assert_eq!(uniform_f32(1 << 31), 0.5);
    }

    #[test]
    fn dropout_kept_fraction_is_close_to_one_minus_p() {
        let n = 100_000;
        for p in [0.1f32, 0.5, 0.9] {
            let mut mask = vec![false; n];
            dropout_mask(&mut mask, p, 1234, 0);
            let kept = mask.iter().filter(|&&k| k).count() as f64 / n as f64;
            // Binomial standard deviation is at most 0.0016 here; allow about 5 sigma.
            assert!((kept - f64::from(1.0 - p)).abs() < 8e-3, "p {p}: kept {kept}");
        }
    }

    #[test]
    fn dropout_with_zero_probability_is_the_identity() {
        let x: Vec<bf16> = (0..100).map(|i| bf16::from_f32(i as f32 - 50.5)).collect();
        let mut y = vec![bf16::ZERO; x.len()];
        dropout(&x, &mut y, 0.0, 9, 77).unwrap();
        assert_eq!(x, y);
    }

    #[test]
    fn parallel_dropout_uses_the_same_mask_as_the_element_definition() {
        let n = PAR_THRESHOLD + 5;
        let x = vec![1.0f32; n];
        let mut y = vec![0.0f32; n];
        dropout(&x, &mut y, 0.25, 42, 3).unwrap();
        assert!(
            y.iter().enumerate().all(|(i, &v)| (v != 0.0) == dropout_keep(42, 3 + i as u64, 0.25))
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        // Element i's keep decision depends only on (seed, offset + i): a recomputation with
        // the same (seed, offset) gives the same output, a window shifted by k reads the same
        // decisions k elements later, and the backward masks with the forward's mask.
        #[test]
        fn same_seed_and_offset_reproduce_the_mask(
            seed in any::<u64>(),
            offset in any::<u64>(),
            shift in 1usize..9,
            p in 0.05f32..0.95,
            x in prop::collection::vec(0.5f32..2.0, 1..200),
        ) {
            let n = x.len();
            let mut y1 = vec![0.0f32; n];
            let mut y2 = vec![0.0f32; n];
            dropout(&x, &mut y1, p, seed, offset).unwrap();
            dropout(&x, &mut y2, p, seed, offset).unwrap();
            prop_assert_eq!(&y1, &y2);
            let mut mask = vec![false; n + shift];
            dropout_mask(&mut mask, p, seed, offset);
            let mut shifted = vec![false; n];
            dropout_mask(&mut shifted, p, seed, offset.wrapping_add(shift as u64));
            prop_assert_eq!(&mask[shift..], &shifted[..]);
            let mut dx = vec![0.0f32; n];
            dropout_backward(&x, &mut dx, p, seed, offset).unwrap();
            prop_assert_eq!(&dx, &y1);
            for i in 0..n {
                let want = if mask[i] { x[i] / (1.0 - p) } else { 0.0 };
                prop_assert!((y1[i] - want).abs() <= 1e-6 * want.abs(), "{} vs {}", y1[i], want);
            }
        }

        // A different offset (a disjoint index range) gives a different mask.
        #[test]
        fn different_offset_gives_a_different_mask(seed in any::<u64>(), offset in 0u64..1 << 40) {
            let (mut a, mut b) = (vec![false; 256], vec![false; 256]);
            dropout_mask(&mut a, 0.5, seed, offset);
            dropout_mask(&mut b, 0.5, seed, offset + 256);
            prop_assert_ne!(a, b);
        }
    }
}
