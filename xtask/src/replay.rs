//! `cargo xtask replay`: replays a PyTorch memory snapshot through vram's policy under the
//! recorded settings (and checks that it reproduces the recording) and under others, prints
//! a comparison table and draws the memory timeline as SVG.

use plotters::prelude::*;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use vram_alloc::replay::{
    Action, Analysis, CapacityChoice, CapacitySource, Fit, Origin, PyTorchSnapshot, Recording,
    Scenario, SnapshotError, TABLE_LEGEND, WhatIf, signed_bytes,
};
use vram_alloc::{AllocatorConfig, human_bytes};

/// `println!` into a `String`.
macro_rules! say {
    ($out:expr) => {
        $out.push('\n')
    };
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        writeln!($out, $($arg)*).expect("writing to a String")
    }};
}

/// Arguments of `cargo xtask replay`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Record the snapshot in PyTorch with
    torch.cuda.memory._record_memory_history(max_entries=100000)
    ... the workload ...
    torch.cuda.memory._dump_snapshot(\"snapshot.pickle\")

Settings: --conf adds to the recorded settings (its keys replace the recorded values:
--conf expandable_segments:True keeps a recorded max_split_size_mb); --only-conf replaces
them (what you give is all there is). When the recorded settings run out of memory on the
device replayed on, the replay adds its own candidates (marked *): expandable segments,
max_split_size_mb 64/128/256/512, a finer roundup_power2_divisions, and an empty_cache()
where the climb to the first OOM starts, and says which would have avoided it, by how much.

Devices: --strict judges the recorded settings on the recorded device only
(--recorded-capacity, else inferred from the first oom; without one, a --capacity the
recording fits in, else 80 GiB). --capacity replays every setting on another device, a
what-if: a device smaller than the recording needed gives OOMs, not a divergence.

Example:
    cargo xtask replay snapshot.pickle --conf expandable_segments:True --conf max_split_size_mb:256

Exit status: 0 when done, 1 with --strict when the recorded-settings replay diverges,
2 for bad arguments or an unreadable snapshot.")]
pub struct ReplayArgs {
    /// A snapshot written by torch.cuda.memory._dump_snapshot() with history recorded (or
    /// by vram's Snapshot::to_pickle).
    #[arg(value_name = "SNAPSHOT.pickle")]
    pub snapshot: PathBuf,
    /// Settings to try on top of the recorded ones, in PYTORCH_CUDA_ALLOC_CONF syntax
    /// (repeatable): the keys given replace the recorded values, the others stay, e.g.
    /// "expandable_segments:True" or "max_split_size_mb:256".
    #[arg(long = "conf", value_name = "SETTINGS")]
    pub confs: Vec<String>,
    /// Settings to try instead of the recorded ones (repeatable): nothing recorded is kept,
    /// e.g. "" for PyTorch's defaults.
    #[arg(long = "only-conf", value_name = "SETTINGS")]
    pub only_confs: Vec<String>,
    /// The settings the snapshot was recorded with, when it does not record them all (a
    /// per_process_memory_fraction never is) or they need correcting.
    #[arg(long, value_name = "SETTINGS")]
    pub recorded_conf: Option<String>,
    /// The device to replay every setting on, e.g. 24GiB: a what-if. Default: the recorded
    /// device.
    #[arg(long, value_name = "SIZE")]
    pub capacity: Option<String>,
    /// The device the snapshot was recorded on (torch.cuda.mem_get_info()[1]). Default: what
    /// the snapshot's first oom implies (reserved + device free), else 80 GiB.
    #[arg(long, value_name = "SIZE")]
    pub recorded_capacity: Option<String>,
    /// The device whose trace to replay. Default: the first with trace entries.
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// Folder for the SVG timeline (<snapshot name>.svg).
    #[arg(long, default_value = "results/replay", value_name = "DIR")]
    pub out: PathBuf,
    /// Exit with status 1 when the replay under the recorded settings, on the recorded
    /// device, does not reproduce the recording.
    #[arg(long)]
    pub strict: bool,
    /// Print one JSON document (for scripts) instead of the text.
    #[arg(long)]
    pub json: bool,
    /// Skip the search for each setting's smallest device without an OOM (a few dozen
    /// replays a setting; long traces take a while).
    #[arg(long)]
    pub no_fit: bool,
}

fn parse_conf(flag: &str, text: &str) -> Result<AllocatorConfig, String> {
    AllocatorConfig::parse(text).map_err(|e| format!("{flag} `{text}`: {e}"))
}

fn parse_capacity(flag: &str, text: Option<&str>) -> Result<Option<u64>, String> {
    match text {
        None => Ok(None),
        Some(s) => match vram_harness::parse_size(s) {
            Ok(b) => Ok(Some(b)),
            Err(e) => Err(format!("{flag}: {e}")),
        },
    }
}

/// Runs the command; `Err` is a message for a usage or input error (exit status 2).
pub fn run(args: ReplayArgs) -> Result<ExitCode, String> {
    let (code, out) = render(args)?;
    print!("{out}");
    Ok(code)
}

/// Does the work of [`run`] and returns the exit status and what to print.
fn render(args: ReplayArgs) -> Result<(ExitCode, String), String> {
    // Check every argument before reading a possibly large file.
    let capacity = parse_capacity("--capacity", args.capacity.as_deref())?;
    let recorded_capacity =
        parse_capacity("--recorded-capacity", args.recorded_capacity.as_deref())?;
    for c in &args.confs {
        parse_conf("--conf", c)?;
    }
    let only = args
        .only_confs
        .iter()
        .map(|c| parse_conf("--only-conf", c))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(c) = &args.recorded_conf {
        parse_conf("--recorded-conf", c)?;
    }
    check_out_dir(&args.out)?;
    let shown = args.snapshot.display();
    let snapshot = PyTorchSnapshot::load(&args.snapshot).map_err(|e| match e {
        SnapshotError::Io { .. } | SnapshotError::TooBig { .. } => e.to_string(),
        _ => format!("{shown}: {e}"),
    })?;
    let mut rec = snapshot.recording(args.device).map_err(|e| format!("{shown}: {e}"))?;
    let device = match args.device {
        Some(d) => d,
        None => snapshot.devices_with_entries()[0],
    };
    let settings_source = match (&args.recorded_conf, &snapshot.settings) {
        (Some(c), _) => {
            rec.config = c.clone();
            "given with --recorded-conf"
        }
        (None, Some(_)) => "from the snapshot's allocator_settings",
        (None, None) => "not in the snapshot: PyTorch's defaults assumed; pass --recorded-conf",
    };
    let recorded = rec.recorded_config().map_err(|e| {
        format!("{shown}: the recorded settings `{}` are not ones vram has: {e}", rec.config)
    })?;
    let mut scenarios = Vec::new();
    for c in &args.confs {
        let merged = recorded.with_overrides(c).map_err(|e| format!("--conf `{c}`: {e}"))?;
        scenarios.push(Scenario::settings(merged));
    }
    scenarios.extend(only.into_iter().map(Scenario::settings));
    // The recorded device: given, else what the snapshot implies; a --capacity the
    // recording fits in stands for it when the snapshot implies nothing (no oom entry).
    let inferred = rec.infer_capacity();
    let recorded_peak = rec.reserved_series().into_iter().fold(rec.reserved_before, u64::max);
    let recorded_capacity = match (recorded_capacity, capacity) {
        (Some(b), _) => CapacityChoice::given(b),
        (None, Some(c))
            if matches!(
                inferred.source,
                CapacitySource::Default | CapacitySource::RecordedPeak
            ) && c >= recorded_peak =>
        {
            CapacityChoice::given(c)
        }
        _ => inferred,
    };
    let capacity = capacity.filter(|&c| c != recorded_capacity.bytes);
    let analysis = Analysis {
        recorded: recorded.clone(),
        settings: scenarios,
        recorded_capacity,
        capacity: capacity.map(CapacityChoice::given),
        suggest: true,
        fits: !args.no_fit,
    };
    let what_if = rec.analyse(&analysis).map_err(|e| e.to_string())?;

    // Notes: what the snapshot cannot say, and settings that do nothing.
    let mut notes: Vec<String> = Vec::new();
    if recorded.garbage_collection_threshold().is_some() && recorded.memory_fraction().is_none() {
        notes.push(format!(
            "the recorded settings have garbage_collection_threshold but no memory fraction: \
             snapshots do not record torch.cuda.set_per_process_memory_fraction, and without \
             one PyTorch (and this replay) collects no garbage. If the program set a fraction, \
             pass --recorded-conf \"{},per_process_memory_fraction:<fraction>\" and the \
             device's size with --recorded-capacity",
            recorded
        ));
    }
    // Settings asked for that do nothing (the suggestions inherit the recorded settings',
    // said above).
    for (r, row) in what_if.reports().zip(&what_if.rows) {
        if row.origin == Origin::Given && row.no_effect.is_none() {
            for why in &row.inert {
                notes.push(format!("{}: {why}", r.label()));
            }
        }
    }
    for n in recorded.notes() {
        notes.push(format!("recorded settings: {n}"));
    }

    let stem = args.snapshot.file_stem().and_then(|s| s.to_str()).unwrap_or("snapshot");
    let svg_path = args.out.join(format!("{stem}.svg"));
    let title = format!(
        "{} replayed on {}",
        args.snapshot.file_name().and_then(|s| s.to_str()).unwrap_or("snapshot"),
        human_bytes(what_if.capacity.bytes)
    );
    let svg = timeline_svg(&title, &what_if, &rec.entries)
        .ok_or_else(|| "could not draw the timeline".to_string())?;
    std::fs::write(&svg_path, svg).map_err(|e| format!("{}: {e}", svg_path.display()))?;

    let label = if rec.config.is_empty() { "defaults".to_string() } else { rec.config.clone() };
    let mut out = String::new();
    if args.json {
        let doc = json_report(&JsonContext {
            snapshot: &shown.to_string(),
            device,
            rec: &rec,
            settings: &label,
            settings_source,
            notes: &notes,
            what_if: &what_if,
            svg: &svg_path,
        });
        out = serde_json::to_string_pretty(&doc).expect("JSON values serialize");
        out.push('\n');
    } else {
        print_report(
            &mut out,
            &shown.to_string(),
            device,
            &snapshot,
            &rec,
            &label,
            settings_source,
            &notes,
            &what_if,
        );
        say!(out, "timeline:  {}", svg_path.display());
    }
    let code = if args.strict && !what_if.reproduction.matches() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    };
    Ok((code, out))
}

