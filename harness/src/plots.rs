//! SVG charts (lines, labelled points, stacked bars); each experiment draws its plot from its
//! typed measurements with them.

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use std::ops::Range;

const SIZE: (u32, u32) = (720, 420);
/// Bytes per MiB, for axes in MiB.
pub(crate) const MIB: f64 = 1024.0 * 1024.0;
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

type Series = (String, Vec<(f64, f64)>);

fn bounds(series: &[Series], from_zero: bool) -> Option<(f64, f64, f64)> {
    let all = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        return None;
    }
    let x0 = if from_zero { x0.min(0.0) } else { x0 };
    Some((x0, if x1 > x0 { x1 } else { x0 + 1.0 }, if y1 > 0.0 { y1 * 1.1 } else { 1.0 }))
}

/// Draws a titled cartesian chart over `x` and `y` into an SVG string; `body` draws in it,
/// then the series legend is drawn when `legend` is set.
fn chart(
    title: &str,
    x: Range<f64>,
    y: Range<f64>,
    legend: bool,
    body: impl FnOnce(&mut Chart<'_, '_>) -> Option<()>,
) -> Option<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).ok()?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x, y)
            .ok()?;
        body(&mut chart)?;
        if legend {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .ok()?;
        }
        root.present().ok()?;
    }
    Some(svg)
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

pub(crate) fn lines(
    title: &str,
    x: &str,
    y: &str,
    series: &[Series],
    points: bool,
) -> Option<String> {
    let (x0, x1, y1) = bounds(series, true)?;
    chart(title, x0..x1, 0f64..y1, true, |chart| {
        chart.configure_mesh().x_desc(x).y_desc(y).draw().ok()?;
        for (i, (name, pts)) in series.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
                .ok()?
                .label(name.as_str())
                .legend(move |(a, b)| {
                    PathElement::new(vec![(a, b), (a + 20, b)], c.stroke_width(2))
                });
            if points {
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled()))).ok()?;
            }
        }
        Some(())
    })
}

pub(crate) fn scatter(title: &str, x: &str, y: &str, pts: &[(String, f64, f64)]) -> Option<String> {
    let series = vec![(String::new(), pts.iter().map(|p| (p.1, p.2)).collect())];
    let (x0, x1, y1) = bounds(&series, true)?;
    let pad = (x1 - x0) * 0.15;
    chart(title, (x0 - pad)..(x1 + pad), 0f64..y1, false, |chart| {
        chart.configure_mesh().x_desc(x).y_desc(y).draw().ok()?;
        for (i, (name, px, py)) in pts.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            chart.draw_series(std::iter::once(Circle::new((*px, *py), 5, c.filled()))).ok()?;
            let label = name.split(" (").next().unwrap_or(name).to_string();
            chart
                .draw_series(std::iter::once(Text::new(
                    label,
                    (*px, *py),
                    ("sans-serif", 13).into_font().color(&BLACK),
                )))
                .ok()?;
        }
        Some(())
    })
}

pub(crate) fn stacked(
    title: &str,
    y: &str,
    parts: &[&str],
    bars: &[(String, Vec<f64>)],
) -> Option<String> {
    let top = bars.iter().map(|(_, v)| v.iter().sum::<f64>()).fold(0f64, f64::max) * 1.15;
    let n = bars.len() as f64;
    chart(title, 0f64..n, 0f64..top.max(1.0), true, |chart| {
        let labels: Vec<String> = bars.iter().map(|(l, _)| l.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(bars.len() * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - x.floor() - 0.5).abs() < 0.01 {
                    labels.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc(y)
            .draw()
            .ok()?;
        for (k, part) in parts.iter().enumerate() {
            let c = COLOURS[k % COLOURS.len()];
            let rects = bars.iter().enumerate().map(|(i, (_, v))| {
                let below: f64 = v[..k].iter().sum();
                Rectangle::new(
                    [(i as f64 + 0.2, below), (i as f64 + 0.8, below + v[k])],
                    c.filled(),
                )
            });
            chart
                .draw_series(rects)
                .ok()?
                .label(*part)
                .legend(move |(a, b)| Rectangle::new([(a, b - 5), (a + 12, b + 5)], c.filled()));
        }
        Some(())
    })
}
