//! `memory_summary()`: the statistics in the layout of `torch.cuda.memory_summary()`, line
//! for line: the same rules, row names, column widths and unit rules, with only the title
//! naming vram and the device instead of "PyTorch CUDA memory summary, device ID 0".
//!
//! PyTorch's layout (`torch/cuda/memory.py`): every line is `|` + 75 characters + `|`.
//! Each metric has an "all" row and a large-pool and a small-pool row; a column's unit (B,
//! KiB, MiB, ... for bytes; none, K, M for counts) is chosen from that column's "all" value
//! and applied to the three rows, stepping up while the reference is at least 768 KiB
//! (750 thousand for counts), with values floor-divided. The two oversize rows follow their
//! own rule and choose units from their own values.

use crate::stats::{MemoryStats, Stat, StatArray};

/// Characters between the outer bars.
const WIDTH: usize = 75;

/// Where PyTorch's title text starts: after `" {_:16} "`.
const TITLE_INDENT: usize = 18;

/// Renders the statistics in the layout of `torch.cuda.memory_summary()`.
pub(crate) fn render(stats: &MemoryStats, device: &str) -> String {
    let mut lines: Vec<String> = Vec::new();
    lines.push("=".repeat(WIDTH));
    lines.push(title(device));
    lines.push("-".repeat(WIDTH));
    lines.push(format!(
        "  {:9} CUDA OOMs: {:<12} | {:6} cudaMalloc retries: {:<8}  ",
        "", stats.num_ooms, "", stats.num_alloc_retries
    ));
    lines.push("=".repeat(WIDTH));
    lines
        .push("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".into());

    let metrics: [(&str, &StatArray, Formatter); 9] = [
        ("Allocated memory", &stats.allocated_bytes, format_size),
        ("Active memory", &stats.active_bytes, format_size),
        ("Requested memory", &stats.requested_bytes, format_size),
        ("GPU reserved memory", &stats.reserved_bytes, format_size),
        ("Non-releasable memory", &stats.inactive_split_bytes, format_size),
        ("Allocations", &stats.allocation, format_count),
        ("Active allocs", &stats.active, format_count),
        ("GPU reserved segments", &stats.segment, format_count),
        ("Non-releasable allocs", &stats.inactive_split, format_count),
    ];
    for (name, a, fmt) in metrics {
        lines.push("-".repeat(WIDTH));
        // Units come from the "all" row, column by column.
        let reference = &a.all;
        for (label, st) in [
            (name, &a.all),
            ("      from large pool", &a.large_pool),
            ("      from small pool", &a.small_pool),
        ] {
            lines.push(row(label, st, reference, fmt));
        }
    }
    for (name, st) in [
        ("Oversize allocations", &stats.oversize_allocations),
        ("Oversize GPU segments", &stats.oversize_segments),
    ] {
        lines.push("-".repeat(WIDTH));
        lines.push(row(name, st, st, format_count));
    }
    lines.push("=".repeat(WIDTH));

    let mut s = String::with_capacity(lines.len() * (WIDTH + 3));
    for line in lines {
        s.push('|');
        s.push_str(&line);
        s.push_str("|\n");
    }
    s
}

/// The title line: where PyTorch writes "PyTorch CUDA memory summary, device ID 0", vram writes
/// "vram-alloc memory summary, " and the device (moved left, then cut, to fit 75 columns).
pub(crate) fn title(device: &str) -> String {
    let text: String = format!("vram-alloc memory summary, {device}");
    let len = text.chars().count();
    let indent = TITLE_INDENT.min(WIDTH.saturating_sub(len)).max(1);
    let text: String = text.chars().take(WIDTH - 1 - indent).collect();
    format!("{:indent$}{text:<width$} ", "", width = WIDTH - 1 - indent)
}

type Formatter = fn(i64, i64) -> String;

fn row(name: &str, st: &Stat, reference: &Stat, fmt: Formatter) -> String {
    format!(
        " {name:<21} | {} | {} | {} | {} ",
        fmt(st.current, reference.current),
        fmt(st.peak, reference.peak),
        fmt(st.allocated as i64, reference.allocated as i64),
        fmt(st.freed as i64, reference.freed as i64),
    )
}

/// PyTorch's `_format_size`: `{sz:6d} {prefix}`, the prefix stepping up (and `sz` floor-divided
/// by 1024) while the reference is at least 768 KiB.
fn format_size(mut v: i64, reference: i64) -> String {
    const PREFIXES: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut prefix = PREFIXES[0];
    let mut r = reference as f64;
    for p in &PREFIXES[1..] {
        if r < 768.0 * 1024.0 {
            break;
        }
        prefix = p;
        v = v.div_euclid(1024);
        r /= 1024.0;
    }
    format!("{v:6} {prefix}")
}

