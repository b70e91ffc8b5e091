//! `AllocatorConfig::parse` accepts what PyTorch's allocator-config parser accepts
//! (`c10/core/AllocatorConfig.cpp`, `c10/cuda/CUDAAllocatorConfig.cpp`), with PyTorch's
//! expectations from `c10/test/core/AllocatorConfig_test.cpp`, rejects what it rejects (and
//! what would overflow later) with errors that name the key, and prints configs that parse
//! back to themselves.

use proptest::prelude::*;
use vram_alloc::{AllocatorConfig, LARGE_BUFFER};

const MB: usize = 1 << 20;

fn parse(text: &str) -> AllocatorConfig {
    AllocatorConfig::parse(text).unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
}

#[test]
fn pytorch_allocator_config_test_example() {
    let c = parse(
        "max_split_size_mb:40,\
         max_non_split_rounding_mb:30,\
         garbage_collection_threshold:0.5,\
         roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],\
         expandable_segments:True,\
         pinned_use_background_threads:True",
    );
    assert_eq!(c.max_split_size(), 40 * MB);
    assert_eq!(c.max_non_split_rounding_size(), 30 * MB);
    assert_eq!(c.garbage_collection_threshold(), Some(0.5));
    for (mb, divisions) in
        [(32, 8), (64, 8), (128, 2), (256, 4), (512, 2), (1024, 4), (2048, 1), (4096, 1), (8192, 1)]
    {
        assert_eq!(c.roundup_power2_divisions(mb * MB), divisions, "{mb} MiB");
    }
    // Below the first interval and past the last one.
    assert_eq!(c.roundup_power2_divisions(512), 8);
    assert_eq!(c.roundup_power2_divisions(1 << 40), 1);
    assert!(c.expandable_segments());
    assert!(c.rounds_to_power2_divisions());
    assert_eq!(c.notes().len(), 1, "{:?}", c.notes());
}

#[test]
fn pytorch_large_segment_size_example() {
    let c = parse(
        "large_segment_size_mb:15,max_split_size_mb:20,max_non_split_rounding_mb:40,\
         garbage_collection_threshold:0.8",
    );
    assert_eq!(c.large_segment_size(), 15 * MB);
    assert_eq!(c.max_split_size(), 20 * MB);
    assert_eq!(c.max_non_split_rounding_size(), 40 * MB);
    assert_eq!(c.garbage_collection_threshold(), Some(0.8));
    // The large segment size lowers the minimum of max_split_size_mb and is the default of
    // max_non_split_rounding_mb.
    let c = parse("large_segment_size_mb:12,max_split_size_mb:12");
    assert_eq!(c.max_split_size(), 12 * MB);
    assert_eq!(c.max_non_split_rounding_size(), 12 * MB);
    assert!(c.notes().iter().any(|n| n.starts_with("large_segment_size_mb:")));
}

#[test]
fn pytorch_roundup_list_example_with_zero_and_gaps() {
    let c = parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
    for (mb, divisions) in
        [(64, 8), (128, 8), (256, 16), (512, 1), (1024, 0), (2048, 8), (4096, 2), (1 << 20, 2)]
    {
        assert_eq!(c.roundup_power2_divisions(mb * MB), divisions, "{mb} MiB");
    }
}

#[test]
fn pytorch_single_value_and_trailing_comma_examples() {
    let c = parse("roundup_power2_divisions:4");
    for mb in [1, 64, 256, 2048, 1 << 20] {
        assert_eq!(c.roundup_power2_divisions(mb * MB), 4);
    }
    assert!(!parse("expandable_segments:False,").expandable_segments());
    let c = parse("roundup_power2_divisions:[64:8,128:2,],");
    assert_eq!(c.roundup_power2_divisions(64 * MB), 8);
    assert_eq!(c.roundup_power2_divisions(200 * MB), 2);
    assert_eq!(c.roundup_power2_divisions(300 * MB), 0);
    assert_eq!(parse("roundup_power2_divisions:[]"), AllocatorConfig::default());
}

