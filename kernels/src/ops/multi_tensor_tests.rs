use super::*;
use crate::ops;
use vram_alloc::TraceAction;

use crate::cpu::elementwise::testing::seeded_in as values;

/// One parameter of the tests: its dtype, whether it has a master, its gradient's dtype and
/// its size (0 included: an empty tensor is skipped by the table).
#[derive(Clone, Copy)]
struct Spec {
    dtype: DType,
    master: bool,
    grad: DType,
    n: usize,
}

const SPECS: [Spec; 6] = [
    Spec { dtype: DType::F32, master: false, grad: DType::F32, n: 300 },
    Spec { dtype: DType::BF16, master: true, grad: DType::BF16, n: 257 },
    Spec { dtype: DType::F16, master: true, grad: DType::F32, n: 1 },
    Spec { dtype: DType::F32, master: false, grad: DType::F16, n: 0 },
    Spec { dtype: DType::BF16, master: false, grad: DType::BF16, n: 129 },
    Spec { dtype: DType::F16, master: false, grad: DType::F16, n: 64 },
];

/// A parameter list's tensors on `dev`: (param, master, grads of two steps, state 1, state 2).
struct State {
    param: Tensor,
    master: Option<Tensor>,
    grads: [Tensor; 2],
    s1: Tensor,
    s2: Tensor,
}

fn states(dev: &Device, specs: &[Spec]) -> Vec<State> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let seed = 10 * i as u64;
            let shape = [s.n];
            let p = Tensor::from_f32_slice(dev, &shape, &values(s.n, seed, -1.0, 1.0), s.dtype);
            let p = p.unwrap();
            let g = |k| {
                let v = values(s.n, seed + k, -0.5, 0.5);
                Tensor::from_f32_slice(dev, &shape, &v, s.grad).unwrap()
            };
            State {
                master: s.master.then(|| p.to_dtype(DType::F32).unwrap()),
                param: p,
                grads: [g(1), g(2)],
                s1: Tensor::zeros(dev, &shape, DType::F32).unwrap(),
                s2: Tensor::zeros(dev, &shape, DType::F32).unwrap(),
            }
        })
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn assert_same(what: &str, got: &[State], want: &[State]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(bits(&g.param), bits(&w.param), "{what}: param {i}");
        assert_eq!(bits(&g.s1), bits(&w.s1), "{what}: state 1 of {i}");
        assert_eq!(bits(&g.s2), bits(&w.s2), "{what}: state 2 of {i}");
        if let (Some(gm), Some(wm)) = (&g.master, &w.master) {
            assert_eq!(bits(gm), bits(wm), "{what}: master {i}");
        }
    }
}

/// The per-tensor reference for one parameter: `update` on its f32 values (the master, the
/// f32 parameter, or a widened copy of a 16-bit one), then rounded into the parameter by a
/// cast, as `vram-amp`'s optimizers do.
fn per_tensor(s: &mut State, update: impl FnOnce(&mut Tensor, &mut Tensor, &mut Tensor)) {
    let State { param, master, s1, s2, .. } = s;
    match master {
        Some(m) => {
            update(m, s1, s2);
            param.copy_from(m).unwrap();
        }
        None if param.dtype() == DType::F32 => update(param, s1, s2),
        None => {
            let mut wide = param.to_dtype(DType::F32).unwrap();
            update(&mut wide, s1, s2);
            param.copy_from(&wide).unwrap();
        }
    }
}

fn adamw_list<'a>(list: &'a mut [State], k: usize, steps: &[u32]) -> Vec<AdamWTensors<'a>> {
    list.iter_mut()
        .zip(steps)
        .map(|(s, &step)| AdamWTensors {
            param: &mut s.param,
            grad: &s.grads[k],
            exp_avg: &mut s.s1,
            exp_avg_sq: &mut s.s2,
            master: s.master.as_mut(),
            step,
        })
        .collect()
}

fn sgd_list(list: &mut [State], k: usize) -> Vec<SgdTensors<'_>> {
    list.iter_mut()
        .map(|s| SgdTensors {
            param: &mut s.param,
            grad: &s.grads[k],
            momentum_buf: Some(&mut s.s1),
            first_step: k == 0,
            master: s.master.as_mut(),
        })
        .collect()
}

const ADAMW: AdamWConfig =
    AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };

fn sgd_configs() -> [SgdConfig; 4] {
    let base = SgdConfig::default();
    [
        SgdConfig { lr: 0.1, ..base },
        SgdConfig { lr: 0.05, momentum: 0.9, weight_decay: 1e-2, ..base },
        SgdConfig { lr: 0.05, momentum: 0.9, nesterov: true, ..base },
        SgdConfig { lr: 0.05, momentum: 0.5, dampening: 0.3, ..base },
    ]
}

/// Per-tensor step counts that differ (a parameter that missed steps counts its own).
const STEPS: [[u32; 6]; 2] = [[1, 1, 3, 1, 2, 1], [2, 2, 4, 2, 3, 2]];

