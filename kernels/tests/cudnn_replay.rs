//! A virtual device replaying a GPU's record of cuDNN's choices allocates what that GPU's
//! cuDNN path allocates: each convolution's outputs, then its call's workspace at the
//! recorded size, freed after; no own-kernel workspace; channels_last tensors without
//! permutes; batch norm through cuDNN where PyTorch's rule says. On a GPU with cuDNN, the
//! record of a run replayed on a virtual device gives that run's trace, entry for entry
//! (prints `skipped: no CUDA device` here).

use std::io::Write as _;
use vram_kernels::cudnn_choices::{BnChoice, BnPass, ConvChoice, ConvKey, ConvPass, CudnnChoices};
use vram_kernels::{
    Conv2dOptions, ConvBackend, ConvLayout, ConvPath, DType, Device, Tensor, TraceAction, ops,
};

/// One allocator action without its address: what must agree across devices.
type Entry = (TraceAction, usize);

/// The allocations and frees traced since entry `from` (the trace is turned on first).
fn entries(d: &Device, from: usize) -> Vec<Entry> {
    let keep = |a: &TraceAction| matches!(a, TraceAction::Alloc | TraceAction::FreeRequested);
    let trace = d.trace().into_iter().skip(from);
    trace.filter(|e| keep(&e.action)).map(|e| (e.action, e.requested)).collect()
}

/// Turns the trace on; the index its next entry will have.
fn start(d: &Device) -> usize {
    d.record_history(Some(1 << 16));
    d.trace().len()
}

const X: [usize; 4] = [8, 16, 32, 32];
const W: [usize; 4] = [32, 16, 3, 3];

fn choice(pass: ConvPass, dtype: DType, layout: ConvLayout, workspace: usize) -> ConvChoice {
    ConvChoice {
        pass,
        key: ConvKey {
            x: X,
            w: W,
            padding: (1, 1),
            stride: (1, 1),
            dilation: (1, 1),
            groups: 1,
            dtype,
            layout,
            allow_tf32: true,
        },
        algo: "TEST".into(),
        workspace,
        search_workspace: None,
    }
}

/// A record with the three directions of the test convolution in `dtype` and `layout`.
fn record(dtype: DType, layout: ConvLayout) -> CudnnChoices {
    CudnnChoices {
        device: "a test GPU".into(),
        version: 91400,
        convolutions: vec![
            choice(ConvPass::Forward, dtype, layout, 3 << 20),
            choice(ConvPass::BackwardData, dtype, layout, 0),
            choice(ConvPass::BackwardFilter, dtype, layout, 5 << 20),
        ],
        batch_norms: Vec::new(),
    }
}

fn opts() -> Conv2dOptions {
    Conv2dOptions::default().padding((1, 1))
}

/// A forward and a backward of the test convolution (channels_last when `nhwc`), traced.
fn conv_trace(d: &Device, dtype: DType, nhwc: bool) -> Vec<Entry> {
    let (xs, ws, ys) = if nhwc {
        ([8, 32, 32, 16], [32, 3, 3, 16], [8, 32, 32, 32])
    } else {
        (X, W, [8, 32, 32, 32])
    };
    let x = Tensor::zeros(d, &xs, dtype).unwrap();
    let w = Tensor::zeros(d, &ws, dtype).unwrap();
    let dy = Tensor::zeros(d, &ys, dtype).unwrap();
    let from = start(d);
    let (y, g) = if nhwc {
        let y = ops::conv2d_nhwc(&x, &w, None, &opts()).unwrap();
        (y, ops::conv2d_backward_nhwc(&x, &w, &dy, &opts(), false).unwrap())
    } else {
        let y = ops::conv2d(&x, &w, None, &opts()).unwrap();
        (y, ops::conv2d_backward(&x, &w, &dy, &opts(), false).unwrap())
    };
    let e = entries(d, from);
    drop((y, g));
    e
}

