//! Compiles every `.cu` module with NVRTC, which needs no GPU, and checks the typed
//! registry against the result: each module compiles to PTX for `compute_80` and
//! `compute_90` with the options the device uses, and to a cubin for `sm_80` and `sm_90`
//! (running ptxas); the PTX defines exactly the kernels the registry lists, each with the
//! registered number and types of parameters. A mismatch there is undefined behaviour on a
//! GPU, so it must fail here.
//!
//! NVRTC is loaded from `LD_LIBRARY_PATH` (`libnvrtc.so.13`, e.g. from the
//! `nvidia-cuda-nvrtc` wheel that `.ci/run` installs). Without it the test prints
//! `skipped: no NVRTC (...)` and passes, unless `VRAM_REQUIRE_NVRTC=1` (set by CI) makes
//! that a failure.

use super::custom::ptx_entries;
use super::loader::{compile_error, compile_options, full_source};
use super::registry::{
    ALL, ATTENTION_BWD_DKDV_MMA_BF16, ATTENTION_BWD_DKDV_MMA_D64_BF16,
    ATTENTION_BWD_DKDV_MMA_D64_F16, ATTENTION_BWD_DKDV_MMA_F16, ATTENTION_BWD_DQ_MMA_BF16,
    ATTENTION_BWD_DQ_MMA_D64_BF16, ATTENTION_BWD_DQ_MMA_D64_F16, ATTENTION_BWD_DQ_MMA_F16,
    ATTENTION_FWD_MMA_BF16, ATTENTION_FWD_MMA_D64_BF16, ATTENTION_FWD_MMA_D64_F16,
    ATTENTION_FWD_MMA_F16, DEPTHWISE_BWD_WEIGHT, Kernel, MODULES, Module, Param,
};
use cudarc::nvrtc::{compile_ptx_with_opts, result, sys};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::Write as _;

/// Set to make a missing NVRTC a failure instead of a skip.
const REQUIRE_VAR: &str = "VRAM_REQUIRE_NVRTC";

/// The virtual architectures the PTX is checked for; the device compiles for its own.
const PTX_ARCHS: [&str; 2] = ["compute_80", "compute_90"];

/// The real architectures compiled down to a cubin.
const CUBIN_ARCHS: [&str; 2] = ["sm_80", "sm_90"];

fn say(line: &str) {
    // Straight to stderr, so that it shows through the test harness's output capture.
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Whether NVRTC can be loaded; prints the skip line (or fails under CI) when it cannot.
fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library by its candidate names; no NVRTC call.
    if unsafe { sys::is_culib_present() } {
        return true;
    }
    let why = "libnvrtc.so.13 is not on LD_LIBRARY_PATH; `pip install nvidia-cuda-nvrtc` \
               provides it in nvidia/cu13/lib";
    let required = std::env::var(REQUIRE_VAR).is_ok_and(|v| !v.is_empty() && v != "0");
    assert!(!required, "{REQUIRE_VAR} is set but NVRTC cannot be loaded: {why}");
    say(&format!("skipped: no NVRTC ({why})"));
    false
}

/// The differences between `module`'s PTX entries and the registry, one line each.
fn registry_mismatches(
    module: &Module,
    entries: &BTreeMap<String, Vec<(String, usize)>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut registered = 0;
    for kernel in ALL.iter().filter(|k| k.module.name == module.name) {
        let want: Vec<(String, usize)> =
            kernel.params.iter().map(|p| Param::ptx(*p)).map(|(t, b)| (t.to_string(), b)).collect();
        for name in kernel.names {
            registered += 1;
            match entries.get(*name) {
                None => problems.push(format!("{name}: launched by Rust, missing from the PTX")),
                Some(got) if *got != want => problems.push(format!(
                    "{name}: the kernel takes {got:?}, the launch passes {want:?} ({:?})",
                    kernel.params
                )),
                Some(_) => {}
            }
        }
    }
    for name in entries.keys() {
        let known =
            ALL.iter().any(|k| k.module.name == module.name && k.names.contains(&name.as_str()));
        if !known {
            problems
                .push(format!("{name}: in the PTX but not in the registry (dead or unregistered)"));
        }
    }
    if registered == 0 {
        problems.push(format!("{}.cu: no kernel registered", module.name));
    }
    problems
}