#[allow(clippy::too_many_arguments)]
fn print_report(
    out: &mut String,
    shown: &str,
    device: usize,
    snapshot: &PyTorchSnapshot,
    rec: &Recording,
    label: &str,
    settings_source: &str,
    notes: &[String],
    what_if: &WhatIf,
) {
    let f = &what_if.recorded;
    say!(
        out,
        "snapshot:  {shown}, device {device} of {}: {} trace entries on {} stream(s): {} allocs, \
         {} frees, {} oom",
        snapshot.device_traces.len(),
        rec.entries.len(),
        f.streams.len(),
        f.allocs,
        f.frees,
        f.ooms
    );
    if rec.starts_empty() {
        say!(out, "           the trace starts from an empty cache");
    } else {
        say!(
            out,
            "           the trace began after {} block(s) in {} segment(s) ({} reserved); the \
             replays recreate them first",
            rec.prior_blocks.len(),
            rec.prior_segments.len(),
            human_bytes(rec.reserved_before)
        );
    }
    say!(out, "settings:  {label} ({settings_source})");
    if snapshot.settings.as_ref().is_some_and(|s| s.uses_cuda_malloc_async()) {
        say!(
            out,
            "warning:   the program used backend:cudaMallocAsync, not the caching allocator: \
             the recorded segments come from the driver's pool"
        );
    }
    for n in notes {
        say!(out, "note:      {n}");
    }
    say!(out, "recorded device: {}", what_if.recorded_capacity);
    if what_if.capacity.bytes != what_if.recorded_capacity.bytes {
        say!(
            out,
            "replayed on:     {} (a what-if: the table's rows ran there; the check ran on the \
             recorded device)",
            human_bytes(what_if.capacity.bytes)
        );
    }
    say!(out, "check:     the replay under the recorded settings {}", what_if.reproduction);
    let b = what_if.check.as_ref().unwrap_or(&what_if.baseline);
    if b.unmatched_frees > 0 {
        say!(
            out,
            "note:      {} free(s) of addresses neither the trace nor the segments allocated \
             (skipped)",
            b.unmatched_frees
        );
    }
    for r in what_if.reports() {
        if let Some(e) = &r.error {
            say!(out, "warning:   {}: {e}", r.label());
        }
    }
    say!(out);
    out.push_str(&what_if.table());
    say!(out);
    say!(out, "{TABLE_LEGEND}");
    say!(out);
    if let Some(verdicts) = what_if.oom_answer() {
        let first = what_if.baseline.failed_entries.first().copied();
        let at = first
            .and_then(|i| rec.entries.get(i).map(|e| (i, e)))
            .map(|(i, e)| {
                format!(" (first at entry {i}: {} on stream {:#x})", human_bytes(e.size), e.stream)
            })
            .unwrap_or_default();
        say!(
            out,
            "OOM:       the recorded settings fail {} allocation(s) on {}{at}. Would it have \
             been avoided?",
            what_if.baseline.failed_entries.len(),
            human_bytes(what_if.capacity.bytes),
        );
        let width = verdicts.iter().map(|v| v.label.chars().count()).max().unwrap_or(0);
        for v in &verdicts {
            let verdict = if v.avoided { "yes" } else { "no " };
            let margin = match (v.margin, v.fits_in) {
                (Some(m), Some(Fit::Bytes(b))) if m >= 0 => {
                    format!("margin {} ({m} B): runs on {}", signed_bytes(m), human_bytes(b))
                }
                (Some(m), Some(Fit::Bytes(b))) => format!(
                    "short by {} ({m} B): needs {}",
                    human_bytes(m.unsigned_abs() as u64),
                    human_bytes(b)
                ),
                (_, Some(Fit::Beyond(b))) => format!("no device up to {} runs it", human_bytes(b)),
                _ => format!("{} failed allocation(s)", v.failures),
            };
            say!(out, "  {verdict}  {:<width$}  {margin}", v.label);
        }
        say!(out);
    }
}