/// What [`conv_trace`] gives on a device replaying [`record`] in `dtype` (either layout):
/// the output, the forward's 3 MiB workspace, the two gradients and the weight gradient's
/// 5 MiB workspace (backward data's recorded workspace is 0: no allocation).
fn recorded_trace(dtype: DType) -> Vec<Entry> {
    let size = |dims: [usize; 4]| dims.iter().product::<usize>() * dtype.size_in_bytes();
    let (o, x, w) = (size([8, 32, 32, 32]), size(X), size(W));
    use TraceAction::{Alloc, FreeRequested as Free};
    vec![
        (Alloc, o),
        (Alloc, 3 << 20),
        (Free, 3 << 20),
        (Alloc, x),
        (Alloc, w),
        (Alloc, 5 << 20),
        (Free, 5 << 20),
    ]
}

#[test]
fn a_replaying_virtual_device_allocates_each_calls_recorded_workspace_and_nothing_of_its_own() {
    for (dtype, nhwc) in [(DType::F32, false), (DType::BF16, false), (DType::BF16, true)] {
        let layout = if nhwc { ConvLayout::Nhwc } else { ConvLayout::Nchw };
        let d = Device::virtual_device(1 << 30);
        d.set_cudnn_choices(Some(record(dtype, layout))).unwrap();
        assert_eq!(
            d.conv_path().to_string(),
            "virtual (replaying cuDNN 9.14.0's choices on a test GPU)"
        );
        let got = conv_trace(&d, dtype, nhwc);
        let want = recorded_trace(dtype);
        assert_eq!(got, want, "{dtype:?} nhwc {nhwc}");
        assert_eq!(d.cudnn_choice_misses(), 0);
        // The own kernels' model allocates something else (an im2col buffer, permutes).
        let own = Device::virtual_device(1 << 30);
        assert_ne!(conv_trace(&own, dtype, nhwc), want, "{dtype:?} nhwc {nhwc}");
        // ConvBackend::Own turns the replay off.
        d.set_conv_backend(ConvBackend::Own).unwrap();
        assert_eq!(d.conv_path(), ConvPath::Virtual);
        assert_eq!(conv_trace(&d, dtype, nhwc), conv_trace(&own, dtype, nhwc));
    }
}

#[test]
fn a_call_the_record_lacks_takes_no_workspace_and_is_counted() {
    let d = Device::virtual_device(1 << 30);
    // Recorded in f32; run in bf16: all three calls miss.
    d.set_cudnn_choices(Some(record(DType::F32, ConvLayout::Nchw))).unwrap();
    let got = conv_trace(&d, DType::BF16, false);
    assert!(got.iter().all(|&(_, bytes)| bytes != 3 << 20 && bytes != 5 << 20), "{got:?}");
    assert_eq!(got.len(), 3, "the three outputs only: {got:?}");
    assert_eq!(d.cudnn_choice_misses(), 3);
    // A new record resets the count; `None` returns to the own kernels' model.
    d.set_cudnn_choices(Some(record(DType::BF16, ConvLayout::Nchw))).unwrap();
    assert_eq!(d.cudnn_choice_misses(), 0);
    assert_eq!(d.cudnn_choices().unwrap().convolutions.len(), 3);
    d.set_cudnn_choices(None).unwrap();
    assert_eq!(d.conv_path(), ConvPath::Virtual);
    assert!(d.cudnn_choices().is_none());
}

