//! `memory_summary()`: the statistics as the table PyTorch users know.

use crate::stats::{MemoryStats, Stat, StatArray};
use std::fmt::Write;

const WIDTH: usize = 75;

/// Renders the statistics in the layout of `torch.cuda.memory_summary()`.
pub(crate) fn render(stats: &MemoryStats, device: &str) -> String {
    let rule = |c: char| format!("|{}|\n", c.to_string().repeat(WIDTH));
    let mut s = String::new();
    s += &rule('=');
    let _ = writeln!(s, "|{:^WIDTH$}|", format!("vram-alloc memory summary, {device}"));
    s += &rule('-');
    let left = format!("OOMs: {}", stats.num_ooms);
    let right = format!("device alloc retries: {}", stats.num_alloc_retries);
    let _ = writeln!(s, "|{left:^37}|{right:^37}|");
    s += &rule('=');
    let _ = writeln!(s, "|{:^23}| Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |", "Metric");
    let bytes_rows: [(&str, &StatArray); 5] = [
        ("Allocated memory", &stats.allocated_bytes),
        ("Active memory", &stats.active_bytes),
        ("Requested memory", &stats.requested_bytes),
        ("Device reserved memory", &stats.reserved_bytes),
        ("Non-releasable memory", &stats.inactive_split_bytes),
    ];
    for (name, a) in bytes_rows {
        s += &rule('-');
        section(&mut s, name, a, format_size);
    }
    let count_rows: [(&str, &StatArray); 4] = [
        ("Allocations", &stats.allocation),
        ("Active allocs", &stats.active),
        ("Device reserved segments", &stats.segment),
        ("Non-releasable allocs", &stats.inactive_split),
    ];
    for (name, a) in count_rows {
        s += &rule('-');
        section(&mut s, name, a, format_count);
    }
    s += &rule('-');
    row(&mut s, "Oversize allocations", &stats.oversize_allocations, format_count);
    row(&mut s, "Oversize device segments", &stats.oversize_segments, format_count);
    s += &rule('=');
    s
}

fn section(s: &mut String, name: &str, a: &StatArray, fmt: fn(i64, i64) -> String) {
    row(s, name, &a.all, fmt);
    row(s, "      from large pool", &a.large_pool, fmt);
    row(s, "      from small pool", &a.small_pool, fmt);
}

fn row(s: &mut String, name: &str, st: &Stat, fmt: fn(i64, i64) -> String) {
    let pref = st.peak;
    let _ = writeln!(
        s,
        "| {:<22}| {} | {} | {} | {} |",
        truncate(name, 22),
        fmt(st.current, pref),
        fmt(st.peak, pref),
        fmt(st.allocated as i64, st.allocated as i64),
        fmt(st.freed as i64, st.freed as i64),
    );
}

fn truncate(name: &str, n: usize) -> &str {
    &name[..name.len().min(n)]
}

/// PyTorch's `_format_size`: the unit is chosen from the reference value (the peak).
fn format_size(mut v: i64, reference: i64) -> String {
    const UNITS: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = UNITS[0];
    let mut r = reference as f64;
    for u in &UNITS[1..] {
        if r < 768.0 * 1024.0 {
            break;
        }
        unit = u;
        v /= 1024;
        r /= 1024.0;
    }
    format!("{v:6} {unit}")
}

/// PyTorch's `_format_count`.
fn format_count(mut v: i64, reference: i64) -> String {
    const UNITS: [&str; 3] = [" ", "K", "M"];
    let mut unit = UNITS[0];
    let mut r = reference as f64;
    for u in &UNITS[1..] {
        if r < 750.0 * 1000.0 {
            break;
        }
        unit = u;
        v /= 1000;
        r /= 1000.0;
    }
    format!("{v:7} {unit} ")
}
