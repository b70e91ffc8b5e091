//! `REPORT.md`: claims against measurements.

use crate::bench::{BenchOptions, Context, Outcome};
use crate::techniques::Technique;
use std::fmt::Write;
use std::time::Duration;
use vram_alloc::human_bytes;

/// Renders the report for a bench run.
pub fn render(
    ctx: &Context,
    opts: &BenchOptions,
    advice: Option<&Result<crate::advice::Advice, crate::ExperimentError>>,
    outcomes: &[(&'static Technique, Outcome, Duration)],
    pending: &[&str],
) -> String {
    let mut s = String::new();
    let device = match &ctx.backend {
        crate::Backend::Cpu => format!(
            "host backend, simulated device capacity {} (memory figures are exact; speed figures are host figures)",
            human_bytes(ctx.device_memory)
        ),
        crate::Backend::Cuda { name, total_bytes } => {
            format!("CUDA: {name}, {}", human_bytes(*total_bytes))
        }
    };
    let _ = writeln!(s, "# vram: claims against measurements\n");
    let _ = writeln!(s, "- device: {device}");
    let _ = writeln!(s, "- mode: {}", if opts.quick { "quick (reduced sizes)" } else { "full" });
    let _ = writeln!(s, "- seed: {}", opts.seed);
    let resumed: Vec<&str> = outcomes
        .iter()
        .filter(|(_, o, _)| matches!(o, Outcome::Done { resumed: true, .. }))
        .map(|(t, _, _)| t.id)
        .collect();
    if !resumed.is_empty() {
        let _ = writeln!(
            s,
            "- resumed (`--resume`): {} ran in an earlier run into this folder, with the same \
             backend, device, mode and seed",
            ids(&resumed)
        );
    }
    if !pending.is_empty() {
        let _ = writeln!(
            s,
            "- **partial**: {} of {} experiments have ended (done or failed); still to run: \
             {} (the report is rewritten after each experiment; `cargo xtask bench --resume` \
             with the same settings and `--out` runs the rest)",
            outcomes.len(),
            outcomes.len() + pending.len(),
            ids(pending)
        );
    }
    let _ = writeln!(s);
    match advice {
        Some(Ok(a)) => {
            let _ = writeln!(s, "{}", crate::advice::markdown(a));
        }
        Some(Err(e)) => {
            let _ = writeln!(s, "## What should I do?\n\nNot computed: {e}\n");
        }
        None => {}
    }

    let _ = writeln!(s, "## Claims\n");
    let _ = writeln!(s, "| technique | claim | measured | verdict |");
    let _ = writeln!(s, "|---|---|---|---|");
    for (t, outcome, _) in outcomes {
        match outcome {
            Outcome::Done { result: r, .. } => {
                for c in &r.claims {
                    let _ = writeln!(
                        s,
                        "| `{}` | {} | {} | **{}** |",
                        t.id,
                        cell(&c.claim),
                        cell(&c.measured),
                        c.verdict.as_str()
                    );
                }
            }
            Outcome::Failed(m) => {
                let _ = writeln!(
                    s,
                    "| `{}` | {} | experiment failed: {} | **failed** |",
                    t.id,
                    cell(t.claim),
                    cell(&m.to_string())
                );
            }
        }
    }
    let _ = writeln!(
        s,
        "\nOut of scope (host-level, not GPU memory): dropping the OS page cache, adding swap.\n"
    );

    let checks: Vec<(&str, &crate::results::Check)> = outcomes
        .iter()
        .filter_map(|(t, o, _)| match o {
            Outcome::Done { result, .. } => Some((t.id, result)),
            Outcome::Failed(_) => None,
        })
        .flat_map(|(id, r)| r.checks.iter().map(move |c| (id, c)))
        .collect();
    if !checks.is_empty() {
        let _ = writeln!(
            s,
            "## Consistency checks\n\nAgreements vram's design makes hold (a prediction \
             against the computation it predicts, a counter against the trace that feeds it, \
             a result against a path built to give the same bits). They catch bugs in vram; \
             they test none of the posts' claims, so they are not verdicts.\n"
        );
        let _ = writeln!(s, "| technique | check | measured | agrees |");
        let _ = writeln!(s, "|---|---|---|---|");
        for (id, c) in checks {
            let agrees = if c.passed { "yes" } else { "**no: a bug**" };
            let _ =
                writeln!(s, "| `{id}` | {} | {} | {agrees} |", cell(&c.check), cell(&c.measured));
        }
        let _ = writeln!(s);
    }

    for (t, outcome, elapsed) in outcomes {
        let Outcome::Done { result: r, plot, .. } = outcome else { continue };
        let _ = writeln!(s, "## `{}`: {}\n", t.id, t.name);
        let _ = writeln!(s, "Claim: {} (source: {}).\n", t.claim, t.source);
        if let Some(reading) = &r.reading {
            let _ = writeln!(s, "Reading: {reading}\n");
        }
        let earlier = match outcome {
            Outcome::Done { resumed: true, .. } => " (in an earlier run, kept by `--resume`)",
            _ => "",
        };
        let _ = writeln!(
            s,
            "Ran in {:.1} s{earlier}. Results: `{}.json`.\n",
            elapsed.as_secs_f64(),
            t.id
        );
        if r.variants.is_empty() {
            // Nothing measured on this backend: the claim table says why; no empty table.
            for c in &r.claims {
                let _ = writeln!(s, "Not measured here: {}\n", c.measured);
            }
            continue;
        }
        let _ =
            writeln!(s, "| variant | peak allocated | peak reserved | step (ms, mean +- 95% CI) |");
        let _ = writeln!(s, "|---|---:|---:|---:|");
        for v in &r.variants {
            let step = v.timing().map_or("-".to_string(), |t| match t.ci95_ms {
                Some(_) => format!("{} (n = {})", t.interval(3), t.samples),
                None => format!("{:.3} (n = {})", t.mean_ms, t.samples),
            });
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} |",
                cell(&v.name),
                human_bytes(v.peak_allocated_bytes),
                human_bytes(v.peak_reserved_bytes),
                step
            );
        }
        if *plot {
            let _ = writeln!(s, "\n![{}]({}.svg)", t.id, t.id);
        }
        let _ = writeln!(s);
    }
    s
}

/// `a`, `b`, `c` as code spans.
fn ids(ids: &[&str]) -> String {
    ids.iter().map(|id| format!("`{id}`")).collect::<Vec<_>>().join(", ")
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}