/// With `cudnn_benchmark` on, a shape's first call replays the workspace its recorded timed
/// search ran in, before the call's own; later calls (the GPU's algorithm cache) do not; a
/// choice the heuristics made is a miss; a search that runs out of memory is the call's
/// error, leaves the tensors intact and searches again next time.
#[test]
fn a_benchmark_run_replays_each_shapes_recorded_search_once() {
    let searched = |dtype| {
        let mut r = record(dtype, ConvLayout::Nchw);
        r.convolutions[0].search_workspace = Some(64 << 20);
        r.convolutions[1].search_workspace = Some(0);
        r
    };
    let dtype = DType::F32;
    let later = recorded_trace(dtype);
    let mut first = later.clone();
    use TraceAction::{Alloc, FreeRequested as Free};
    first.splice(1..1, [(Alloc, 64 << 20), (Free, 64 << 20)]);

    let d = Device::virtual_device(1 << 30);
    d.set_cudnn_benchmark(true);
    d.set_cudnn_choices(Some(searched(dtype))).unwrap();
    assert_eq!(conv_trace(&d, dtype, false), first);
    assert_eq!(d.cudnn_choice_misses(), 1, "backward filter's choice came from the heuristics");
    assert_eq!(conv_trace(&d, dtype, false), later, "cached: no second search");
    assert_eq!(d.cudnn_choice_misses(), 1);
    // A new record starts a new cache.
    d.set_cudnn_choices(Some(searched(dtype))).unwrap();
    assert_eq!(conv_trace(&d, dtype, false), first);

    // Without cudnn_benchmark the heuristics choose: no search.
    let plain = Device::virtual_device(1 << 30);
    plain.set_cudnn_choices(Some(searched(dtype))).unwrap();
    assert_eq!(conv_trace(&plain, dtype, false), later);
    assert_eq!(plain.cudnn_choice_misses(), 0);

    // Room for the call's own workspace but not for the search's: out of memory (the
    // inputs stay allocated); once there is room, the first call searches.
    let small = Device::virtual_device(80 << 20);
    small.set_cudnn_benchmark(true);
    small.set_cudnn_choices(Some(searched(dtype))).unwrap();
    let xt = Tensor::zeros(&small, &X, dtype).unwrap();
    let wt = Tensor::zeros(&small, &W, dtype).unwrap();
    let ballast = Tensor::zeros(&small, &[10 << 20], dtype).unwrap();
    let before = small.memory_allocated();
    let err = ops::conv2d(&xt, &wt, None, &opts()).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(small.memory_allocated(), before, "the failed call holds nothing");
    drop((ballast, xt, wt));
    assert_eq!(conv_trace(&small, dtype, false), first);
}

/// PyTorch's `findAlgorithms` empties the cache right after a timed search, while the
/// search's workspace is still held: blocks cached before go back to the device, and the
/// search's block stays cached (the call's own workspace then comes out of it). Without
/// `cudnn_benchmark` nothing is emptied.
#[test]
fn a_timed_search_empties_the_cache_and_keeps_its_own_block() {
    const MIB: u64 = 1 << 20;
    let reserved_after_forward = |benchmark: bool| {
        let d = Device::virtual_device(1 << 30);
        d.set_cudnn_benchmark(benchmark);
        let mut r = record(DType::F32, ConvLayout::Nchw);
        r.convolutions[0].search_workspace = Some(64 << 20);
        d.set_cudnn_choices(Some(r)).unwrap();
        let x = Tensor::zeros(&d, &X, DType::F32).unwrap();
        let w = Tensor::zeros(&d, &W, DType::F32).unwrap();
        // 32 MiB cached, too small for the search's 64 MiB.
        drop(Tensor::zeros(&d, &[8 << 20], DType::F32).unwrap());
        assert!(d.memory_reserved() >= 32 * MIB, "32 MiB cached before the call");
        let y = ops::conv2d(&x, &w, None, &opts()).unwrap();
        let reserved = d.memory_reserved();
        drop((x, w, y));
        reserved
    };
    // The search's 64 MiB segment and the small pool's; the 32 MiB segment was released.
    let searched = reserved_after_forward(true);
    assert!((64 * MIB..96 * MIB).contains(&searched), "{searched} B reserved");
    let plain = reserved_after_forward(false);
    assert!((32 * MIB..64 * MIB).contains(&plain), "{plain} B reserved: nothing emptied");
}