/// PyTorch's `_format_count`: `{cnt:7d} {prefix} `, stepping up (and floor-dividing by 1000)
/// while the reference is at least 750 thousand.
fn format_count(mut v: i64, reference: i64) -> String {
    const PREFIXES: [&str; 3] = [" ", "K", "M"];
    let mut prefix = PREFIXES[0];
    let mut r = reference as f64;
    for p in &PREFIXES[1..] {
        if r < 750.0 * 1000.0 {
            break;
        }
        prefix = p;
        v = v.div_euclid(1000);
        r /= 1000.0;
    }
    format!("{v:7} {prefix} ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::path::Path;

    fn stat(current: i64, peak: i64, allocated: u64, freed: u64) -> Stat {
        Stat { current, peak, allocated, freed }
    }

    /// Large pool `l`, small pool `s`, "all" their sum.
    fn pools(l: Stat, s: Stat) -> StatArray {
        let all = stat(
            l.current + s.current,
            l.peak.max(s.peak).max(l.current + s.current),
            l.allocated + s.allocated,
            l.freed + s.freed,
        );
        StatArray { all, large_pool: l, small_pool: s }
    }

    /// The statistics the golden files were made from (`tests/golden/summary_*`).
    fn golden_states() -> Vec<(&'static str, MemoryStats)> {
        const KIB: i64 = 1 << 10;
        const MIB: i64 = 1 << 20;
        const GIB: i64 = 1 << 30;
        let b = |c: i64, p: i64, a: i64, f: i64| stat(c, p, a as u64, f as u64);
        let empty = MemoryStats { max_split_size: -1, ..MemoryStats::default() };

        // One 3 MiB and one 1000-byte allocation: KiB and bytes.
        let mut small = empty.clone();
        small.allocated_bytes = pools(b(3 * MIB, 3 * MIB, 3 * MIB, 0), b(1024, 1024, 1536, 512));
        small.requested_bytes = pools(b(3 * MIB, 3 * MIB, 3 * MIB, 0), b(1000, 1000, 1500, 500));
        small.active_bytes = small.allocated_bytes;
        small.reserved_bytes =
            pools(b(20 * MIB, 20 * MIB, 20 * MIB, 0), b(2 * MIB, 2 * MIB, 2 * MIB, 0));
        small.inactive_split_bytes = pools(
            b(17 * MIB, 17 * MIB, 17 * MIB, 0),
            b(2 * MIB - 1024, 2 * MIB - 512, 4 * MIB, 2 * MIB),
        );
        small.allocation = pools(b(1, 1, 1, 0), b(1, 1, 2, 1));
        small.active = small.allocation;
        small.segment = pools(b(1, 1, 1, 0), b(1, 1, 1, 0));
        small.inactive_split = pools(b(1, 1, 1, 0), b(1, 1, 2, 1));
        small.num_device_alloc = 2;

        // Tens of GiB in the large pool, KiB in the small pool: the small pool's rows take
        // the "all" row's unit, and current, peak, totals each choose their own.
        let mut gib = empty.clone();
        gib.allocated_bytes = pools(
            b(37 * GIB + 5 * MIB, 61 * GIB, 900 * GIB, 863 * GIB),
            b(700 * KIB, 900 * KIB, 5 * GIB, 5 * GIB),
        );
        gib.requested_bytes = pools(
            b(37 * GIB, 60 * GIB + 3, 899 * GIB, 862 * GIB),
            b(650 * KIB, 800 * KIB, 4 * GIB, 4 * GIB),
        );
        gib.active_bytes = gib.allocated_bytes;
        gib.reserved_bytes =
            pools(b(64 * GIB, 70 * GIB, 140 * GIB, 76 * GIB), b(40 * MIB, 40 * MIB, 40 * MIB, 0));
        gib.inactive_split_bytes =
            pools(b(700 * MIB, 3 * GIB, 80 * GIB, 79 * GIB), b(500, 3 * MIB, GIB, GIB));
        gib.allocation = pools(b(1200, 1900, 700_000, 698_800), b(340, 800, 80_000, 79_660));
        gib.active = gib.allocation;
        gib.segment = pools(b(30, 41, 900, 870), b(20, 20, 20, 0));
        gib.inactive_split = pools(b(12, 60, 90_000, 89_988), b(3, 9, 700, 697));
        gib.num_device_alloc = 920;
        gib.num_device_free = 870;

        // After out-of-memory errors and retries, in MiB.
        let mut ooms = small.clone();
        ooms.allocated_bytes =
            pools(b(700 * MIB, 900 * MIB, 4 * GIB, 4 * GIB - 200 * MIB), b(MIB, MIB, MIB, 0));
        ooms.requested_bytes =
            pools(b(699 * MIB, 899 * MIB, 4 * GIB, 4 * GIB - 201 * MIB), b(MIB - 7, MIB, MIB, 7));
        ooms.reserved_bytes = pools(
            b(1000 * MIB, 1020 * MIB, 2 * GIB, GIB + 24 * MIB),
            b(2 * MIB, 2 * MIB, 2 * MIB, 0),
        );
        ooms.num_ooms = 3;
        ooms.num_alloc_retries = 12;
        ooms.num_sync_all_streams = 12;

        // Oversize rows, and counts and bytes large enough for K, M, TiB and PiB.
        let mut oversize = gib.clone();
        oversize.max_split_size = 256 * MIB;
        oversize.oversize_allocations = b(3, 17, 800_000, 799_997);
        oversize.oversize_segments = b(2, 9, 1_500_000_000, 1_499_999_998);
        oversize.allocation =
            pools(b(760_000, 2_000_000, 3_000_000_000, 2_999_240_000), b(1, 2, 5, 4));
        oversize.allocated_bytes = pools(
            b(3 * (1 << 40), 5 * (1 << 50), 7 * (1 << 50), 7 * (1 << 50) - 3 * (1 << 40)),
            b(0, 0, 0, 0),
        );
        oversize.num_ooms = 1_234_567;
        oversize.num_alloc_retries = 123_456_789;

        vec![
            ("empty", empty),
            ("small", small),
            ("gib", gib),
            ("ooms", ooms),
            ("oversize", oversize),
        ]
    }

    /// Renders each golden state and compares it with what PyTorch's `memory_summary` made of
    /// the same statistics (`tests/golden/make_summary_golden.py`), the title line aside.
    #[test]
    fn matches_pytorchs_memory_summary_line_for_line() {
        const DEVICE: &str = "virtual memory (80.00 GiB)";
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
        for (name, stats) in golden_states() {
            let stats_path = dir.join(format!("summary_{name}.stats.json"));
            let map = stats.to_map();
            if std::env::var_os("VRAM_WRITE_GOLDEN_STATS").is_some() {
                std::fs::write(&stats_path, serde_json::to_string_pretty(&map).unwrap()).unwrap();
            }
            let committed: BTreeMap<String, i64> =
                serde_json::from_str(&std::fs::read_to_string(&stats_path).unwrap()).unwrap();
            assert_eq!(committed, map, "{} holds these statistics", stats_path.display());
            let golden = std::fs::read_to_string(dir.join(format!("summary_{name}.txt"))).unwrap();
            let pytorch_title = golden.lines().nth(1).unwrap();
            assert!(
                pytorch_title
                    .starts_with(&format!("|{:18}PyTorch CUDA memory summary, device ID 0", "")),
                "{pytorch_title:?}"
            );
            let expected = golden.replacen(pytorch_title, &format!("|{}|", title(DEVICE)), 1);
            let ours = render(&stats, DEVICE);
            for (i, (a, b)) in ours.lines().zip(expected.lines()).enumerate() {
                assert_eq!(
                    a,
                    b,
                    "{name}: line {} differs\nours:\n{ours}\nPyTorch:\n{golden}",
                    i + 1
                );
            }
            assert_eq!(ours, expected, "{name}");
        }
    }

    #[test]
    fn units_follow_pythons_rules() {
        assert_eq!(format_size(512, 512), "   512 B  ");
        assert_eq!(format_size(20 << 20, 20 << 20), " 20480 KiB");
        assert_eq!(format_size(1 << 20, 20 << 30), "     1 MiB");
        assert_eq!(format_size(1 << 20, 1 << 40), "     0 GiB");
        assert_eq!(format_size(-1, 1 << 30), "    -1 MiB", "floor division, as Python's //");
        assert_eq!(format_count(3, 3), "      3   ");
        assert_eq!(format_count(800_000, 800_000), "    800 K ");
        assert_eq!(format_count(999, 800_000_000), "      0 M ");
    }

    #[test]
    fn title_fits_75_columns() {
        for device in
            ["virtual memory (8.00 GiB)", "NVIDIA H100 80GB HBM3 (79.19 GiB)", &"x".repeat(90)]
        {
            let t = title(device);
            assert_eq!(t.chars().count(), WIDTH, "{t:?}");
            assert!(t.starts_with(' ') && t.ends_with(' '));
        }
        assert_eq!(title("virtual memory (8.00 GiB)").find('v'), Some(TITLE_INDENT));
    }
}