/// Compiles `module` for the real architecture `arch` (ptxas's resource report on with
/// `verbose`) and returns the cubin's size and NVRTC's log.
fn cubin(module: &Module, arch: &str, verbose: bool) -> Result<(usize, String), String> {
    let src = CString::new(full_source(module)).map_err(|e| e.to_string())?;
    let name = CString::new(format!("{}.cu", module.name)).map_err(|e| e.to_string())?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| format!("{e:?}"))?;
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--fmad=false".to_string()];
    if verbose {
        opts.push("--ptxas-options=-v".to_string());
    }
    // SAFETY: `prog` was just created from `src` and `name`, which outlive it, and is
    // destroyed once, below.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog) }.unwrap_or_default();
    let log: Vec<u8> = log.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
    let log = String::from_utf8_lossy(&log).into_owned();
    let outcome = match compiled {
        Err(e) => Err(format!("{e:?}:\n{log}")),
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: as above; `size` is a valid out-pointer.
            let status = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
            if status == sys::nvrtcResult::NVRTC_SUCCESS && size > 0 {
                Ok((size, log))
            } else {
                Err(format!("no cubin ({status:?}, {size} bytes)"))
            }
        }
    };
    // SAFETY: as above; not used afterwards.
    let _ = unsafe { result::destroy_program(prog) };
    outcome
}

/// ptxas's resources per kernel from a `--ptxas-options=-v` log: (registers, bytes of spill
/// stores, bytes of spill loads), by entry name.
fn ptxas_resources(log: &str) -> BTreeMap<String, (usize, usize, usize)> {
    let number_before = |line: &str, unit: &str| -> Option<usize> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut found = BTreeMap::new();
    let mut current: Option<String> = None;
    let mut spills = (0, 0);
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some(rest.trim().to_string());
            spills = (0, 0);
        } else if line.contains("bytes spill stores") {
            spills = (
                number_before(line, " bytes spill stores").unwrap_or(usize::MAX),
                number_before(line, " bytes spill loads").unwrap_or(usize::MAX),
            );
        } else if let (Some(name), Some(regs)) = (&current, number_before(line, " registers")) {
            found.insert(name.clone(), (regs, spills.0, spills.1));
            current = None;
        }
    }
    found
}

#[test]
fn every_module_compiles_for_sm80_and_sm90_and_matches_the_registry() {
    if !nvrtc_present() {
        return;
    }
    let mut problems = Vec::new();
    for module in MODULES {
        for arch in PTX_ARCHS {
            let ptx =
                match compile_ptx_with_opts(full_source(module), compile_options(module, arch)) {
                    Ok(ptx) => ptx.to_src(),
                    Err(e) => {
                        problems.push(format!("{arch}: {}", compile_error(module, e)));
                        continue;
                    }
                };
            match ptx_entries(&ptx) {
                Ok(entries) => {
                    let found = registry_mismatches(module, &entries);
                    say(&format!(
                        "nvrtc: {}.cu for {arch}: {} kernels, {}",
                        module.name,
                        entries.len(),
                        if found.is_empty() {
                            "all match the registry".to_string()
                        } else {
                            format!("{} mismatches", found.len())
                        }
                    ));
                    problems.extend(
                        found.into_iter().map(|p| format!("{}.cu {arch}: {p}", module.name)),
                    );
                }
                Err(e) => problems.push(format!("{}.cu {arch}: unreadable PTX: {e}", module.name)),
            }
        }
        for arch in CUBIN_ARCHS {
            match cubin(module, arch, false) {
                Ok((bytes, _)) => {
                    say(&format!("nvrtc: {}.cu for {arch}: cubin of {bytes} bytes", module.name))
                }
                Err(e) => problems.push(format!("{}.cu {arch}: {e}", module.name)),
            }
        }
    }
    assert!(problems.is_empty(), "NVRTC check failed:\n{}", problems.join("\n"));
}