#[test]
fn only_a_virtual_device_replays_and_the_host_records_nothing() {
    let host = Device::host(1 << 20);
    let err = host.set_cudnn_choices(Some(CudnnChoices::default())).unwrap_err();
    assert!(err.to_string().contains("only a virtual device"), "{err}");
    assert!(host.cudnn_choices().is_none());
    // cuDNN asked for on a virtual device: refused without a record, taken with one.
    let d = Device::virtual_device(1 << 20);
    let err = d.set_conv_backend(ConvBackend::Cudnn).unwrap_err();
    assert!(err.to_string().contains("set_cudnn_choices"), "{err}");
    d.set_cudnn_choices(Some(CudnnChoices::default())).unwrap();
    d.set_conv_backend(ConvBackend::Cudnn).unwrap();
}

/// Batch norm on a replaying device: cuDNN where PyTorch's rule sends it (f32, 4-d: no own
/// per-channel workspace), the own kernels elsewhere (bf16: their workspace).
#[test]
fn batch_norm_follows_pytorchs_rule_on_a_replaying_device() {
    let bn_allocs = |d: &Device, dtype: DType| {
        let x = Tensor::zeros(d, &[8, 64, 14, 14], dtype).unwrap();
        let g = Tensor::zeros(d, &[64], DType::F32).unwrap();
        let b = Tensor::zeros(d, &[64], DType::F32).unwrap();
        let from = start(d);
        let out = ops::batch_norm(&x, &g, &b, None, 1e-5).unwrap();
        let e = entries(d, from);
        drop(out);
        e.iter().filter(|(a, _)| *a == TraceAction::Alloc).count()
    };
    let d = Device::virtual_device(1 << 30);
    d.set_cudnn_choices(Some(CudnnChoices::default())).unwrap();
    let own = Device::virtual_device(1 << 30);
    // y, mean, invstd; the own kernels add their partial sums.
    assert_eq!(bn_allocs(&d, DType::F32), 3);
    assert_eq!(d.cudnn_choice_misses(), 1, "the f32 call is not in the empty record");
    assert_eq!(bn_allocs(&own, DType::F32), 4);
    assert_eq!(bn_allocs(&d, DType::BF16), 4);
    assert_eq!(d.cudnn_choice_misses(), 1, "bf16 runs the own kernels: no cuDNN call");
}

/// A recorded batch norm call: its workspace and reserve space allocated and freed during
/// the call; a backward whose training call took a reserve runs the own kernels (vram's
/// forward keeps no reserve for it), one without through cuDNN.
#[test]
fn batch_norm_calls_replay_their_recorded_workspace_and_reserve() {
    let shape = [8, 64, 14, 14];
    let call = |pass, workspace, reserve| BnChoice {
        pass,
        shape: shape.to_vec(),
        dtype: DType::F32,
        layout: ConvLayout::Nchw,
        workspace,
        reserve,
    };
    let run = |reserve: usize| -> Vec<Entry> {
        let d = Device::virtual_device(1 << 30);
        let record = CudnnChoices {
            batch_norms: vec![
                call(BnPass::Training, 1 << 20, reserve),
                call(BnPass::Backward, 3 << 20, 0),
            ],
            ..CudnnChoices::default()
        };
        d.set_cudnn_choices(Some(record)).unwrap();
        let x = Tensor::zeros(&d, &shape, DType::F32).unwrap();
        let g = Tensor::zeros(&d, &[64], DType::F32).unwrap();
        let b = Tensor::zeros(&d, &[64], DType::F32).unwrap();
        let from = start(&d);
        let out = ops::batch_norm(&x, &g, &b, None, 1e-5).unwrap();
        let grads = ops::batch_norm_backward(&x, &g, &out.mean, &out.invstd, &x, 1e-5).unwrap();
        let e = entries(&d, from);
        assert_eq!(d.cudnn_choice_misses(), 0);
        drop((out, grads));
        e
    };
    use TraceAction::{Alloc, FreeRequested as Free};
    let y = 8 * 64 * 14 * 14 * 4;
    let c = 64 * 4; // the statistics and parameter gradients, 64 f32 (bytes requested)
    let through_cudnn = run(0);
    assert_eq!(
        through_cudnn,
        vec![
            (Alloc, y),
            (Alloc, c),
            (Alloc, c),
            (Alloc, 1 << 20),
            (Free, 1 << 20),
            (Alloc, y),
            (Alloc, c),
            (Alloc, c),
            (Alloc, 3 << 20),
            (Free, 3 << 20),
        ],
        "forward: y, mean, invstd, then the workspace; backward: dx, dgamma, dbeta, workspace"
    );
    let with_reserve = run(2 << 20);
    assert!(with_reserve.contains(&(Alloc, 2 << 20)), "{with_reserve:?}");
    assert!(!with_reserve.contains(&(Alloc, 3 << 20)), "own backward: {with_reserve:?}");
}

