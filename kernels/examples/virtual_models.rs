//! Real-size training steps on a virtual device: what a GPU would allocate, in moments,
//! on any machine.
//!
//! - GPT-2 small: 124,439,808 parameters (12 layers, width 768, 12 heads, 50257 tokens,
//!   the LM head tied to the token embedding), sequence 1024, batch 8, dropout 0.1, f32,
//!   AdamW; once with the plain head and loss (the whole logits), once with them fused
//!   (`ops::linear_cross_entropy`, the logits in chunks of rows).
//! - ResNet-50: 25,503,912 parameters (bottleneck stages 3-4-6-3, torchvision's layout
//!   without batch norm: this example keeps to convolutions), 224 px, batch 64, f32, AdamW.
//!
//! Both are written with `vram_kernels::ops` alone (forward, backward by hand, AdamW), so
//! they run unchanged on the host, on a virtual device and on a GPU. The program first runs
//! a small configuration of each on the host and on a virtual device and checks that the
//! two allocation traces are identical, then runs the real sizes on a virtual 80 GiB
//! device (an H100's capacity and cuBLAS workspace) and prints, per model, the peak
//! allocated and reserved bytes and the time of each step.
//!
//! `cargo run --release -p vram-kernels --example virtual_models`

use std::time::Instant;
use vram_kernels::ops::{self, LayerNormOutput};
use vram_kernels::{AdamWConfig, Conv2dOptions, DType, Device, Pool2dOptions, Result, Tensor};

/// A parameter with its gradient and AdamW state (made at the first step, as PyTorch does).
struct Param {
    value: Tensor,
    grad: Option<Tensor>,
    state: Option<(Tensor, Tensor)>,
}

/// Every parameter of a model; layers refer to theirs by index.
#[derive(Default)]
struct Params(Vec<Param>);

impl Params {
    /// A new parameter of `shape`, every element `init` (values only matter on the host).
    fn add(&mut self, dev: &Device, shape: &[usize], init: f32) -> Result<usize> {
        let value = Tensor::full(dev, shape, DType::F32, init)?;
        self.0.push(Param { value, grad: None, state: None });
        Ok(self.0.len() - 1)
    }

    fn value(&self, i: usize) -> &Tensor {
        &self.0[i].value
    }

    /// Adds `g` to parameter `i`'s gradient.
    fn accumulate(&mut self, i: usize, g: Tensor) -> Result<()> {
        match &mut self.0[i].grad {
            Some(acc) => ops::add_assign(acc, &g),
            slot @ None => {
                *slot = Some(g);
                Ok(())
            }
        }
    }

    fn count(&self) -> usize {
        self.0.iter().map(|p| p.value.numel()).sum()
    }