#[test]
fn sixteen_intervals_from_1_mib_to_32_gib_and_beyond() {
    // Interval i gets 2^i divisions.
    let list: Vec<String> = (0..16).map(|i| format!("{}:{}", 1usize << i, 1usize << i)).collect();
    let c = parse(&format!("roundup_power2_divisions:[{}]", list.join(",")));
    for i in 0..16 {
        let start = MB << i;
        assert_eq!(c.roundup_power2_divisions(start), 1 << i, "start of interval {i}");
        assert_eq!(c.roundup_power2_divisions(2 * start - 1), 1 << i, "end of interval {i}");
    }
    assert_eq!(c.roundup_power2_divisions(1), 1, "sizes under 1 MiB use the first interval");
    assert_eq!(c.roundup_power2_divisions(MB - 1), 1);
    assert_eq!(c.roundup_power2_divisions(32 << 30), 1 << 15, "32 GiB starts the last");
    assert_eq!(c.roundup_power2_divisions(64 << 30), 1 << 15, "there is no 17th interval");
    assert_eq!(c.roundup_power2_divisions(usize::MAX), 1 << 15);
    // An interval start past 32 GiB lands in the last interval, as PyTorch clamps it.
    let c = parse("roundup_power2_divisions:[1:1,1048576:4]");
    assert_eq!(c.roundup_power2_divisions(40 << 30), 4);
    assert_eq!(c.roundup_power2_divisions(16 << 30), 0, "gaps between entries stay 0");
    // `>` before any interval fills every interval but the first, as in PyTorch.
    let c = parse("roundup_power2_divisions:[>:4]");
    assert_eq!(c.roundup_power2_divisions(MB), 0);
    assert_eq!(c.roundup_power2_divisions(2 * MB), 4);
}

#[test]
fn whitespace_anywhere_is_ignored_as_in_pytorch() {
    let c = parse(" max_split _size_mb : 1 28 ,\texpandable_segments:\nTrue ");
    assert_eq!(c.max_split_size(), 128 * MB);
    assert!(c.expandable_segments());
}

#[test]
fn pytorch_keys_without_effect_are_kept_printed_and_explained() {
    let text = "backend:native,release_lock_on_cudamalloc:True,\
                pinned_use_cuda_host_register:True,pinned_num_register_threads:8,\
                pinned_use_background_threads:False,pinned_reserve_segment_size_mb:64,\
                pinned_free_catch_all:True,graph_capture_record_stream_reuse:True,\
                throw_on_cudamalloc_oom:False,expandable_segments_reserve:40G,\
                expandable_segments_reserve_by_class:[serving:0.5,loading:40G]";
    let c = parse(text);
    let notes = c.notes();
    assert_eq!(notes.len(), 11, "{notes:#?}");
    for key in [
        "backend",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "pinned_free_catch_all",
        "graph_capture_record_stream_reuse",
        "throw_on_cudamalloc_oom",
        "expandable_segments_reserve",
        "expandable_segments_reserve_by_class",
    ] {
        assert!(notes.iter().any(|n| n.starts_with(&format!("{key}: "))), "no note for {key}");
        assert!(c.to_string().contains(&format!("{key}:")), "{key} not printed in {c}");
    }
    assert!(notes.iter().any(|n| n.contains("pinned host buffers do not come from")));
    assert_eq!(parse(&c.to_string()), c);
    // The defaults are untouched.
    assert_eq!(c.max_split_size(), usize::MAX);
    assert!(!c.rounds_to_power2_divisions());
    assert!(AllocatorConfig::default().notes().is_empty());
    assert!(parse("max_split_size_mb:64,expandable_segments:True").notes().is_empty());
}

#[test]
fn rocm_spellings_are_the_same_keys() {
    let c = parse("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:False");
    assert_eq!(c, parse("release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:False"));
    assert_eq!(
        c.to_string(),
        "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:False"
    );
}