#[test]
fn ptx_parameter_declarations_are_read_with_their_sizes() {
    let ptx = "
.visible .entry k_f32(
	.param .u64 .ptr .global .align 4 k_f32_param_0,
	.param .f32 k_f32_param_1,
	.param .align 8 .b8 k_f32_param_2[128],
	.param .u32 k_f32_param_3
)
{
}
.visible .entry empty()
{
}";
    let entries = ptx_entries(ptx).unwrap();
    assert_eq!(
        entries["k_f32"],
        [("u64".into(), 8), ("f32".into(), 4), ("b8".into(), 128), ("u32".into(), 4)]
    );
    assert!(entries["empty"].is_empty());
}

#[test]
fn every_registered_kernel_has_one_name_per_instance_and_names_are_unique() {
    let mut seen = std::collections::HashSet::new();
    for kernel in ALL {
        assert!(matches!(kernel.names.len(), 1 | 3 | 9), "{:?}", kernel.names);
        for name in kernel.names {
            assert!(seen.insert(*name), "{name} is registered twice");
        }
    }
}

/// Each kernel of module `name` (a `.cu` file's stem) as `(entry name, PTX body)`, compiled
/// for compute_90.
fn kernel_bodies(name: &str) -> Vec<(String, String)> {
    let module = MODULES.iter().find(|m| m.name == name).expect("a registered module");
    let ptx = compile_ptx_with_opts(full_source(module), compile_options(module, "compute_90"))
        .unwrap_or_else(|e| panic!("{}", compile_error(module, e)))
        .to_src();
    ptx.split(".entry ")
        .skip(1)
        .map(|body| {
            let name = body[..body.find('(').unwrap_or(0)].trim().to_string();
            (name, body[..body.find("\n}").unwrap_or(body.len())].to_string())
        })
        .collect()
}

/// Every registered instance of the kernels `which` selects, each with its PTX body
/// (compute_90), module by module. An instance missing from the PTX is an error.
fn registered_bodies(which: impl Fn(&Kernel) -> bool) -> Vec<(&'static Kernel, String, String)> {
    let mut found = Vec::new();
    for module in MODULES {
        let kernels: Vec<&Kernel> =
            ALL.iter().copied().filter(|k| k.module.name == module.name && which(k)).collect();
        if kernels.is_empty() {
            continue;
        }
        let bodies = kernel_bodies(module.name);
        for kernel in kernels {
            for name in kernel.names {
                let body = bodies.iter().find(|(n, _)| n == name).map(|(_, b)| b.clone());
                let body = body.unwrap_or_else(|| panic!("{name}: registered, not in the PTX"));
                found.push((kernel, name.to_string(), body));
            }
        }
    }
    found
}

/// The number of registered instances of the kernels `which` selects.
fn registered_instances(which: impl Fn(&Kernel) -> bool) -> usize {
    ALL.iter().filter(|k| which(k)).map(|k| k.names.len()).sum()
}

/// Every plain map (a registry entry with [`Kernel::map`]: `map0`, `map1`, `map2` in
/// `common.cuh`) moves whole packs: in the PTX, each array it reads or writes has one
/// vector access (`ld.global.v2/v4`, `st.global.v2/v4`: 8 or 16 bytes) besides the scalar
/// tail. A change that loses the packs' alignment would make the compiler fall back to
/// 2- and 4-byte accesses, which on an H100 cannot keep its memory busy.
#[test]
fn the_plain_maps_read_and_write_whole_packs() {
    if !nvrtc_present() {
        return;
    }
    let maps = registered_bodies(|k| k.map.is_some());
    for (kernel, name, body) in &maps {
        let arrays = kernel.map.unwrap_or_default();
        let vector = ["ld.global.v2", "ld.global.v4", "st.global.v2", "st.global.v4"]
            .iter()
            .map(|op| body.matches(op).count())
            .sum::<usize>();
        assert_eq!(vector, arrays, "{name}: {vector} vector accesses for {arrays} arrays");
    }
    assert_eq!(maps.len(), registered_instances(|k| k.map.is_some()), "plain maps checked");
    assert!(!maps.is_empty(), "no plain map registered");
}