struct JsonContext<'a> {
    snapshot: &'a str,
    device: usize,
    rec: &'a Recording,
    settings: &'a str,
    settings_source: &'a str,
    notes: &'a [String],
    what_if: &'a WhatIf,
    svg: &'a std::path::Path,
}

fn fit_json(fit: Option<Fit>) -> serde_json::Value {
    match fit {
        Some(Fit::Bytes(b)) => json!({ "bytes": b }),
        Some(Fit::Beyond(b)) => json!({ "beyond": b }),
        None => serde_json::Value::Null,
    }
}

fn capacity_json(c: &CapacityChoice) -> serde_json::Value {
    json!({ "bytes": c.bytes, "source": c.to_string() })
}

/// The report as one JSON document.
fn json_report(cx: &JsonContext<'_>) -> serde_json::Value {
    let w = cx.what_if;
    let f = &w.recorded;
    let rows: Vec<serde_json::Value> = w
        .reports()
        .zip(&w.rows)
        .zip(w.labels())
        .map(|((r, row), label)| {
            json!({
                "label": label,
                "origin": row.origin,
                "settings": r.config,
                "empty_cache_before": r.empty_cache_before,
                "no_effect": row.no_effect,
                "inert": row.inert,
                "peak_reserved": r.peak_reserved,
                "saving": f.peak_reserved as i128 - r.peak_reserved as i128,
                "peak_allocated": r.peak_allocated,
                "fragmentation_at_peak": r.fragmentation_at_peak,
                "device_allocs": r.device_allocs,
                "device_frees": r.device_frees,
                "ooms": {
                    "recorded": r.recorded_ooms,
                    "reproduced": r.ooms_reproduced,
                    "avoided": r.ooms_avoided,
                    "new": r.new_ooms(),
                    "failed_entries": r.failed_entries,
                },
                "runs_without_oom": r.ran_without_oom(),
                "fits_in": fit_json(row.fit),
                "error": r.error.as_ref().map(|e| e.to_string()),
            })
        })
        .collect();
    let divergence =
        w.reproduction.divergence.as_ref().map(
            |d| json!({ "entry": d.entry, "what": d.what, "expected": d.expected, "got": d.got }),
        );
    let oom = w.oom_answer().map(|verdicts| {
        let verdicts: Vec<serde_json::Value> = verdicts
            .iter()
            .map(|v| {
                json!({
                    "label": v.label,
                    "avoided": v.avoided,
                    "failures": v.failures,
                    "margin": v.margin,
                    "fits_in": fit_json(v.fits_in),
                })
            })
            .collect();
        json!({ "first_failed_entry": w.baseline.failed_entries.first(), "verdicts": verdicts })
    });
    json!({
        "snapshot": cx.snapshot,
        "device": cx.device,
        "entries": cx.rec.entries.len(),
        "starts_empty": cx.rec.starts_empty(),
        "settings": { "recorded": cx.settings, "source": cx.settings_source },
        "notes": cx.notes,
        "recorded_capacity": capacity_json(&w.recorded_capacity),
        "capacity": capacity_json(&w.capacity),
        "check": {
            "matches": w.reproduction.matches(),
            "exact_start": w.reproduction.exact_start,
            "segment_actions": w.reproduction.segment_actions,
            "calls": w.reproduction.calls,
            "divergence": divergence,
            "text": w.reproduction.to_string(),
        },
        "recorded": {
            "peak_reserved": f.peak_reserved,
            "allocs": f.allocs,
            "frees": f.frees,
            "device_allocs": f.device_allocs,
            "device_frees": f.device_frees,
            "ooms": f.ooms,
            "streams": f.streams,
        },
        "rows": rows,
        "oom": oom,
        "timeline_svg": cx.svg.display().to_string(),
    })
}

