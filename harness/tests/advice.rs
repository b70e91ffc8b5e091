//! The report's "What should I do?" section: the decomposition and the ranked techniques
//! agree with first principles on real-size models (virtual device).

use vram_harness::advice;

#[test]
fn the_decomposition_and_the_ranking_follow_first_principles() {
    let a = advice::compute(true).unwrap();
    assert_eq!(a.models.len(), 2);
    for m in &a.models {
        let name = &m.model;
        assert_eq!(m.state_bytes, 16 * m.params, "{name}");
        assert!(m.per_sample_bytes > 0 && m.fixed_bytes > 0, "{name}");
        assert!(m.fixed_share_at_one > m.fixed_share_at_batch, "{name}");
        let base = &m.techniques[0];
        assert!(base.technique.starts_with("baseline") && base.saved_bytes == 0, "{name}");
        // Ranked: most reserved memory saved first (after the baseline).
        let saved: Vec<i64> = m.techniques[1..].iter().map(|r| r.saved_bytes).collect();
        assert!(saved.windows(2).all(|w| w[0] >= w[1]), "{name}: {saved:?}");
        let row = |prefix: &str| m.techniques.iter().find(|r| r.technique.starts_with(prefix));
        // SGD keeps one f32 buffer where AdamW keeps two: about 4 bytes per parameter less
        // at the peak (allocated).
        let sgd = row("SGD").unwrap();
        let per_param = (base.peak_allocated - sgd.peak_allocated) as f64 / m.params as f64;
        assert!((3.0..5.0).contains(&per_param), "{name}: SGD saves {per_param} B/param");
        // 16-bit activations and checkpointing cut the per-sample part.
        for prefix in ["full bf16", "checkpointing, sqrt", "gradient accumulation"] {
            let r = row(prefix).unwrap();
            assert!(r.peak_allocated < base.peak_allocated, "{name}: {prefix}");
        }
        // Recomputation costs time; 16-bit math (assumed twice as fast) saves it.
        assert!(row("checkpointing, sqrt").unwrap().relative_cost > 1.0, "{name}");
        assert!(row("full bf16").unwrap().relative_cost < 1.0, "{name}");
        // Autocast applies to both (16-bit matmuls and convolutions); it saves less than
        // full bf16 (f32 weights and gradients, 16-bit copies, f32 norms and softmax).
        let ac = row("bf16 autocast").unwrap_or_else(|| panic!("{name}: autocast row missing"));
        let full = row("full bf16").unwrap();
        assert!(full.peak_allocated < ac.peak_allocated, "{name}");
        assert!(ac.peak_allocated < base.peak_allocated, "{name}");
    }
    let md = advice::markdown(&a);
    assert!(md.starts_with("## What should I do?") && md.contains("| gpt2-small"), "{md}");
}