/// The grid-stride kernels that split an element index into coordinates (bias and row
/// broadcasts, batch norm's elementwise parts, pooling, the embedding's gather, permute,
/// cross-entropy's gradient): every kernel that takes a [`Param::Div`]. They divide with
/// `Div` (`common.cuh`): a 64-bit `/` or `%` is a software routine on a GPU, dozens of
/// instructions per element, more than the memory time of an elementwise kernel on an H100.
fn divides(kernel: &Kernel) -> bool {
    kernel.params.contains(&Param::Div)
}

/// Those kernels' PTX has no 64-bit division or remainder, and the high multiply of `Div`.
#[test]
fn indexed_kernels_divide_by_multiplying() {
    if !nvrtc_present() {
        return;
    }
    let dividing = registered_bodies(divides);
    for (_, name, body) in &dividing {
        for op in ["div.u64", "rem.u64", "div.s64", "rem.s64"] {
            assert!(!body.contains(op), "{name} has a 64-bit division ({op})");
        }
        assert!(body.contains("mul.hi.u64"), "{name} divides without Div");
    }
    assert_eq!(dividing.len(), registered_instances(divides), "dividing kernels checked");
    assert!(!dividing.is_empty(), "no dividing kernel registered");
}

/// No kernel adds with atomics: every sum is added by one thread, or one block, in a fixed
/// order, so two runs of the same op give the same bits (checkpointed and plain backward
/// passes agree exactly; PyTorch needs `torch.use_deterministic_algorithms` for that). Float
/// atomics add in whatever order the threads arrive: `atom.` and `red.` must not appear in
/// any module's PTX.
#[test]
fn no_kernel_adds_with_atomics() {
    if !nvrtc_present() {
        return;
    }
    let mut kernels = 0;
    for module in MODULES {
        for (name, body) in kernel_bodies(module.name) {
            for line in body.lines() {
                // An instruction, after its predicate (`@%p1 atom.global.add.f32 ...`).
                let line = line.trim();
                let line = match line.strip_prefix('@') {
                    Some(rest) => rest.split_once(char::is_whitespace).map_or("", |(_, i)| i),
                    None => line,
                };
                let op = line.split_whitespace().next().unwrap_or("");
                assert!(
                    !op.starts_with("atom.") && !op.starts_with("red."),
                    "{name} uses an atomic: {line}"
                );
            }
            kernels += 1;
        }
    }
    assert_eq!(kernels, registered_instances(|_| true), "kernels found in the PTX");
}

/// The depthwise weight gradient keeps its 7 x 7 tap sums in registers: after unrolling,
/// every index into its array is a constant, so its PTX has no local-memory frame
/// (`__local_depot`, `ld.local`/`st.local`), which a loop the compiler could not unroll
/// would bring back (an array indexed at run time lives in local memory).
#[test]
fn the_depthwise_weight_gradient_keeps_its_taps_in_registers() {
    if !nvrtc_present() {
        return;
    }
    let bodies = registered_bodies(|k| k.names == DEPTHWISE_BWD_WEIGHT.names);
    for (_, name, body) in &bodies {
        for local in ["__local_depot", "ld.local", "st.local"] {
            assert!(!body.contains(local), "{name} uses local memory ({local})");
        }
    }
    assert_eq!(bodies.len(), DEPTHWISE_BWD_WEIGHT.names.len(), "depthwise weight gradients");
}