/// The host's multi-tensor AdamW is the per-tensor op looped, bit for bit, in every dtype
/// combination, with and without masters, over two steps with per-tensor step counts.
#[test]
fn adamw_multi_is_the_per_tensor_op_bit_for_bit() {
    let dev = Device::host(64 << 20);
    let (mut multi, mut single) = (states(&dev, &SPECS), states(&dev, &SPECS));
    for (k, steps) in STEPS.iter().enumerate() {
        adamw_step_multi(&mut adamw_list(&mut multi, k, steps), &ADAMW).unwrap();
        for (s, &step) in single.iter_mut().zip(steps) {
            let g = s.grads[k].clone();
            per_tensor(s, |p, m, v| ops::adamw_step(p, &g, m, v, step, &ADAMW).unwrap());
        }
        assert_same(&format!("adamw step {}", k + 1), &multi, &single);
    }
    assert!(multi[0].param.to_f32_vec().unwrap() != values(300, 0, -1.0, 1.0), "it moved");
}

/// The same for SGD in its four modes (plain, momentum with weight decay, Nesterov,
/// dampening), the first step initializing the buffers.
#[test]
fn sgd_multi_is_the_per_tensor_op_bit_for_bit() {
    let dev = Device::host(64 << 20);
    for cfg in sgd_configs() {
        let (mut multi, mut single) = (states(&dev, &SPECS), states(&dev, &SPECS));
        for k in 0..2 {
            sgd_step_multi(&mut sgd_list(&mut multi, k), &cfg).unwrap();
            for s in single.iter_mut() {
                let g = s.grads[k].clone();
                per_tensor(s, |p, b, _| {
                    let buf = (cfg.momentum != 0.0).then_some(b);
                    ops::sgd_step(p, &g, buf, k == 0, &cfg).unwrap();
                });
            }
            assert_same(&format!("sgd {cfg:?} step {}", k + 1), &multi, &single);
        }
    }
}

/// Bad operands anywhere in the list are refused before anything is updated.
#[test]
fn a_bad_tensor_anywhere_refuses_the_whole_step() {
    let dev = Device::host(64 << 20);
    let mut list = states(&dev, &SPECS);
    let before: Vec<Vec<u32>> = list.iter().map(|s| bits(&s.param)).collect();
    let wrong_shape = Tensor::zeros(&dev, &[3], DType::F32).unwrap();
    let wrong_dtype = Tensor::zeros(&dev, &[64], DType::F16).unwrap();
    {
        let mut l = adamw_list(&mut list, 0, &STEPS[0]);
        l[4].grad = &wrong_shape;
        let e = adamw_step_multi(&mut l, &ADAMW).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    }
    {
        let mut wrong = wrong_dtype.clone();
        let mut l = adamw_list(&mut list, 0, &STEPS[0]);
        l[5].exp_avg = &mut wrong;
        let e = adamw_step_multi(&mut l, &ADAMW).unwrap_err();
        assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    }
    {
        let mut l = adamw_list(&mut list, 0, &[1, 1, 1, 1, 1, 0]);
        assert!(matches!(adamw_step_multi(&mut l, &ADAMW), Err(Error::InvalidArgument { .. })));
    }
    {
        let mut l = sgd_list(&mut list, 0);
        l[2].momentum_buf = None;
        let cfg = sgd_configs()[1];
        assert!(matches!(sgd_step_multi(&mut l, &cfg), Err(Error::InvalidArgument { .. })));
    }
    {
        let other = Device::host(16 << 20);
        let mut foreign = Tensor::zeros(&other, &[64], DType::F16).unwrap();
        let mut l = sgd_list(&mut list, 0);
        l[5].param = &mut foreign;
        let e = sgd_step_multi(&mut l, &SgdConfig::default()).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    }
    let after: Vec<Vec<u32>> = list.iter().map(|s| bits(&s.param)).collect();
    assert_eq!(after, before);
    // An empty list is a valid step that does nothing (its config is still checked).
    adamw_step_multi(&mut [], &ADAMW).unwrap();
    assert!(sgd_step_multi(&mut [], &SgdConfig { lr: -1.0, ..SgdConfig::default() }).is_err());
}

/// The table is one workspace of the caching allocator, the same request on the host and on
/// a virtual device (the GPU's plan), sized for an entry per non-empty tensor and a task per
/// chunk; nothing else is allocated.
#[test]
fn the_table_is_one_workspace_on_every_backend() {
    let want = table_bytes(SPECS.iter().map(|s| s.n), CHUNK);
    assert_eq!(want, 5 * ENTRY_BYTES + 5 * TASK_BYTES);
    assert_eq!(table_bytes([CHUNK + 1, 0, 1].into_iter(), CHUNK), 2 * ENTRY_BYTES + 3 * TASK_BYTES);
    for dev in [Device::host(64 << 20), Device::virtual_device(64 << 20)] {
        let mut list = states(&dev, &SPECS);
        dev.record_history(Some(100));
        adamw_step_multi(&mut adamw_list(&mut list, 0, &STEPS[0]), &ADAMW).unwrap();
        sgd_step_multi(&mut sgd_list(&mut list, 0), &sgd_configs()[1]).unwrap();
        let allocs: Vec<usize> = dev
            .trace()
            .iter()
            .filter(|e| e.action == TraceAction::Alloc)
            .map(|e| e.requested)
            .collect();
        assert_eq!(allocs, [want, want], "{dev:?}");
    }
}

