//! Llama blocks in a chain: checkpointed backward (recomputing the blocks' forwards, with
//! the shared rotary tables and the grouped key/value heads) gives the plain backward's
//! gradients bit for bit, in f32 and under bf16 autocast.

use vram_accum::layers::{LinearConfig, LlamaBlockConfig, RmsNormConfig, RopeTables};
use vram_accum::{Chain, ForwardCtx, Layer, Mode, Param, Schedule};
use vram_kernels::ops::RopeScaling;
use vram_kernels::{DType, Device, Tensor};

fn tensor(dev: &Device, shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n as u64)
        .map(|i| (((i * 7919 + seed * 104_729) % 4001) as f32 / 2000.0) - 1.0)
        .collect();
    Tensor::from_f32_slice(dev, shape, &v, DType::F32).unwrap()
}

fn chain(dev: &Device) -> Chain {
    let (d, seq, hd) = (32, 8, 8);
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 4.0,
    };
    let tables = RopeTables::new(dev, seq, hd, 500_000.0, scaling).unwrap();
    let mut c = Chain::default();
    for i in 0..3 {
        let cfg = LlamaBlockConfig::new(d, 4, 2, 48, seq).with_qkv_bias(i == 1).with_seed(i);
        c.push(cfg.init_with_tables(dev, &tables).unwrap());
    }
    c.push(RmsNormConfig::new(d).init(dev).unwrap());
    c.push(LinearConfig::new(d, 16).with_bias(false).with_seed(9).init(dev).unwrap());
    c
}

fn grads(c: &Chain) -> Vec<Vec<u32>> {
    c.params()
        .iter()
        .map(|p: &&Param| {
            p.grad.as_ref().unwrap().to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
        })
        .collect()
}

#[test]
fn checkpointed_llama_blocks_give_the_plain_gradients_bit_for_bit() {
    let dev = Device::host(256 << 20);
    let x = tensor(&dev, &[16, 32], 3);
    for low in [None, Some(DType::BF16)] {
        let mut results = Vec::new();
        for schedule in [
            Schedule::none(5).unwrap(),
            Schedule::every(5, 2).unwrap(),
            Schedule::every(5, 1).unwrap(),
        ] {
            let mut c = chain(&dev);
            let mut ctx = ForwardCtx::new(Mode::Train, 11);
            if let Some(low) = low {
                ctx = ctx.with_autocast(low).unwrap();
            }
            let (y, tape) = c.forward(&x, &mut ctx, &schedule).unwrap();
            ctx.clear_autocast_cache();
            let dy = tensor(&dev, y.shape(), 4).to_dtype(y.dtype()).unwrap();
            let dx = c.backward(tape, dy, true).unwrap().unwrap();
            let dx: Vec<u32> = dx.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect();
            results.push((grads(&c), dx));
        }
        assert!(results[1..].iter().all(|r| *r == results[0]), "{low:?}");
    }
    // The block names its grouping.
    let block = LlamaBlockConfig::new(32, 4, 2, 48, 8).init(&dev).unwrap();
    assert_eq!(block.name(), "LlamaBlock(d=32, heads=4, kv_heads=2)");
}