/// The 16-bit attention kernels on tensor cores: forward, dK/dV and dQ, in f16 and bf16, for
/// heads up to 128 and (`_d64`) up to 64.
const TENSOR_CORE_ATTENTION: [&Kernel; 12] = [
    &ATTENTION_FWD_MMA_F16,
    &ATTENTION_FWD_MMA_BF16,
    &ATTENTION_BWD_DKDV_MMA_F16,
    &ATTENTION_BWD_DKDV_MMA_BF16,
    &ATTENTION_BWD_DQ_MMA_F16,
    &ATTENTION_BWD_DQ_MMA_BF16,
    &ATTENTION_FWD_MMA_D64_F16,
    &ATTENTION_FWD_MMA_D64_BF16,
    &ATTENTION_BWD_DKDV_MMA_D64_F16,
    &ATTENTION_BWD_DKDV_MMA_D64_BF16,
    &ATTENTION_BWD_DQ_MMA_D64_F16,
    &ATTENTION_BWD_DQ_MMA_D64_BF16,
];

/// The 16-bit attention kernels (forward, dK/dV, dQ) multiply on tensor cores (`mma.sync`
/// m16n8k16, 16-bit in, f32 accumulate) in their own dtype; their fragments and
/// accumulators stay in registers (no local-memory frame in the PTX: every index into them
/// is a constant after unrolling).
#[test]
fn the_16_bit_attention_kernels_run_on_tensor_cores_from_registers() {
    if !nvrtc_present() {
        return;
    }
    let bodies = registered_bodies(|k| TENSOR_CORE_ATTENTION.iter().any(|t| t.names == k.names));
    assert_eq!(bodies.len(), TENSOR_CORE_ATTENTION.len(), "the f16 and bf16 tensor-core kernels");
    for (_, name, body) in &bodies {
        let dtype = if name.ends_with("bf16") { "bf16" } else { "f16" };
        let mma = format!("mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32");
        assert!(body.contains(&mma), "{name} has no {mma}");
        for local in ["__local_depot", "ld.local", "st.local"] {
            assert!(!body.contains(local), "{name} uses local memory ({local})");
        }
    }
}

/// ptxas (sm_90, through NVRTC) keeps the tensor-core attention kernels' fragments and
/// accumulators in registers: no spill stores or loads in any of them. The dK/dV kernel for
/// heads up to 128 reads K and V from shared memory instead of holding them as fragments:
/// held, its live state (K and V fragments, dK and dV accumulators, two score tiles: 256
/// registers a thread) passed the 255 a thread may have and ptxas spilled 908 B. The PTX
/// test above cannot see this: spills are ptxas's, after the PTX.
#[test]
fn the_tensor_core_attention_kernels_do_not_spill_on_sm90() {
    if !nvrtc_present() {
        return;
    }
    let module = ATTENTION_FWD_MMA_F16.module;
    let (_, log) = cubin(module, "sm_90", true).unwrap_or_else(|e| panic!("attention.cu: {e}"));
    let resources = ptxas_resources(&log);
    for kernel in TENSOR_CORE_ATTENTION {
        let name = kernel.names[0];
        let &(regs, stores, loads) =
            resources.get(name).unwrap_or_else(|| panic!("{name}: not in ptxas's report:\n{log}"));
        say(&format!(
            "ptxas sm_90: {name}: {regs} registers, {stores} B spill stores, {loads} B spill loads"
        ));
        assert!(regs <= 255, "{name}: {regs} registers");
        assert_eq!((stores, loads), (0, 0), "{name} spills ({stores} B stored, {loads} B loaded)");
    }
}

#[test]
fn ptxas_resource_lines_are_read_per_kernel() {
    let log = "\
ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 252 registers, used 1 barriers, 34816 bytes smem
ptxas info    : Function properties for b
ptxas         .     352 bytes stack frame, 908 bytes spill stores, 3292 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 352 bytes cumulative stack size
";
    let found = ptxas_resources(log);
    assert_eq!(found["a"], (252, 0, 0));
    assert_eq!(found["b"], (255, 908, 3292));
    assert_eq!(found.len(), 2);
}