/// The kernels, emulated on the host from the table the op builds, against the host op:
/// bit for bit (the emulation compiles without contraction), with chunks of 64 elements (a
/// tensor over several blocks, a last chunk cut short) and of [`CHUNK`].
#[cfg(feature = "cuda")]
mod emulated {
    use super::*;
    use crate::cuda::emulate::launch;
    use crate::cuda::registry::{ADAMW_MULTI, SGD_MULTI};
    use crate::cuda::{Arg, registry::Instance};

    /// The host tensors' addresses as an entry (host memory stands for device memory).
    fn entry(s: &State, momentum: bool) -> Entry {
        let addr = |t: &Tensor| t.storage().address();
        let (p, copy) = match &s.master {
            Some(m) => (m, Some(&s.param)),
            None => (&s.param, None),
        };
        Entry {
            p: addr(p),
            copy: copy.map_or(0, addr),
            s1: if momentum { addr(&s.s1) } else { 0 },
            s2: addr(&s.s2),
            n: s.param.numel(),
            types: Entry::types(p.dtype(), DType::F32, copy.map(Tensor::dtype)),
            ..Entry::default()
        }
    }

    /// Launches `kernel` over the table of `entries` with the scalars `args` (after the two
    /// table pointers, before the chunk); false without a C++ compiler.
    fn run_table(kernel: Instance, entries: &[Entry], chunk: usize, args: &[Arg]) -> bool {
        let table = Table::new(entries, chunk).unwrap();
        let base = table.words.as_ptr() as u64;
        let mut all = vec![Arg::Ptr(base), Arg::Ptr(base + table.tasks_offset)];
        all.extend_from_slice(args);
        all.push(Arg::count(chunk));
        launch(kernel, table.grid(), &all)
    }

    fn with_grads(list: &[State], k: usize, momentum: bool) -> Vec<Entry> {
        list.iter()
            .map(|s| Entry {
                g: s.grads[k].storage().address(),
                types: Entry::types(
                    s.master.as_ref().map_or(s.param.dtype(), Tensor::dtype),
                    s.grads[k].dtype(),
                    s.master.as_ref().map(|_| s.param.dtype()),
                ),
                ..entry(s, momentum)
            })
            .collect()
    }

    #[test]
    fn adamw_multi_kernel_matches_the_host_bit_for_bit() {
        let dev = Device::host(64 << 20);
        for chunk in [64, CHUNK] {
            let (emu, mut host) = (states(&dev, &SPECS), states(&dev, &SPECS));
            for (k, steps) in STEPS.iter().enumerate() {
                adamw_step_multi(&mut adamw_list(&mut host, k, steps), &ADAMW).unwrap();
                let mut entries = with_grads(&emu, k, true);
                for (e, &step) in entries.iter_mut().zip(steps) {
                    (e.a, e.b, _) = ADAMW.step_scalars(step);
                }
                let (_, _, decay) = ADAMW.step_scalars(1);
                let c = ADAMW;
                let args = [c.beta1, c.beta2, c.eps, decay].map(Arg::F32);
                if !run_table(ADAMW_MULTI.of(DType::F32), &entries, chunk, &args) {
                    return;
                }
                assert_same(&format!("adamw_multi chunk {chunk} step {}", k + 1), &emu, &host);
            }
        }
    }

    #[test]
    fn sgd_multi_kernel_matches_the_host_bit_for_bit() {
        let dev = Device::host(64 << 20);
        for cfg in sgd_configs() {
            let momentum = cfg.momentum != 0.0;
            let (emu, mut host) = (states(&dev, &SPECS), states(&dev, &SPECS));
            for k in 0..2 {
                sgd_step_multi(&mut sgd_list(&mut host, k), &cfg).unwrap();
                let mut entries = with_grads(&emu, k, momentum);
                for e in &mut entries {
                    e.flags = u32::from(k == 0);
                }
                let args = [
                    Arg::F32(cfg.lr),
                    Arg::F32(cfg.momentum),
                    Arg::F32(cfg.dampening),
                    Arg::F32(cfg.weight_decay),
                    Arg::U32(u32::from(cfg.nesterov)),
                ];
                if !run_table(SGD_MULTI.of(DType::F32), &entries, 64, &args) {
                    return;
                }
                let what = format!("sgd_multi {cfg:?} step {}", k + 1);
                for (i, (e, h)) in emu.iter().zip(&host).enumerate() {
                    assert_eq!(bits(&e.param), bits(&h.param), "{what}: param {i}");
                    if momentum {
                        assert_eq!(bits(&e.s1), bits(&h.s1), "{what}: buffer {i}");
                    }
                }
            }
        }
    }
}