/// Makes sure the output folder exists and takes files, before any work (so that a long
/// replay does not end in an error about where to write).
fn check_out_dir(out: &std::path::Path) -> Result<(), String> {
    let shown = out.display();
    std::fs::create_dir_all(out).map_err(|e| format!("--out {shown}: {e}"))?;
    let probe = out.join(format!(".vram-replay-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| format!("--out {shown} does not take files: {e}"))?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}

const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
    RGBColor(188, 189, 34),
    RGBColor(127, 127, 127),
    RGBColor(0, 0, 128),
];

/// Dash and gap lengths of each setting's allocated line, so that lines of one colour
/// family still differ.
const DASHES: [(u32, u32); 5] = [(6, 4), (2, 3), (12, 4), (8, 3), (3, 6)];

/// At most this many points per line: each keeps the largest value of its stretch of entries.
const MAX_POINTS: usize = 2000;

fn envelope(values: &[u64], scale: f64) -> Vec<(f64, f64)> {
    let per = values.len().div_ceil(MAX_POINTS).max(1);
    values
        .chunks(per)
        .enumerate()
        .map(|(i, c)| ((i * per) as f64, c.iter().copied().max().unwrap_or(0) as f64 / scale))
        .collect()
}

/// A legend line: a sample of the series' look and its text.
enum Sample {
    Line(RGBColor, u32),
    Dashed(RGBColor, (u32, u32)),
    Cross(RGBColor),
    Triangle(RGBColor),
    None,
}

fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_string()
    } else {
        let mut t: String = text.chars().take(max - 1).collect();
        t.push('…');
        t
    }
}

