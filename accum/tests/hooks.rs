//! `Chain::forward_hooked` / `backward_hooked`: where the hooks run around each layer, with
//! and without checkpointing, what a hook's error does, and that hooks change no bit.

mod common;

use std::borrow::Cow;

use common::{device, grad_bits, values};
use vram_accum::layers::{Activation, LinearConfig};
use vram_accum::{
    BoxedLayer, Chain, Error, ForwardCtx, HookPass, LayerHooks, Mode, Result, Schedule,
};
use vram_kernels::{DType, Device, Tensor};

fn chain(dev: &Device) -> Chain {
    Chain::new(vec![
        LinearConfig::new(6, 8).with_seed(1).init(dev).unwrap().into(),
        Activation::gelu(dev).into(),
        LinearConfig::new(8, 8).with_seed(2).init(dev).unwrap().into(),
        LinearConfig::new(8, 3).with_seed(3).init(dev).unwrap().into(),
    ])
}

/// Records every call; fails at `fail_at` if set.
#[derive(Default)]
struct Recorder {
    calls: Vec<String>,
    fail_at: Option<String>,
}

impl Recorder {
    fn note(&mut self, what: &str, pass: HookPass, i: usize) -> Result<()> {
        let call = format!("{what} {pass:?} {i}");
        if self.fail_at.as_deref() == Some(call.as_str()) {
            return Err(Error::InvalidArgument { what: "hook", reason: call });
        }
        self.calls.push(call);
        Ok(())
    }
}

impl LayerHooks for Recorder {
    fn before(&mut self, pass: HookPass, i: usize, _: &mut BoxedLayer) -> Result<()> {
        self.note("before", pass, i)
    }

    fn after(&mut self, pass: HookPass, i: usize, _: &mut BoxedLayer) -> Result<()> {
        self.note("after", pass, i)
    }
}

/// Forward and backward of a batch of 5 rows under `schedule` with `hooks`: the calls and
/// the gradients' bits.
fn run(schedule: &Schedule, hooks: &mut Recorder) -> Result<Vec<Option<Vec<u32>>>> {
    let dev = device();
    let mut c = chain(&dev);
    let x = Tensor::from_f32_slice(&dev, &[5, 6], &values(30, 9), DType::F32).unwrap();
    let mut ctx = ForwardCtx::new(Mode::Train, 0);
    let (y, tape) = c.forward_hooked(Cow::Owned(x), &mut ctx, schedule, hooks)?;
    let dy = Tensor::from_f32_slice(&dev, y.shape(), &values(15, 4), DType::F32).unwrap();
    drop(y);
    c.backward_hooked(tape, dy, true, hooks)?;
    Ok(grad_bits(&c))
}

fn calls(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn hooks_wrap_each_layer_and_a_recomputed_segment_before_its_recomputation() {
    let plain = Schedule::none(4).unwrap();
    let mut h = Recorder::default();
    let want = run(&plain, &mut h).unwrap();
    assert_eq!(
        h.calls,
        calls(&[
            "before Forward 0",
            "after Forward 0",
            "before Forward 1",
            "after Forward 1",
            "before Forward 2",
            "after Forward 2",
            "before Forward 3",
            "after Forward 3",
            "before Backward 3",
            "after Backward 3",
            "before Backward 2",
            "after Backward 2",
            "before Backward 1",
            "after Backward 1",
            "before Backward 0",
            "after Backward 0",
        ])
    );
    // Segments [0, 2) checkpointed, [2, 4) kept: the first segment's layers get `before`
    // ahead of their recomputation, then `after` as each one's backward ends.
    let ckpt = Schedule::every(4, 2).unwrap();
    assert!(ckpt.segments()[0].checkpointed && !ckpt.segments()[1].checkpointed);
    let mut h = Recorder::default();
    let got = run(&ckpt, &mut h).unwrap();
    assert_eq!(
        h.calls[8..],
        calls(&[
            "before Backward 3",
            "after Backward 3",
            "before Backward 2",
            "after Backward 2",
            "before Backward 0",
            "before Backward 1",
            "after Backward 1",
            "after Backward 0",
        ])
    );
    assert_eq!(got, want, "checkpointed gradients under hooks");
    // The unhooked chain gives the same bits.
    let dev = device();
    let mut c = chain(&dev);
    let x = Tensor::from_f32_slice(&dev, &[5, 6], &values(30, 9), DType::F32).unwrap();
    let (y, tape) = c.forward(&x, &mut ForwardCtx::new(Mode::Train, 0), &ckpt).unwrap();
    let dy = Tensor::from_f32_slice(&dev, y.shape(), &values(15, 4), DType::F32).unwrap();
    c.backward(tape, dy, true).unwrap();
    assert_eq!(grad_bits(&c), want);
}

#[test]
fn a_hooks_error_stops_the_chain_and_is_returned() {
    let ckpt = Schedule::every(4, 2).unwrap();
    let mut all = Recorder::default();
    run(&ckpt, &mut all).unwrap();
    for at in ["before Forward 2", "after Forward 0", "before Backward 1", "after Backward 3"] {
        let mut h = Recorder { fail_at: Some(at.into()), ..Recorder::default() };
        let e = run(&ckpt, &mut h).unwrap_err();
        assert!(e.to_string().contains(at), "{at}: {e}");
        // Nothing ran past the failing call.
        let n = all.calls.iter().position(|c| c == at).unwrap();
        assert_eq!(h.calls, all.calls[..n], "{at}");
    }
}