#[test]
fn builders_validate_as_the_parser_does() {
    let d = AllocatorConfig::default;
    assert_eq!(d().max_non_split_rounding_size(), LARGE_BUFFER);
    assert_eq!(d().large_segment_size(), LARGE_BUFFER);
    // PyTorch's minimum for max_split_size_mb is the large segment size, inclusive.
    assert_eq!(d().with_max_split_size(Some(20 * MB)).unwrap().max_split_size(), 20 * MB);
    assert!(d().with_max_split_size(Some(19 * MB)).is_err());
    assert!(d().with_max_split_size(Some(20 * MB + 1)).is_err(), "whole MiB only");
    assert_eq!(d().with_max_split_size(None).unwrap().max_split_size(), usize::MAX);
    let c = d().with_max_non_split_rounding_mb(Some(64)).unwrap();
    assert_eq!(c.max_non_split_rounding_size(), 64 * MB);
    assert_eq!(c.to_string(), "max_non_split_rounding_mb:64");
    assert_eq!(parse("max_non_split_rounding_mb:64"), c);
    assert!(d().with_max_non_split_rounding_mb(Some(19)).is_err());
    assert!(d().with_max_non_split_rounding_mb(Some(usize::MAX)).is_err());
    assert_eq!(c.with_max_non_split_rounding_mb(None).unwrap(), d());
    assert!(d().with_roundup_power2_divisions(0).is_ok());
    assert!(d().with_roundup_power2_divisions(3).is_err());
    assert!(d().with_roundup_power2_divisions(1 << 54).is_ok());
    assert!(d().with_roundup_power2_divisions(1 << 55).is_err());
    assert!(d().with_garbage_collection_threshold(Some(f64::NAN)).is_err());
    assert!(d().with_memory_fraction(Some(f64::INFINITY)).is_err());
}

#[test]
fn largest_sizes_that_fit_are_accepted() {
    let max_mb = usize::MAX / MB;
    let c = parse(&format!("max_split_size_mb:{max_mb},max_non_split_rounding_mb:{max_mb}"));
    assert_eq!(c.max_split_size(), max_mb * MB);
    assert_eq!(c.max_non_split_rounding_size(), max_mb * MB);
    assert_eq!(parse(&c.to_string()), c);
    let c = parse("roundup_power2_divisions:18014398509481984"); // 2^54
    assert_eq!(c.roundup_power2_divisions(MB), 1 << 54);
}

