//! `cargo xtask replay`: replays a PyTorch memory snapshot through vram's policy under the
//! recorded settings (and checks that it reproduces the recording) and under others, prints
//! a comparison table and draws the memory timeline as SVG.

use plotters::prelude::*;
use std::path::PathBuf;
use std::process::ExitCode;
use vram_alloc::replay::{Action, CapacityChoice, PyTorchSnapshot, SnapshotError, WhatIf};
use vram_alloc::{AllocatorConfig, human_bytes};

/// Arguments of `cargo xtask replay`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Record the snapshot in PyTorch with
    torch.cuda.memory._record_memory_history(max_entries=100000)
    ... the workload ...
    torch.cuda.memory._dump_snapshot(\"snapshot.pickle\")

Example:
    cargo xtask replay snapshot.pickle --conf expandable_segments:True --conf max_split_size_mb:256

Exit status: 0 when done, 1 with --strict when the recorded-settings replay diverges,
2 for bad arguments or an unreadable snapshot.")]
pub struct ReplayArgs {
    /// A snapshot written by torch.cuda.memory._dump_snapshot() with history recorded (or
    /// by vram's Snapshot::to_pickle).
    #[arg(value_name = "SNAPSHOT.pickle")]
    pub snapshot: PathBuf,
    /// Settings to compare with the recorded ones, in PYTORCH_CUDA_ALLOC_CONF syntax
    /// (repeatable), e.g. "expandable_segments:True" or "max_split_size_mb:256".
    #[arg(long = "conf", value_name = "SETTINGS")]
    pub confs: Vec<String>,
    /// The settings the snapshot was recorded with, when it does not record them (older
    /// PyTorch) or they need correcting, e.g. with a per_process_memory_fraction.
    #[arg(long, value_name = "SETTINGS")]
    pub recorded_conf: Option<String>,
    /// The device's capacity, e.g. 80GiB. Default: what the snapshot's first oom implies
    /// (reserved + device free), else 80 GiB.
    #[arg(long, value_name = "SIZE")]
    pub capacity: Option<String>,
    /// The device whose trace to replay. Default: the first with trace entries.
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// Folder for the SVG timeline (<snapshot name>.svg).
    #[arg(long, default_value = "results/replay", value_name = "DIR")]
    pub out: PathBuf,
    /// Exit with status 1 when the replay under the recorded settings does not reproduce
    /// the recording.
    #[arg(long)]
    pub strict: bool,
}

fn parse_conf(flag: &str, text: &str) -> Result<AllocatorConfig, String> {
    AllocatorConfig::parse(text).map_err(|e| format!("{flag} `{text}`: {e}"))
}

/// Runs the command; `Err` is a message for a usage or input error (exit status 2).
pub fn run(args: ReplayArgs) -> Result<ExitCode, String> {
    // Check every argument before reading a possibly large file.
    let capacity = match args.capacity.as_deref() {
        None => None,
        Some(s) => Some(vram_harness::parse_size(s).map_err(|e| format!("--capacity: {e}"))?),
    };
    let variants =
        args.confs.iter().map(|c| parse_conf("--conf", c)).collect::<Result<Vec<_>, _>>()?;
    if let Some(c) = &args.recorded_conf {
        parse_conf("--recorded-conf", c)?;
    }
    check_out_dir(&args.out)?;
    let shown = args.snapshot.display();
    let snapshot = PyTorchSnapshot::load(&args.snapshot).map_err(|e| match e {
        SnapshotError::Io { .. } => e.to_string(),
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
    let capacity = capacity.map_or_else(|| rec.infer_capacity(), CapacityChoice::given);
    let what_if = rec.what_if(recorded, &variants, capacity).map_err(|e| e.to_string())?;

    let f = &what_if.recorded;
    println!(
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
        println!("           the trace starts from an empty cache");
    } else {
        println!(
            "           the trace began after {} block(s) in {} segment(s) ({} reserved); the \
             replays recreate them first",
            rec.prior_blocks.len(),
            rec.prior_segments.len(),
            human_bytes(rec.reserved_before)
        );
    }
    let label = if rec.config.is_empty() { "defaults" } else { rec.config.as_str() };
    println!("settings:  {label} ({settings_source})");
    if snapshot.settings.as_ref().is_some_and(|s| s.uses_cuda_malloc_async()) {
        println!(
            "warning:   the program used backend:cudaMallocAsync, not the caching allocator: \
             the recorded segments come from the driver's pool"
        );
    }
    println!("capacity:  {}", what_if.capacity);
    println!("check:     the replay under the recorded settings {}", what_if.reproduction);
    let b = &what_if.baseline;
    if b.unmatched_frees > 0 {
        println!(
            "note:      {} free(s) of addresses neither the trace nor the segments allocated \
             (skipped)",
            b.unmatched_frees
        );
    }
    for r in what_if.reports() {
        if let Some(e) = &r.error {
            println!("warning:   {}: {e}", r.label());
        }
    }
    println!();
    print!("{}", what_if.table());
    println!();

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
    println!("timeline:  {}", svg_path.display());
    if args.strict && !what_if.reproduction.matches() {
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
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

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

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

/// Reserved (solid) and allocated (dashed) bytes after each trace entry, one colour per
/// setting, over the recorded reserved bytes (grey) and the recorded OOMs (red crosses).
pub fn timeline_svg(
    title: &str,
    w: &WhatIf,
    entries: &[vram_alloc::replay::Event],
) -> Option<String> {
    let peak = w.reports().map(|r| r.peak_reserved).chain([w.recorded.peak_reserved]).max()?;
    let (scale, unit) =
        if peak >= 2 << 30 { ((1u64 << 30) as f64, "GiB") } else { ((1u64 << 20) as f64, "MiB") };
    let n = entries.len().max(2);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 560)).into_drawing_area();
        root.fill(&WHITE).ok()?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..(n - 1) as f64, 0f64..(peak as f64 / scale * 1.18).max(1e-9))
            .ok()?;
        chart
            .configure_mesh()
            .x_desc("trace entry")
            .y_desc(unit)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.1}"))
            .draw()
            .ok()?;
        let grey = RGBColor(150, 150, 150);
        chart
            .draw_series(LineSeries::new(
                envelope(&w.recorded.reserved, scale),
                grey.stroke_width(5),
            ))
            .ok()?
            .label("reserved, recorded")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(5))
            });
        for (i, r) in w.reports().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            let name = if i == 0 {
                format!("{} (recorded settings)", r.label())
            } else {
                r.label().to_string()
            };
            let reserved: Vec<u64> = r.timeline.iter().map(|s| s.reserved).collect();
            let allocated: Vec<u64> = r.timeline.iter().map(|s| s.allocated).collect();
            chart
                .draw_series(LineSeries::new(envelope(&reserved, scale), c.stroke_width(2)))
                .ok()?
                .label(format!("reserved, {name}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            chart
                .draw_series(DashedLineSeries::new(
                    envelope(&allocated, scale),
                    6,
                    4,
                    c.stroke_width(1),
                ))
                .ok()?
                .label(format!("allocated, {name}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 8, y)], c.stroke_width(1))
                });
        }
        let red = RGBColor(200, 0, 0);
        let ooms: Vec<(f64, f64)> = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.action == Action::Oom)
            .map(|(i, _)| (i as f64, w.recorded.reserved[i] as f64 / scale))
            .collect();
        if !ooms.is_empty() {
            chart
                .draw_series(ooms.into_iter().map(|p| Cross::new(p, 7, red.stroke_width(3))))
                .ok()?
                .label("oom, recorded")
                .legend(move |(x, y)| Cross::new((x + 10, y), 5, red.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .ok()?;
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
            recorded_conf: None,
            capacity: None,
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
}