/// Reserved (solid) and allocated (dashed, a pattern per setting) bytes after each trace
/// entry, one colour per setting, over the recorded reserved bytes (grey); the device's
/// capacity (a dotted line); the recorded OOMs (red crosses) and every OOM a replay adds
/// (a triangle in its colour). The legend stands beside the plot.
pub fn timeline_svg(
    title: &str,
    w: &WhatIf,
    entries: &[vram_alloc::replay::Event],
) -> Option<String> {
    let peak = w.reports().map(|r| r.peak_reserved).chain([w.recorded.peak_reserved]).max()?;
    let capacity = w.capacity.bytes;
    // The capacity line is drawn when it is near the data; far above, the legend says so.
    let show_capacity = capacity as f64 <= peak as f64 * 1.6;
    let top = if show_capacity { peak.max(capacity) } else { peak };
    let (scale, unit) =
        if top >= 2 << 30 { ((1u64 << 30) as f64, "GiB") } else { ((1u64 << 20) as f64, "MiB") };
    let n = entries.len().max(2);
    // Tall enough for every legend line (at most three a row, and four more).
    let lines = 4 + 3 * w.rows.len() as u32;
    let (width, height, legend_width) = (1400u32, 640u32.max(60 + 20 * lines), 420u32);
    let mut legend: Vec<(Sample, String)> = Vec::new();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).ok()?;
        let (plot_area, legend_area) = root.split_horizontally(width - legend_width);
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..(n - 1) as f64, 0f64..(top as f64 / scale * 1.08).max(1e-9))
            .ok()?;
        chart
            .configure_mesh()
            .x_desc("trace entry")
            .y_desc(unit)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.1}"))
            .draw()
            .ok()?;
        let grey = RGBColor(170, 170, 170);
        chart
            .draw_series(LineSeries::new(
                envelope(&w.recorded.reserved, scale),
                grey.stroke_width(5),
            ))
            .ok()?;
        legend.push((Sample::Line(grey, 5), "reserved, recorded trace".into()));
        if show_capacity {
            let y = capacity as f64 / scale;
            chart
                .draw_series(DashedLineSeries::new(
                    [(0.0, y), ((n - 1) as f64, y)],
                    3,
                    3,
                    BLACK.stroke_width(2),
                ))
                .ok()?;
            legend.push((
                Sample::Dashed(BLACK, (3, 3)),
                format!("device: {}", human_bytes(capacity)),
            ));
        } else {
            legend.push((
                Sample::None,
                format!("device: {} (above the plot)", human_bytes(capacity)),
            ));
        }
        let labels = w.labels();
        let mut drawn = 0usize;
        for ((r, row), label) in w.reports().zip(&w.rows).zip(&labels) {
            if row.no_effect.is_some() {
                legend.push((Sample::None, shorten(&format!("{label}: no effect"), 58)));
                continue;
            }
            let c = COLOURS[drawn % COLOURS.len()];
            let dash = DASHES[drawn % DASHES.len()];
            drawn += 1;
            let reserved: Vec<u64> = r.timeline.iter().map(|s| s.reserved).collect();
            let allocated: Vec<u64> = r.timeline.iter().map(|s| s.allocated).collect();
            chart
                .draw_series(LineSeries::new(envelope(&reserved, scale), c.stroke_width(2)))
                .ok()?;
            chart
                .draw_series(DashedLineSeries::new(
                    envelope(&allocated, scale),
                    dash.0,
                    dash.1,
                    c.stroke_width(1),
                ))
                .ok()?;
            legend.push((Sample::Line(c, 2), shorten(&format!("reserved, {label}"), 58)));
            legend.push((Sample::Dashed(c, dash), shorten(&format!("allocated, {label}"), 58)));
            // Every OOM the replay has that the recording does not.
            let new: Vec<(f64, f64)> = r
                .failed_entries
                .iter()
                .filter(|&&i| entries.get(i).is_some_and(|e| e.action != Action::Oom))
                .filter_map(|&i| r.timeline.get(i).map(|s| (i as f64, s.reserved as f64 / scale)))
                .collect();
            if !new.is_empty() {
                let count = new.len();
                chart
                    .draw_series(new.into_iter().map(|p| TriangleMarker::new(p, 6, c.filled())))
                    .ok()?;
                legend.push((
                    Sample::Triangle(c),
                    shorten(&format!("{count} new OOM(s), {label}"), 58),
                ));
            }
        }
        let red = RGBColor(200, 0, 0);
        let ooms: Vec<(f64, f64)> = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.action == Action::Oom)
            .map(|(i, _)| (i as f64, w.recorded.reserved[i] as f64 / scale))
            .collect();
        if !ooms.is_empty() {
            let count = ooms.len();
            chart
                .draw_series(ooms.into_iter().map(|p| Cross::new(p, 7, red.stroke_width(3))))
                .ok()?;
            legend.push((Sample::Cross(red), format!("{count} recorded OOM(s)")));
        }

        // The legend, beside the plot.
        let font = ("sans-serif", 13).into_font();
        let (x0, mut y) = (14i32, 48i32);
        legend_area.draw(&Text::new("legend", (x0, 20), ("sans-serif", 15).into_font())).ok()?;
        for (sample, text) in &legend {
            let (a, b) = ((x0, y), (x0 + 30, y));
            match sample {
                Sample::Line(c, wd) => {
                    legend_area.draw(&PathElement::new(vec![a, b], c.stroke_width(*wd))).ok()?;
                }
                Sample::Dashed(c, (dash, gap)) => {
                    let mut x = a.0;
                    while x < b.0 {
                        let end = (x + *dash as i32).min(b.0);
                        legend_area
                            .draw(&PathElement::new(vec![(x, y), (end, y)], c.stroke_width(1)))
                            .ok()?;
                        x = end + *gap as i32;
                    }
                }
                Sample::Cross(c) => {
                    legend_area.draw(&Cross::new((x0 + 15, y), 5, c.stroke_width(2))).ok()?;
                }
                Sample::Triangle(c) => {
                    legend_area.draw(&TriangleMarker::new((x0 + 15, y), 6, c.filled())).ok()?;
                }
                Sample::None => {}
            }
            legend_area.draw(&Text::new(text.clone(), (x0 + 40, y - 7), font.clone())).ok()?;
            y += 20;
        }
        root.present().ok()?;
    }
    Some(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The snapshots vram-alloc's tests use.
    fn fixture(name: &str) -> PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../alloc/tests/fixtures").join(name)
    }

    fn args(snapshot: PathBuf, tag: &str) -> ReplayArgs {
        ReplayArgs {
            snapshot,
            confs: Vec::new(),
            only_confs: Vec::new(),
            recorded_conf: None,
            capacity: None,
            recorded_capacity: None,
            json: false,
            no_fit: false,
            device: None,
            out: std::env::temp_dir()
                .join(format!("vram-xtask-replay-{tag}-{}", std::process::id())),
            strict: false,
        }
    }

    #[test]
    fn replays_a_fixture_and_draws_the_timeline() {
        let mut a = args(fixture("training.pickle"), "ok");
        a.confs = vec!["expandable_segments:True".into()];
        a.strict = true;
        let out = a.out.clone();
        assert_eq!(run(a).unwrap(), ExitCode::SUCCESS);
        let svg = std::fs::read_to_string(out.join("training.svg")).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("expandable_segments:True"));
        std::fs::remove_dir_all(out).ok();
    }

    #[test]
    fn input_errors_say_what_is_wrong() {
        let mut a = args(fixture("training.pickle"), "errors");
        a.confs = vec!["colour:blue".into()];
        let e = run(a).unwrap_err();
        assert!(e.starts_with("--conf `colour:blue`: ") && e.contains("unknown key"), "{e}");

        let mut a = args(fixture("training.pickle"), "errors");
        a.capacity = Some("lots".into());
        assert!(run(a).unwrap_err().starts_with("--capacity: "));

        let e = run(args(fixture("missing.pickle"), "errors")).unwrap_err();
        assert!(e.contains("missing.pickle") && e.contains("No such file"), "{e}");

        let e = run(args(fixture("make_snapshots.py"), "errors")).unwrap_err();
        assert!(e.contains("make_snapshots.py: not a pickle"), "{e}");

        // The output folder is checked before the snapshot is read: a file in its way.
        let blocker =
            std::env::temp_dir().join(format!("vram-xtask-blocker-{}", std::process::id()));
        std::fs::write(&blocker, b"").unwrap();
        let mut a = args(fixture("missing.pickle"), "errors");
        a.out = blocker.join("svg");
        let e = run(a).unwrap_err();
        std::fs::remove_file(&blocker).ok();
        assert!(e.starts_with("--out ") && !e.contains("missing.pickle"), "{e}");

        // Hostile or damaged snapshots: refused with a message (status 2), not read.
        let dir = std::env::temp_dir().join(format!("vram-xtask-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let marks = dir.join("marks.pickle");
        let mut bytes = b"\x80\x04".to_vec();
        bytes.extend(std::iter::repeat_n(b'(', 1 << 20));
        std::fs::write(&marks, &bytes).unwrap();
        let e = run(args(marks, "errors")).unwrap_err();
        assert!(e.contains("marks.pickle: refused: more than 64 MARKs"), "{e}");
        let cut = dir.join("cut.pickle");
        let whole = std::fs::read(fixture("training.pickle")).unwrap();
        std::fs::write(&cut, &whole[..whole.len() / 3]).unwrap();
        let e = run(args(cut, "errors")).unwrap_err();
        assert!(e.contains("cut.pickle: the file is truncated"), "{e}");
        std::fs::remove_dir_all(&dir).ok();

        let mut a = args(fixture("training.pickle"), "errors");
        a.device = Some(1);
        let e = run(a).unwrap_err();
        assert!(e.contains("device 1 has no trace entries"), "{e}");
    }

    #[test]
    fn a_wrong_recorded_setting_makes_the_check_fail_under_strict() {
        let mut a = args(fixture("training.pickle"), "strict");
        a.recorded_conf = Some("expandable_segments:True".into());
        a.strict = true;
        let out = a.out.clone();
        assert_eq!(run(a).unwrap(), ExitCode::from(1));
        std::fs::remove_dir_all(out).ok();
    }

    fn out_text(a: ReplayArgs) -> (ExitCode, String) {
        render(a).unwrap()
    }

    fn shared(name: &str) -> PathBuf {
        fixture(name)
    }

    #[test]
    fn help_says_conf_adds_and_only_conf_replaces() {
        use clap::Args;
        let mut cmd = ReplayArgs::augment_args(clap::Command::new("replay"));
        let help = cmd.render_long_help().to_string();
        assert!(help.contains("--conf adds to the recorded settings"), "{help}");
        assert!(help.contains("--only-conf replaces"), "{help}");
        assert!(help.contains("Settings to try instead of the recorded ones"), "{help}");
        assert!(help.contains("--recorded-capacity"), "{help}");
        assert!(help.contains("--json"), "{help}");
    }

    /// `--conf` keeps the recorded settings it does not name; `--only-conf` does not.
    #[test]
    fn conf_adds_to_the_recorded_settings_and_only_conf_replaces_them() {
        let mut a = args(shared("soup_gc_fraction.pickle"), "conf");
        a.recorded_conf =
            Some("garbage_collection_threshold:0.6,per_process_memory_fraction:0.05".into());
        a.recorded_capacity = Some("85017493504".into());
        a.confs = vec!["expandable_segments:True".into()];
        a.only_confs = vec!["expandable_segments:True".into()];
        a.strict = true;
        a.no_fit = true;
        let out = a.out.clone();
        let (code, text) = out_text(a);
        assert_eq!(code, ExitCode::SUCCESS, "{text}");
        assert!(
            text.contains("\ngarbage_collection_threshold:0.6,expandable_segments:True,per_process_memory_fraction:0.05 "),
            "{text}"
        );
        assert!(text.contains("\nexpandable_segments:True "), "{text}");
        std::fs::remove_dir_all(out).ok();
    }

    /// Garbage collection without a memory fraction: the snapshot cannot say whether the
    /// program set one; the output says so and names the flags; a --conf that only adds
    /// it says it has no effect.
    #[test]
    fn what_the_snapshot_cannot_say_and_settings_that_do_nothing_are_said() {
        let mut a = args(shared("soup_gc_fraction.pickle"), "gc");
        a.no_fit = true;
        let out = a.out.clone();
        let (_, text) = out_text(a);
        assert!(text.contains("no memory fraction"), "{text}");
        assert!(
            text.contains("--recorded-conf") && text.contains("per_process_memory_fraction"),
            "{text}"
        );
        assert!(text.contains("frag. at peak   (reserved - allocated) / reserved"), "{text}");

        let mut a = args(fixture("h100_gpt_default.pickle"), "gc");
        a.confs = vec!["garbage_collection_threshold:0.6".into()];
        let (_, text) = out_text(a);
        let line =
            text.lines().find(|l| l.starts_with("garbage_collection_threshold:0.6")).unwrap();
        assert!(line.contains("(no effect: garbage_collection_threshold has no effect"), "{line}");
        std::fs::remove_dir_all(out).ok();
    }

    /// `--capacity` below the recorded peak: a what-if. `--strict` still passes (the check
    /// runs on the recorded device); the OOMs are answered; the SVG has the capacity line, a
    /// marker for each new OOM and the legend beside the plot; `--json` says the same.
    #[test]
    fn a_smaller_capacity_is_a_what_if_with_an_answer_a_plot_and_json() {
        let mut a = args(fixture("training.pickle"), "what-if");
        a.capacity = Some("2GiB".into());
        a.strict = true;
        let out = a.out.clone();
        let (code, text) = out_text(a);
        assert_eq!(code, ExitCode::SUCCESS, "{text}");
        assert!(
            text.contains("check:     the replay under the recorded settings matches"),
            "{text}"
        );
        assert!(text.contains("a what-if"), "{text}");
        assert!(text.contains("OOM:       the recorded settings fail"), "{text}");
        assert!(text.contains("* recorded + expandable_segments:True"), "{text}");
        assert!(text.contains("fits in"), "{text}");

        let svg = std::fs::read_to_string(out.join("training.svg")).unwrap();
        assert!(svg.contains("device: 2.00 GiB"), "the capacity line's legend");
        assert!(svg.contains("new OOM(s), defaults (recorded settings)"));
        assert!(svg.contains("<polygon"), "triangle markers for new OOMs");
        // Every legend text lies right of the plot (which ends at x = 980).
        let legend_x: Vec<f64> = svg
            .split("<text")
            .skip(1)
            .filter(|t| {
                t.contains("reserved, ") || t.contains("allocated, ") || t.contains("device: ")
            })
            .map(|t| {
                let x = t.split("x=\"").nth(1).unwrap().split('"').next().unwrap();
                x.parse().unwrap()
            })
            .collect();
        assert!(legend_x.len() >= 4 && legend_x.iter().all(|&x| x >= 980.0), "{legend_x:?}");
        // Allocated lines differ in dash pattern from one setting to the next.
        assert!(
            svg.matches("stroke-dasharray").count() > 0 || svg.matches("<polyline").count() > 10
        );

        let mut a = args(fixture("training.pickle"), "what-if");
        a.capacity = Some("2GiB".into());
        a.json = true;
        let (_, text) = out_text(a);
        let doc: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(doc["check"]["matches"], true);
        assert_eq!(doc["capacity"]["bytes"], 2u64 << 30);
        assert_eq!(doc["recorded_capacity"]["bytes"], 4u64 << 30);
        let rows = doc["rows"].as_array().unwrap();
        assert_eq!(rows[0]["origin"], "recorded");
        assert!(rows.iter().any(|r| r["origin"] == "suggested"));
        assert!(rows[0]["fits_in"]["bytes"].as_u64().unwrap() > 2 << 30);
        assert!(doc["oom"]["verdicts"].as_array().unwrap().len() == rows.len());
        std::fs::remove_dir_all(out).ok();
    }

    /// The three H100 recordings that diverged replay step for step under --strict.
    #[test]
    fn the_h100_recordings_replay_under_strict() {
        for (name, recorded_conf, recorded_capacity) in [
            ("soup_expandable.pickle", None, None),
            (
                "soup_gc_fraction.pickle",
                Some("garbage_collection_threshold:0.6,per_process_memory_fraction:0.05"),
                Some("85017493504"),
            ),
            ("private_pools.pickle", None, None),
        ] {
            let mut a = args(shared(name), "h100");
            a.recorded_conf = recorded_conf.map(String::from);
            a.recorded_capacity = recorded_capacity.map(String::from);
            a.strict = true;
            a.no_fit = true;
            let out = a.out.clone();
            let (code, text) = out_text(a);
            assert_eq!(code, ExitCode::SUCCESS, "{name}: {text}");
            assert!(text.contains("matches the recording"), "{name}: {text}");
            std::fs::remove_dir_all(out).ok();
        }
    }
}