    /// One AdamW step on every parameter with a gradient; the gradients are dropped after
    /// (`zero_grad(set_to_none=True)`).
    fn adamw(&mut self, step: u32, cfg: &AdamWConfig) -> Result<()> {
        for p in &mut self.0 {
            let Some(g) = p.grad.take() else { continue };
            if p.state.is_none() {
                let zeros = || Tensor::zeros(p.value.device(), p.value.shape(), DType::F32);
                p.state = Some((zeros()?, zeros()?));
            }
            let (m, v) = p.state.as_mut().expect("made above");
            ops::adamw_step(&mut p.value, &g, m, v, step, cfg)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// GPT-2

#[derive(Clone, Copy)]
struct GptConfig {
    vocab: usize,
    seq: usize,
    d: usize,
    heads: usize,
    layers: usize,
    batch: usize,
    dropout: f32,
    /// The tied head and its loss through `ops::linear_cross_entropy` (the logits in chunks
    /// of rows) instead of `linear` + `cross_entropy` (the whole `[tokens, vocab]` logits).
    fused_loss: bool,
}

const GPT2_SMALL: GptConfig = GptConfig {
    vocab: 50257,
    seq: 1024,
    d: 768,
    heads: 12,
    layers: 12,
    batch: 8,
    dropout: 0.1,
    fused_loss: false,
};

/// A linear layer's weight and bias.
#[derive(Clone, Copy)]
struct Linear {
    w: usize,
    b: Option<usize>,
}

impl Linear {
    fn new(p: &mut Params, dev: &Device, d_in: usize, d_out: usize, bias: bool) -> Result<Self> {
        let w = p.add(dev, &[d_out, d_in], 0.02)?;
        let b = if bias { Some(p.add(dev, &[d_out], 0.0)?) } else { None };
        Ok(Linear { w, b })
    }

    fn forward(self, p: &Params, x: &Tensor) -> Result<Tensor> {
        ops::linear(x, p.value(self.w), self.b.map(|b| p.value(b)))
    }

    fn backward(self, p: &mut Params, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let g = ops::linear_backward(x, p.value(self.w), dy, self.b.is_some())?;
        p.accumulate(self.w, g.dw)?;
        if let (Some(b), Some(db)) = (self.b, g.dbias) {
            p.accumulate(b, db)?;
        }
        Ok(g.dx)
    }
}

/// A layer norm's scale and shift.
#[derive(Clone, Copy)]
struct Norm {
    g: usize,
    b: usize,
}

impl Norm {
    fn new(p: &mut Params, dev: &Device, d: usize) -> Result<Self> {
        Ok(Norm { g: p.add(dev, &[d], 1.0)?, b: p.add(dev, &[d], 0.0)? })
    }

    fn forward(self, p: &Params, x: &Tensor) -> Result<LayerNormOutput> {
        ops::layer_norm(x, p.value(self.g), p.value(self.b), 1e-5)
    }

    fn backward(
        self,
        p: &mut Params,
        x: &Tensor,
        s: &LayerNormOutput,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let g = ops::layer_norm_backward(x, p.value(self.g), &s.mean, &s.rstd, dy)?;
        p.accumulate(self.g, g.dgamma)?;
        p.accumulate(self.b, g.dbeta)?;
        Ok(g.dx)
    }
}

/// One attention head: its query, key and value projections and its slice of the output
/// projection (`sum over heads of o_h W_o,h` is the concatenated heads times `W_o`).
struct Head {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
}

struct Block {
    ln1: Norm,
    heads: Vec<Head>,
    ln2: Norm,
    fc: Linear,
    proj: Linear,
}

struct HeadSaved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    dropped: Tensor,
    o: Tensor,
}

struct BlockSaved {
    x: Tensor,
    ln1: LayerNormOutput,
    heads: Vec<HeadSaved>,
    x2: Tensor,
    ln2: LayerNormOutput,
    h: Tensor,
    a: Tensor,
    seed: u64,
}

struct Gpt {
    cfg: GptConfig,
    params: Params,
    wte: usize,
    wpe: usize,
    blocks: Vec<Block>,
    ln_f: Norm,
}

impl Gpt {
    fn new(dev: &Device, cfg: GptConfig) -> Result<Gpt> {
        let mut p = Params::default();
        let (d, dh) = (cfg.d, cfg.d / cfg.heads);
        let wte = p.add(dev, &[cfg.vocab, d], 0.02)?;
        let wpe = p.add(dev, &[cfg.seq, d], 0.01)?;
        let mut blocks = Vec::new();
        for _ in 0..cfg.layers {
            let ln1 = Norm::new(&mut p, dev, d)?;
            let mut heads = Vec::new();
            for h in 0..cfg.heads {
                heads.push(Head {
                    q: Linear::new(&mut p, dev, d, dh, true)?,
                    k: Linear::new(&mut p, dev, d, dh, true)?,
                    v: Linear::new(&mut p, dev, d, dh, true)?,
                    o: Linear::new(&mut p, dev, dh, d, h == 0)?,
                });
            }
            let ln2 = Norm::new(&mut p, dev, d)?;
            let fc = Linear::new(&mut p, dev, d, 4 * d, true)?;
            let proj = Linear::new(&mut p, dev, 4 * d, d, true)?;
            blocks.push(Block { ln1, heads, ln2, fc, proj });
        }
        let ln_f = Norm::new(&mut p, dev, d)?;
        Ok(Gpt { cfg, params: p, wte, wpe, blocks, ln_f })
    }

    fn block_forward(&self, i: usize, x: Tensor, seed: u64) -> Result<(Tensor, BlockSaved)> {
        let (c, p, blk) = (self.cfg, &self.params, &self.blocks[i]);
        let (n, dh) = (c.batch * c.seq, c.d / c.heads);
        let ln1 = blk.ln1.forward(p, &x)?;
        let mut heads = Vec::new();
        let mut attn: Option<Tensor> = None;
        for (h, head) in blk.heads.iter().enumerate() {
            let q = head.q.forward(p, &ln1.y)?.reshape(&[c.batch, c.seq, dh])?;
            let k = head.k.forward(p, &ln1.y)?.reshape(&[c.batch, c.seq, dh])?;
            let v = head.v.forward(p, &ln1.y)?.reshape(&[c.batch, c.seq, dh])?;
            let scores = ops::scale(&ops::matmul(&q, &k, false, true)?, 1.0 / (dh as f32).sqrt())?;
            let probs = ops::causal_softmax(&scores)?;
            drop(scores);
            let dropped = ops::dropout(&probs, c.dropout, seed, h as u64 * (1 << 40))?;
            let o = ops::matmul(&dropped, &v, false, false)?.reshape(&[n, dh])?;
            let out = head.o.forward(p, &o)?;
            match &mut attn {
                Some(sum) => ops::add_assign(sum, &out)?,
                None => attn = Some(out),
            }
            heads.push(HeadSaved { q, k, v, probs, dropped, o });
        }
        let attn = ops::dropout(&attn.expect("a block has heads"), c.dropout, seed + 1, 0)?;
        let x2 = ops::add(&x, &attn)?;
        drop(attn);
        let ln2 = blk.ln2.forward(p, &x2)?;
        let h = blk.fc.forward(p, &ln2.y)?;
        let a = ops::gelu(&h)?;
        let m = ops::dropout(&blk.proj.forward(p, &a)?, c.dropout, seed + 2, 0)?;
        let y = ops::add(&x2, &m)?;
        Ok((y, BlockSaved { x, ln1, heads, x2, ln2, h, a, seed }))
    }

    fn block_backward(&mut self, i: usize, s: BlockSaved, dy: Tensor) -> Result<Tensor> {
        let c = self.cfg;
        let (n, dh) = (c.batch * c.seq, c.d / c.heads);
        let (ln1, ln2, fc, proj) =
            (self.blocks[i].ln1, self.blocks[i].ln2, self.blocks[i].fc, self.blocks[i].proj);
        let p = &mut self.params;
        let dm = ops::dropout_backward(&dy, c.dropout, s.seed + 2, 0)?;
        let da = proj.backward(p, &s.a, &dm)?;
        drop((dm, s.a));
        let dh_ = ops::gelu_backward(&s.h, &da)?;
        drop((da, s.h));
        let dln2 = fc.backward(p, &s.ln2.y, &dh_)?;
        drop(dh_);
        let mut dx2 = ln2.backward(p, &s.x2, &s.ln2, &dln2)?;
        ops::add_assign(&mut dx2, &dy)?;
        drop((dy, dln2, s.ln2, s.x2));
        let dattn = ops::dropout_backward(&dx2, c.dropout, s.seed + 1, 0)?;
        let mut dln1: Option<Tensor> = None;
        for (h, hs) in s.heads.into_iter().enumerate() {
            let head = &self.blocks[i].heads[h];
            let (q, k, v, o) = (head.q, head.k, head.v, head.o);
            let do_ = o.backward(p, &hs.o, &dattn)?.reshape(&[c.batch, c.seq, dh])?;
            let (ddropped, dv) = ops::matmul_backward(&hs.dropped, &hs.v, &do_, false, false)?;
            drop(do_);
            let dprobs = ops::dropout_backward(&ddropped, c.dropout, s.seed, h as u64 * (1 << 40))?;
            drop(ddropped);
            let dscores = ops::scale(
                &ops::causal_softmax_backward(&hs.probs, &dprobs)?,
                1.0 / (dh as f32).sqrt(),
            )?;
            drop((dprobs, hs.probs, hs.dropped));
            let (dq, dk) = ops::matmul_backward(&hs.q, &hs.k, &dscores, false, true)?;
            drop(dscores);
            for (lin, g) in [(q, dq), (k, dk), (v, dv)] {
                let dx = lin.backward(p, &s.ln1.y, &g.reshape(&[n, dh])?)?;
                match &mut dln1 {
                    Some(sum) => ops::add_assign(sum, &dx)?,
                    None => dln1 = Some(dx),
                }
            }
        }
        drop(dattn);
        let mut dx = ln1.backward(p, &s.x, &s.ln1, &dln1.expect("a block has heads"))?;
        ops::add_assign(&mut dx, &dx2)?;
        Ok(dx)
    }

    /// Forward, loss, backward and AdamW on one batch of token ids.
    fn step(&mut self, ids: &[u32], targets: &[u32], step: u32) -> Result<f32> {
        let c = self.cfg;
        let positions: Vec<u32> = (0..ids.len()).map(|i| (i % c.seq) as u32).collect();
        let tok = ops::embedding(self.params.value(self.wte), ids)?;
        let pos = ops::embedding(self.params.value(self.wpe), &positions)?;
        let mut x = ops::dropout(&ops::add(&tok, &pos)?, c.dropout, 7, 0)?;
        drop((tok, pos));
        let mut saved = Vec::new();
        for i in 0..c.layers {
            let (y, s) = self.block_forward(i, x, 100 + 10 * i as u64)?;
            saved.push(s);
            x = y;
        }
        let lnf = self.ln_f.forward(&self.params, &x)?;
        let (loss, dlnf) = if c.fused_loss {
            let wte = self.params.value(self.wte);
            let params = ops::LinearCrossEntropyParams::default();
            let lce = ops::linear_cross_entropy(&lnf.y, wte, targets, &params)?;
            self.params.accumulate(self.wte, lce.grad_weight)?;
            (lce.loss, lce.grad_hidden)
        } else {
            let logits = ops::linear(&lnf.y, self.params.value(self.wte), None)?;
            let ce = ops::cross_entropy(&logits, targets, None)?;
            let dlogits = ops::cross_entropy_backward(&logits, targets, None, &ce.lse, 1.0)?;
            drop((logits, ce.lse));
            let head = Linear { w: self.wte, b: None };
            (ce.loss, head.backward(&mut self.params, &lnf.y, &dlogits)?)
        };
        let mut dx = self.ln_f.backward(&mut self.params, &x, &lnf, &dlnf)?;
        drop((dlnf, lnf, x));
        for i in (0..c.layers).rev() {
            let s = saved.pop().expect("one per block");
            dx = self.block_backward(i, s, dx)?;
        }
        let dx = ops::dropout_backward(&dx, c.dropout, 7, 0)?;
        let dwte = ops::embedding_backward(ids, &dx, c.vocab)?;
        self.params.accumulate(self.wte, dwte)?;
        let dwpe = ops::embedding_backward(&positions, &dx, c.seq)?;
        self.params.accumulate(self.wpe, dwpe)?;
        drop(dx);
        self.params.adamw(step, &AdamWConfig { lr: 6e-4, ..AdamWConfig::default() })?;
        Ok(loss)
    }

    fn batch(&self) -> (Vec<u32>, Vec<u32>) {
        let n = self.cfg.batch * self.cfg.seq;
        let ids: Vec<u32> = (0..n).map(|i| (i * 7919 % self.cfg.vocab) as u32).collect();
        let targets = ids.iter().map(|&t| (t + 1) % self.cfg.vocab as u32).collect();
        (ids, targets)
    }
}

// ---------------------------------------------------------------------------------------
// ResNet-50

#[derive(Clone, Copy)]
struct ResNetConfig {
    side: usize,
    batch: usize,
    /// Bottleneck blocks per stage.
    blocks: [usize; 4],
    /// Channels of the first stage's bottleneck (doubled per stage; blocks output 4x).
    width: usize,
    classes: usize,
}

const RESNET50: ResNetConfig =
    ResNetConfig { side: 224, batch: 64, blocks: [3, 4, 6, 3], width: 64, classes: 1000 };

/// A bias-free convolution.
#[derive(Clone, Copy)]
struct Conv {
    w: usize,
    opts: Conv2dOptions,
}

impl Conv {
    fn new(
        p: &mut Params,
        dev: &Device,
        c_in: usize,
        c_out: usize,
        k: usize,
        stride: usize,
    ) -> Result<Self> {
        let w = p.add(dev, &[c_out, c_in, k, k], 0.02)?;
        let opts = Conv2dOptions::default().stride((stride, stride)).padding((k / 2, k / 2));
        Ok(Conv { w, opts })
    }

    fn forward(self, p: &Params, x: &Tensor) -> Result<Tensor> {
        ops::conv2d(x, p.value(self.w), None, &self.opts)
    }

    fn backward(self, p: &mut Params, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let g = ops::conv2d_backward(x, p.value(self.w), dy, &self.opts, false)?;
        p.accumulate(self.w, g.dweight)?;
        Ok(g.dx)
    }
}

struct Bottleneck {
    c1: Conv,
    c2: Conv,
    c3: Conv,
    shortcut: Option<Conv>,
}

/// What a bottleneck keeps for its backward: each convolution's input and the
/// pre-activations of the ReLUs.
struct BottleneckSaved {
    x: Tensor,
    z1: Tensor,
    a1: Tensor,
    z2: Tensor,
    a2: Tensor,
    sum: Tensor,
}

struct ResNet {
    params: Params,
    stem: Conv,
    pool: Pool2dOptions,
    blocks: Vec<Bottleneck>,
    fc: Linear,
    cfg: ResNetConfig,
}

impl ResNet {
    fn new(dev: &Device, cfg: ResNetConfig) -> Result<ResNet> {
        let mut p = Params::default();
        let stem = Conv::new(&mut p, dev, 3, cfg.width, 7, 2)?;
        let mut blocks = Vec::new();
        let mut c_in = cfg.width;
        for (stage, &n) in cfg.blocks.iter().enumerate() {
            let mid = cfg.width << stage;
            for b in 0..n {
                let stride = if b == 0 && stage > 0 { 2 } else { 1 };
                let shortcut = if b == 0 {
                    Some(Conv::new(&mut p, dev, c_in, 4 * mid, 1, stride)?)
                } else {
                    None
                };
                blocks.push(Bottleneck {
                    c1: Conv::new(&mut p, dev, c_in, mid, 1, 1)?,
                    c2: Conv::new(&mut p, dev, mid, mid, 3, stride)?,
                    c3: Conv::new(&mut p, dev, mid, 4 * mid, 1, 1)?,
                    shortcut,
                });
                c_in = 4 * mid;
            }
        }
        let fc = Linear::new(&mut p, dev, c_in, cfg.classes, true)?;
        let pool = Pool2dOptions::new((3, 3), (2, 2)).padding((1, 1));
        Ok(ResNet { params: p, stem, pool, blocks, fc, cfg })
    }

    fn step(&mut self, x: &Tensor, targets: &[u32], step: u32) -> Result<f32> {
        let p = &self.params;
        let z0 = self.stem.forward(p, x)?;
        let a0 = ops::relu(&z0)?;
        let (mut h, argmax) = ops::max_pool2d(&a0, &self.pool)?;
        let mut saved = Vec::new();
        for b in &self.blocks {
            let z1 = b.c1.forward(p, &h)?;
            let a1 = ops::relu(&z1)?;
            let z2 = b.c2.forward(p, &a1)?;
            let a2 = ops::relu(&z2)?;
            let z3 = b.c3.forward(p, &a2)?;
            let short = match b.shortcut {
                Some(s) => s.forward(p, &h)?,
                None => h.clone(),
            };
            let sum = ops::add(&z3, &short)?;
            drop((z3, short));
            let y = ops::relu(&sum)?;
            saved.push(BottleneckSaved { x: h, z1, a1, z2, a2, sum });
            h = y;
        }
        let pooled = ops::global_avg_pool(&h)?;
        let logits = self.fc.forward(p, &pooled)?;
        let ce = ops::cross_entropy(&logits, targets, None)?;
        let dlogits = ops::cross_entropy_backward(&logits, targets, None, &ce.lse, 1.0)?;
        drop((logits, ce.lse));
        let p = &mut self.params;
        let dpooled = self.fc.backward(p, &pooled, &dlogits)?;
        let mut dh = ops::global_avg_pool_backward(&dpooled, h.shape())?;
        drop((dlogits, dpooled, pooled, h));
        for b in self.blocks.iter().rev() {
            let s = saved.pop().expect("one per block");
            let dsum = ops::relu_backward(&s.sum, &dh)?;
            drop((dh, s.sum));
            let dshort = match b.shortcut {
                Some(c) => c.backward(p, &s.x, &dsum)?,
                None => dsum.clone(),
            };
            let da2 = b.c3.backward(p, &s.a2, &dsum)?;
            drop((dsum, s.a2));
            let dz2 = ops::relu_backward(&s.z2, &da2)?;
            drop((da2, s.z2));
            let da1 = b.c2.backward(p, &s.a1, &dz2)?;
            drop((dz2, s.a1));
            let dz1 = ops::relu_backward(&s.z1, &da1)?;
            drop((da1, s.z1));
            let mut dx = b.c1.backward(p, &s.x, &dz1)?;
            ops::add_assign(&mut dx, &dshort)?;
            dh = dx;
        }
        let da0 = ops::max_pool2d_backward(&dh, &argmax, a0.shape(), &self.pool)?;
        drop((dh, argmax, a0));
        let dz0 = ops::relu_backward(&z0, &da0)?;
        drop((da0, z0));
        // The input needs no gradient: the weight's alone.
        let g = ops::conv2d_backward_weight(x, p.value(self.stem.w), &dz0, &self.stem.opts, false)?;
        p.accumulate(self.stem.w, g.dweight)?;
        drop(dz0);
        p.adamw(step, &AdamWConfig::default())?;
        Ok(ce.loss)
    }

    fn batch(&self, dev: &Device) -> Result<(Tensor, Vec<u32>)> {
        let c = self.cfg;
        let x = Tensor::full(dev, &[c.batch, 3, c.side, c.side], DType::F32, 0.5)?;
        let targets = (0..c.batch).map(|i| (i * 37 % c.classes) as u32).collect();
        Ok((x, targets))
    }
}

// ---------------------------------------------------------------------------------------

/// What a run measured.
struct Run {
    params: usize,
    peak_allocated: u64,
    peak_reserved: u64,
    steps: Vec<f64>,
}

/// Runs `steps` training steps (`step(1)`, `step(2)`, ...) of a model of `params` parameters
/// built on `dev`, timing each.
fn timed(
    dev: &Device,
    params: usize,
    steps: u32,
    mut step: impl FnMut(u32) -> Result<f32>,
) -> Result<Run> {
    let mut times = Vec::new();
    for s in 1..=steps {
        let t = Instant::now();
        step(s)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(Run {
        params,
        peak_allocated: dev.max_memory_allocated(),
        peak_reserved: dev.max_memory_reserved(),
        steps: times,
    })
}

/// Builds the model on `dev` and runs `steps` training steps.
fn run_gpt(dev: &Device, cfg: GptConfig, steps: u32) -> Result<Run> {
    let mut model = Gpt::new(dev, cfg)?;
    let (ids, targets) = model.batch();
    let params = model.params.count();
    timed(dev, params, steps, |s| model.step(&ids, &targets, s))
}

fn run_resnet(dev: &Device, cfg: ResNetConfig, steps: u32) -> Result<Run> {
    let mut model = ResNet::new(dev, cfg)?;
    let (x, targets) = model.batch(dev)?;
    let params = model.params.count();
    timed(dev, params, steps, |s| model.step(&x, &targets, s))
}

/// The allocator trace of `run` on `dev`, without addresses and times.
fn trace_of(
    dev: &Device,
    run: impl FnOnce(&Device) -> Result<Run>,
) -> Result<Vec<(vram_kernels::TraceAction, usize, usize)>> {
    dev.record_history(Some(1 << 24));
    run(dev)?;
    Ok(dev.trace().iter().map(|e| (e.action, e.size, e.requested)).collect())
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn main() -> Result<()> {
    // The same program on the host and on a virtual device allocates the same way.
    let small_gpt = GptConfig {
        vocab: 97,
        seq: 16,
        d: 32,
        heads: 4,
        layers: 2,
        batch: 2,
        dropout: 0.1,
        fused_loss: false,
    };
    let small_fused = GptConfig { fused_loss: true, ..small_gpt };
    let small_resnet =
        ResNetConfig { side: 32, batch: 2, blocks: [1, 1, 1, 1], width: 4, classes: 10 };
    for (name, model) in [
        ("gpt-2 (small config)", Some(small_gpt)),
        ("gpt-2 (small config, fused LM loss)", Some(small_fused)),
        ("resnet-50 (small config)", None),
    ] {
        let (host, virt) = (Device::host(8 << 30), Device::virtual_device(8 << 30));
        host.set_blas_workspace_size(virt.blas_workspace_size());
        let run = |d: &Device| match model {
            Some(gpt) => run_gpt(d, gpt, 2),
            None => run_resnet(d, small_resnet, 2),
        };
        let (h, v) = (trace_of(&host, run)?, trace_of(&virt, run)?);
        assert_eq!(h, v, "{name}: the virtual device's trace differs from the host's");
        println!("{name}: host and virtual traces identical ({} entries)", h.len());
    }
    println!();
    println!("virtual device: 80 GiB, cuBLAS workspace 32 MiB (sm_90), default allocator settings");
    println!("| model | parameters | peak allocated | peak reserved | step 1 | step 2 | step 3 |");
    println!("|---|---|---|---|---|---|---|");
    let mut totals = Vec::new();
    let gpt2_fused = GptConfig { fused_loss: true, ..GPT2_SMALL };
    for (name, model) in [
        ("GPT-2 small, seq 1024, batch 8, AdamW, f32", Some(GPT2_SMALL)),
        ("GPT-2 small, fused LM head + loss (`linear_cross_entropy`)", Some(gpt2_fused)),
        ("ResNet-50, 224 px, batch 64, AdamW, f32", None),
    ] {
        let dev = Device::virtual_device(80 << 30);
        let total = Instant::now();
        let r = match model {
            Some(gpt) => run_gpt(&dev, gpt, 3)?,
            None => run_resnet(&dev, RESNET50, 3)?,
        };
        let ms: Vec<String> = r.steps.iter().map(|s| format!("{:.0} ms", s * 1e3)).collect();
        println!(
            "| {name} | {} | {} ({} B) | {} ({} B) | {} |",
            r.params,
            gib(r.peak_allocated),
            r.peak_allocated,
            gib(r.peak_reserved),
            r.peak_reserved,
            ms.join(" | "),
        );
        totals.push(format!("{name}: {:.2} s with model creation", total.elapsed().as_secs_f64()));
    }
    println!();
    for t in totals {
        println!("{t}");
    }
    Ok(())
}