/// On a GPU with cuDNN: convolutions of several shapes, layouts and dtypes, forward and
/// backward; the GPU's record replayed on a virtual device gives the same trace.
#[test]
fn a_gpus_record_replayed_on_a_virtual_device_gives_the_gpus_trace() {
    let gpu = match Device::cuda(0) {
        Ok(g) => g,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({e})");
            return;
        }
    };
    if !matches!(gpu.conv_path(), ConvPath::Cudnn { .. }) {
        let _ = writeln!(std::io::stderr(), "skipped: no cuDNN ({})", gpu.conv_path());
        return;
    }
    let run = |d: &Device| -> Vec<Entry> {
        let mut all = Vec::new();
        for (dtype, nhwc) in [(DType::F32, false), (DType::BF16, false), (DType::BF16, true)] {
            all.extend(conv_trace(d, dtype, nhwc));
        }
        // Batch norm through cuDNN (f32, and f16 with f32 parameters), NCHW and NHWC.
        for (dtype, nhwc) in [(DType::F32, false), (DType::F16, false), (DType::F32, true)] {
            let shape = if nhwc { [8, 14, 14, 64] } else { [8, 64, 14, 14] };
            let x = Tensor::zeros(d, &shape, dtype).unwrap();
            let g = Tensor::zeros(d, &[64], DType::F32).unwrap();
            let b = Tensor::zeros(d, &[64], DType::F32).unwrap();
            let from = start(d);
            let (out, grads) = if nhwc {
                let out = ops::batch_norm_nhwc(&x, &g, &b, None, 1e-5).unwrap();
                let gr = ops::batch_norm_backward_nhwc(&x, &g, &out.mean, &out.invstd, &x, 1e-5);
                (out, gr.unwrap())
            } else {
                let out = ops::batch_norm(&x, &g, &b, None, 1e-5).unwrap();
                let gr = ops::batch_norm_backward(&x, &g, &out.mean, &out.invstd, &x, 1e-5);
                (out, gr.unwrap())
            };
            all.extend(entries(d, from));
            drop((out, grads));
        }
        all
    };
    // With the heuristics, then with timed searches (a fresh device: empty caches), whose
    // workspaces the record keeps and the virtual device replays.
    for benchmark in [false, true] {
        let gpu = if benchmark { Device::cuda(0).unwrap() } else { gpu.clone() };
        gpu.set_cudnn_benchmark(benchmark);
        let on_gpu = run(&gpu);
        let record = gpu.cudnn_choices().expect("cuDNN ran");
        assert!(record.convolutions.len() >= 9, "{record:?}");
        let searched = record.convolutions.iter().filter(|c| c.search_workspace.is_some());
        assert_eq!(searched.count(), if benchmark { record.convolutions.len() } else { 0 });
        let virt = Device::virtual_device(gpu.mem_info().total);
        virt.set_cudnn_benchmark(benchmark);
        virt.set_cudnn_choices(Some(record)).unwrap();
        assert_eq!(run(&virt), on_gpu, "benchmark {benchmark}");
        assert_eq!(virt.cudnn_choice_misses(), 0);
    }
}