/// Every rejected setting: the text, the key the error names, and words the message holds.
const REJECTED: &[(&str, &str, &str)] = &[
    // roundup_power2_divisions
    ("roundup_power2_divisions:0", "roundup_power2_divisions", "power of 2"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions", "power of 2"),
    ("roundup_power2_divisions:[64:3]", "roundup_power2_divisions", "power of 2, or 0"),
    ("roundup_power2_divisions:[300:2]", "roundup_power2_divisions", "powers of 2 (in MiB)"),
    ("roundup_power2_divisions:[0:2]", "roundup_power2_divisions", "powers of 2 (in MiB)"),
    ("roundup_power2_divisions:36028797018963968", "roundup_power2_divisions", "at most"),
    ("roundup_power2_divisions:[64:36028797018963968]", "roundup_power2_divisions", "overflow"),
    ("roundup_power2_divisions:9223372036854775808", "roundup_power2_divisions", "at most"),
    ("roundup_power2_divisions:-4", "roundup_power2_divisions", "whole number"),
    ("roundup_power2_divisions:4x", "roundup_power2_divisions", "whole number"),
    ("roundup_power2_divisions:[64:8", "roundup_power2_divisions", "missing `]`"),
    ("roundup_power2_divisions:[64]", "roundup_power2_divisions", "`<a>:<b>`"),
    ("roundup_power2_divisions:[,64:8]", "roundup_power2_divisions", "unexpected `,`"),
    ("roundup_power2_divisions:[64:8:2]", "roundup_power2_divisions", "`,` or `]`"),
    ("roundup_power2_divisions:[x:8]", "roundup_power2_divisions", "whole number of MiB"),
    ("roundup_power2_divisions:[64:x]", "roundup_power2_divisions", "whole number"),
    // sizes in MiB
    ("max_split_size_mb:19", "max_split_size_mb", "at least 20"),
    ("max_split_size_mb:0", "max_split_size_mb", "at least 20"),
    ("max_split_size_mb:17592186044416", "max_split_size_mb", "overflows"),
    ("max_split_size_mb:18446744073709551616", "max_split_size_mb", "whole number"),
    ("max_split_size_mb:128MB", "max_split_size_mb", "whole number"),
    ("max_split_size_mb:-1", "max_split_size_mb", "whole number"),
    ("max_split_size_mb:ten", "max_split_size_mb", "whole number"),
    ("max_split_size_mb:[64:1]", "max_split_size_mb", "not a list"),
    ("max_split_size_mb:[40]", "max_split_size_mb", "`<a>:<b>`"),
    ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb", "at least 20"),
    ("max_non_split_rounding_mb:17592186044416", "max_non_split_rounding_mb", "overflows"),
    ("large_segment_size_mb:10", "large_segment_size_mb", "more than 10"),
    ("large_segment_size_mb:17592186044416", "large_segment_size_mb", "overflows"),
    ("large_segment_size_mb:30,max_split_size_mb:25", "max_split_size_mb", "at least 30"),
    ("max_split_size_mb:25,large_segment_size_mb:30", "max_split_size_mb", "at least 30"),
    ("max_split_size_mb:20,large_segment_size_mb:25", "max_split_size_mb", "at least 25"),
    ("large_segment_size_mb:30,max_non_split_rounding_mb:25", "max_non_split_rounding_mb", "30"),
    ("pinned_reserve_segment_size_mb:0", "pinned_reserve_segment_size_mb", "more than 0"),
    ("pinned_reserve_segment_size_mb:17592186044416", "pinned_reserve_segment_size_mb", "overflow"),
    // fractions
    ("garbage_collection_threshold:0", "garbage_collection_threshold", "greater than 0"),
    ("garbage_collection_threshold:1", "garbage_collection_threshold", "less than 1"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold", "less than 1"),
    ("garbage_collection_threshold:-0.5", "garbage_collection_threshold", "greater than 0"),
    ("garbage_collection_threshold:nan", "garbage_collection_threshold", "less than 1"),
    ("garbage_collection_threshold:0.5x", "garbage_collection_threshold", "a number"),
    ("per_process_memory_fraction:1.2", "per_process_memory_fraction", "[0, 1]"),
    ("per_process_memory_fraction:-0.1", "per_process_memory_fraction", "[0, 1]"),
    ("per_process_memory_fraction:NaN", "per_process_memory_fraction", "[0, 1]"),
    ("per_process_memory_fraction:inf", "per_process_memory_fraction", "[0, 1]"),
    // flags: only PyTorch's two spellings
    ("expandable_segments:true", "expandable_segments", "True or False"),
    ("expandable_segments:1", "expandable_segments", "True or False"),
    ("expandable_segments:yes", "expandable_segments", "True or False"),
    ("release_lock_on_cudamalloc:false", "release_lock_on_cudamalloc", "True or False"),
    ("pinned_use_background_threads:1", "pinned_use_background_threads", "True or False"),
    ("pinned_use_hip_host_register:on", "pinned_use_hip_host_register", "True or False"),
    ("graph_capture_record_stream_reuse:T", "graph_capture_record_stream_reuse", "True or"),
    ("pinned_free_catch_all:0", "pinned_free_catch_all", "True or False"),
    ("throw_on_cudamalloc_oom:true", "throw_on_cudamalloc_oom", "True or False"),
    // pinned register threads: powers of two up to 128
    ("pinned_num_register_threads:3", "pinned_num_register_threads", "power of 2 from 1 to 128"),
    ("pinned_num_register_threads:0", "pinned_num_register_threads", "power of 2"),
    ("pinned_num_register_threads:256", "pinned_num_register_threads", "to 128"),
    // backend
    ("backend:cudaMallocAsync", "backend", "only PyTorch's native"),
    ("backend:hipMallocAsync", "backend", "native"),
    ("backend:magic", "backend", "unknown allocator backend"),
    // keys
    ("colour:blue", "colour", "unknown key"),
    ("expandible_segments:True", "expandible_segments", "expandable_segments"),
    ("max_split_size_mb:40,max_split_size_mb:60", "max_split_size_mb", "given twice"),
    (
        "release_lock_on_cudamalloc:True,release_lock_on_hipmalloc:False",
        "release_lock_on_hipmalloc",
        "also as `release_lock_on_cudamalloc`",
    ),
    // structure
    ("expandable_segments", "expandable_segments", "key:value"),
    ("expandable_segments:", "expandable_segments", "a value"),
    ("max_split_size_mb", "max_split_size_mb", "key:value"),
    ("max_split_size_mb:40:expandable_segments:True", "max_split_size_mb", "expected `,`"),
    ("max_split_size_mb:40 expandable_segments:True", "max_split_size_mb", "expected `,`"),
    (",max_split_size_mb:40", ",", "leading comma"),
    ("max_split_size_mb:40,,expandable_segments:True", ",", "two in a row"),
    (",", ",", "key:value"),
    ("expandable_segments_reserve_by_class:0.5", "expandable_segments_reserve_by_class", "list"),
    ("expandable_segments_reserve:[a:1]", "expandable_segments_reserve", "not a list"),
    ("[a:1]", "[", "key:value"),
];

#[test]
fn each_rejected_setting_names_its_key_and_says_what_is_accepted() {
    for &(text, key, needle) in REJECTED {
        let err = match AllocatorConfig::parse(text) {
            Ok(c) => panic!("{text:?} should be rejected, parsed as {c:?}"),
            Err(e) => e,
        };
        assert_eq!(err.key, key, "{text:?} gave {err}");
        let message = err.to_string();
        assert!(message.contains(needle), "{text:?} gave {message:?}, expected {needle:?}");
        assert!(message.contains(&format!("`{key}`")), "{message:?} names the key");
    }
}

/// One valid setting, as text, for a random config.
fn setting() -> impl Strategy<Value = Vec<String>> {
    let power = |max: u32| (0..=max).prop_map(|k| 1usize << k);
    let flag = || any::<bool>().prop_map(|b| if b { "True" } else { "False" });
    let divisions_list = prop::collection::vec(
        (prop_oneof![3 => (0u32..=20).prop_map(|k| (1usize << k).to_string()), 1 => Just(">".to_string())],
         prop_oneof![1 => Just(0usize), 4 => power(54)]),
        0..8,
    )
    .prop_map(|entries| {
        let items: Vec<String> = entries.iter().map(|(a, b)| format!("{a}:{b}")).collect();
        format!("[{}]", items.join(","))
    });
    let reserve = "[0-9]{1,3}(\\.[0-9]{1,2})?G?";
    (
        // large_segment_size_mb, and the sizes it bounds
        prop::option::of(11usize..64),
        prop::option::of(prop_oneof![0usize..10_000, Just(usize::MAX / MB - 64)]),
        prop::option::of(prop_oneof![0usize..10_000, Just(usize::MAX / MB - 64)]),
        prop::option::of(prop_oneof![power(54).prop_map(|d| d.to_string()), divisions_list]),
        prop::option::of(prop_oneof![1e-300f64..1.0, Just(0.5), Just(f64::MIN_POSITIVE)]),
        prop::option::of(flag()),
        prop::option::of(prop_oneof![0.0f64..=1.0, Just(0.0), Just(1.0)]),
        (
            any::<bool>(),
            prop::option::of(flag()),
            prop::option::of(flag()),
            prop::option::of(power(7)),
            prop::option::of(flag()),
            prop::option::of(1usize..1 << 20),
            prop::option::of(flag()),
            prop::option::of(flag()),
            prop::option::of(flag()),
            prop::option::of(reserve),
            prop::option::of(prop::collection::vec(("[a-z_]{1,8}", reserve), 0..4)),
        ),
    )
        .prop_map(|(large, split, non_split, divisions, gc, expandable, fraction, compat)| {
            let min = large.unwrap_or(20);
            let mut s = Vec::new();
            if let Some(mb) = large {
                s.push(format!("large_segment_size_mb:{mb}"));
            }
            if let Some(mb) = split {
                s.push(format!("max_split_size_mb:{}", min + mb));
            }
            if let Some(mb) = non_split {
                s.push(format!("max_non_split_rounding_mb:{}", min + mb));
            }
            if let Some(d) = divisions {
                s.push(format!("roundup_power2_divisions:{d}"));
            }
            if let Some(t) = gc {
                s.push(format!("garbage_collection_threshold:{t}"));
            }
            if let Some(b) = expandable {
                s.push(format!("expandable_segments:{b}"));
            }
            if let Some(f) = fraction {
                s.push(format!("per_process_memory_fraction:{f}"));
            }
            let (
                native,
                lock,
                register,
                threads,
                background,
                reserve_mb,
                catch_all,
                graph,
                oom,
                es,
                by_class,
            ) = compat;
            if native {
                s.push("backend:native".into());
            }
            for (key, value) in [
                ("release_lock_on_cudamalloc", lock),
                ("pinned_use_cuda_host_register", register),
                ("pinned_use_background_threads", background),
                ("pinned_free_catch_all", catch_all),
                ("graph_capture_record_stream_reuse", graph),
                ("throw_on_cudamalloc_oom", oom),
            ] {
                if let Some(v) = value {
                    s.push(format!("{key}:{v}"));
                }
            }
            if let Some(n) = threads {
                s.push(format!("pinned_num_register_threads:{n}"));
            }
            if let Some(n) = reserve_mb {
                s.push(format!("pinned_reserve_segment_size_mb:{n}"));
            }
            if let Some(r) = es {
                s.push(format!("expandable_segments_reserve:{r}"));
            }
            if let Some(entries) = by_class {
                let items: Vec<String> = entries.iter().map(|(a, b)| format!("{a}:{b}")).collect();
                s.push(format!("expandable_segments_reserve_by_class:[{}]", items.join(",")));
            }
            s
        })
        .prop_shuffle()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Printing a valid config and parsing the text gives the same config, and printing is
    /// canonical (the same text again).
    #[test]
    fn display_then_parse_gives_the_same_config(settings in setting(), spaced in any::<bool>()) {
        let text = settings.join(if spaced { ", " } else { "," });
        let c = AllocatorConfig::parse(&text).map_err(|e| TestCaseError::fail(format!("{text:?}: {e}")))?;
        let printed = c.to_string();
        prop_assert_eq!(AllocatorConfig::parse(&printed), Ok(c.clone()), "{:?} printed as {:?}", text, printed);
        prop_assert_eq!(AllocatorConfig::parse(&printed).unwrap().to_string(), printed);
    }

    /// The size -> interval mapping: sizes in [2^i MiB, 2^(i+1) MiB) use interval i (clamped
    /// to 0..16), whatever the list says.
    #[test]
    fn sizes_map_to_their_power_of_two_interval(size in 1usize.., k in 0u32..16) {
        let list: Vec<String> = (0..16).map(|i| format!("{}:{}", 1usize << i, 1usize << i)).collect();
        let c = AllocatorConfig::parse(&format!("roundup_power2_divisions:[{}]", list.join(","))).unwrap();
        let expected = (size.ilog2() as usize).saturating_sub(20).min(15);
        prop_assert_eq!(c.roundup_power2_divisions(size), 1 << expected);
        prop_assert_eq!(c.roundup_power2_divisions(MB << k), 1 << k);
    }
}

/// `--conf` in `cargo xtask replay` adds to the recorded settings: the keys given replace
/// the recorded values, the others stay.
#[test]
fn overrides_replace_the_keys_given_and_keep_the_others() {
    let recorded = AllocatorConfig::parse(
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.05,roundup_power2_divisions:[256:1,>:4]",
    )
    .unwrap();
    let tried = recorded
        .with_overrides("garbage_collection_threshold:0.8, expandable_segments:True")
        .unwrap();
    assert_eq!(tried.garbage_collection_threshold(), Some(0.8));
    assert_eq!(tried.memory_fraction(), Some(0.05));
    assert!(tried.expandable_segments());
    assert_eq!(tried.roundup_power2_divisions(1 << 30), 4);
    assert_eq!(recorded.with_overrides("").unwrap(), recorded);
    assert!(recorded.with_overrides("colour:blue").is_err());
    assert!(recorded.with_overrides("expandable_segments:True,expandable_segments:False").is_err());
}

/// Settings PyTorch ignores: garbage collection without a memory fraction, the non-split
/// rounding without a split limit.
#[test]
fn settings_that_do_nothing_in_pytorch_are_named() {
    let gc = AllocatorConfig::parse("garbage_collection_threshold:0.6").unwrap();
    assert_eq!(gc.inert().len(), 1);
    assert!(gc.inert()[0].contains("set_per_process_memory_fraction"), "{:?}", gc.inert());
    assert_eq!(gc.effective(), AllocatorConfig::default());
    let gc_fraction =
        AllocatorConfig::parse("garbage_collection_threshold:0.6,per_process_memory_fraction:0.5")
            .unwrap();
    assert!(gc_fraction.inert().is_empty());
    assert_eq!(gc_fraction.effective(), gc_fraction);
    let rounding = AllocatorConfig::parse("max_non_split_rounding_mb:64").unwrap();
    assert!(rounding.inert()[0].contains("max_split_size_mb"), "{:?}", rounding.inert());
    assert!(AllocatorConfig::default().finer_roundup().is_none());
    let four = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
    assert_eq!(four.finer_roundup().unwrap().roundup_power2_divisions(1 << 30), 8);
}
