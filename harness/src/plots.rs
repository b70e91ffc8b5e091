//! SVG charts (lines, labelled points, stacked bars); each experiment draws its plot from its
//! typed measurements with them.

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use std::ops::Range;

const SIZE: (u32, u32) = (720, 420);
/// Bytes per MiB, for axes in MiB.
pub(crate) const MIB: f64 = 1024.0 * 1024.0;
const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
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
    Some((x0, if x1 > x0 { x1 } else { x0 + 1.0 }, if y1 > 0.0 { y1 * 1.3 } else { 1.0 }))
}

/// The chart corner with the fewest of `points` under where a legend box would sit (the
/// outer 45% of the width by the outer 22% of the height; line charts leave about 7% of the
/// height per legend entry free above their data), so that the legend hides no data.
fn free_corner(points: &[(f64, f64)], x: &Range<f64>, y: &Range<f64>) -> SeriesLabelPosition {
    let (w, h) =
        ((x.end - x.start).max(f64::MIN_POSITIVE), (y.end - y.start).max(f64::MIN_POSITIVE));
    let count = |left: bool, top: bool| {
        points
            .iter()
            .filter(|&&(px, py)| {
                let (u, v) = ((px - x.start) / w, (py - y.start) / h);
                (if left { u <= 0.45 } else { u >= 0.55 })
                    && (if top { v >= 0.6 } else { v <= 0.4 })
            })
            .count()
    };
    [
        (SeriesLabelPosition::UpperRight, count(false, true)),
        (SeriesLabelPosition::UpperLeft, count(true, true)),
        (SeriesLabelPosition::LowerRight, count(false, false)),
        (SeriesLabelPosition::LowerLeft, count(true, false)),
    ]
    .into_iter()
    .min_by_key(|&(_, n)| n)
    .map_or(SeriesLabelPosition::UpperRight, |(p, _)| p)
}

/// Points filling bar slot `i` (x in `i + 0.1 .. i + 0.9`) from 0 up to its top, with room
/// for the value written above it: what a legend must not cover.
fn bar_tops(tops: impl Iterator<Item = f64>) -> Vec<(f64, f64)> {
    tops.enumerate()
        .flat_map(|(i, t)| {
            (1..10).flat_map(move |k| {
                (0..=12).map(move |j| (i as f64 + k as f64 / 10.0, t * 1.1 * j as f64 / 12.0))
            })
        })
        .collect()
}

/// Draws a titled cartesian chart over `x` and `y` into an SVG string; `body` draws in it,
/// then the series legend, when `legend` gives the data points, in the corner with the
/// fewest of them.
fn chart(
    title: &str,
    x: Range<f64>,
    y: Range<f64>,
    legend: Option<&[(f64, f64)]>,
    body: impl FnOnce(&mut Chart<'_, '_>) -> Option<()>,
) -> Option<String> {
    let corner = legend.map(|pts| free_corner(pts, &x, &y));
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
        if let Some(corner) = corner {
            chart
                .configure_series_labels()
                .position(corner)
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
    lines_with_marks(title, x, y, series, points, &[])
}

/// Marks drawn over a line chart, each with its legend entry.
pub(crate) enum Mark {
    /// Thin dashed vertical lines at these x positions (e.g. step boundaries).
    Vertical(String, Vec<f64>),
    /// Crosses at these points (e.g. out-of-memory errors), in the colour of series `i` when
    /// given, red otherwise.
    Crosses(String, Vec<(f64, f64)>, Option<usize>),
}

/// [`lines`] with `marks` drawn over the series.
pub(crate) fn lines_with_marks(
    title: &str,
    x: &str,
    y: &str,
    series: &[Series],
    points: bool,
    marks: &[Mark],
) -> Option<String> {
    let (x0, x1, y1) = bounds(series, true)?;
    // Room above the data for the legend: about 7% of the height per entry.
    let entries = (series.len() + marks.len()) as f64;
    let y1 = (y1 / 1.3) / (1.0 - 0.07 * entries - 0.04).max(0.3);
    let mut pts: Vec<(f64, f64)> = series.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    for m in marks {
        if let Mark::Crosses(_, c, _) = m {
            pts.extend(c.iter().copied());
        }
    }
    chart(title, x0..x1, 0f64..y1, Some(&pts), |chart| {
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
        for m in marks {
            match m {
                Mark::Vertical(name, xs) => {
                    let grey = RGBColor(110, 110, 110);
                    let mut first = true;
                    for &vx in xs {
                        let drawn = chart
                            .draw_series(DashedLineSeries::new(
                                [(vx, 0.0), (vx, y1)],
                                5,
                                4,
                                grey.stroke_width(1),
                            ))
                            .ok()?;
                        if std::mem::take(&mut first) {
                            drawn.label(name.as_str()).legend(move |(a, b)| {
                                PathElement::new(vec![(a, b), (a + 20, b)], grey.stroke_width(1))
                            });
                        }
                    }
                }
                Mark::Crosses(name, at, colour) => {
                    let red = colour.map_or(RGBColor(200, 0, 0), |i| COLOURS[i % COLOURS.len()]);
                    chart
                        .draw_series(at.iter().map(|&p| Cross::new(p, 6, red.stroke_width(2))))
                        .ok()?
                        .label(name.as_str())
                        .legend(move |(a, b)| Cross::new((a + 10, b), 6, red.stroke_width(2)));
                }
            }
        }
        Some(())
    })
}

/// Labelled points, each in its own colour, named in the legend (in the corner with the
/// fewest points) and, where the name fits without touching an earlier one, beside the
/// point in the point's colour: close points keep their names apart in the legend instead of
/// having them pushed away from the points they name.
pub(crate) fn scatter(title: &str, x: &str, y: &str, pts: &[(String, f64, f64)]) -> Option<String> {
    let series = vec![(String::new(), pts.iter().map(|p| (p.1, p.2)).collect())];
    let (x0, x1, y1) = bounds(&series, true)?;
    let pad = (x1 - x0) * 0.15;
    let points: Vec<(f64, f64)> = pts.iter().map(|p| (p.1, p.2)).collect();
    chart(title, (x0 - pad)..(x1 + pad), 0f64..y1, Some(&points), |chart| {
        chart.configure_mesh().x_desc(x).y_desc(y).draw().ok()?;
        let (w, h) = (x1 - x0 + 2.0 * pad, y1);
        let mut named: Vec<(f64, f64)> = Vec::new();
        for (i, (name, px, py)) in pts.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            let label = name.split(" (").next().unwrap_or(name).to_string();
            chart
                .draw_series(std::iter::once(Circle::new((*px, *py), 5, c.filled())))
                .ok()?
                .label(label.as_str())
                .legend(move |(a, b)| Circle::new((a + 10, b), 5, c.filled()));
            // A name is about 12% of the width wide and 5% of the height tall.
            let clear = named
                .iter()
                .all(|&(qx, qy)| (qx - px).abs() >= 0.13 * w || (qy - py).abs() >= 0.05 * h);
            if clear {
                named.push((*px, *py));
                let font = ("sans-serif", 13).into_font().color(&c);
                let name = EmptyElement::at((*px, *py)) + Text::new(label, (8, -6), font);
                chart.draw_series(std::iter::once(name)).ok()?;
            }
        }
        Some(())
    })
}

/// One measured series with its fitted curve: name, measured points, fit label and the fit
/// sampled at the x values to draw.
pub(crate) type FittedSeries = (String, Vec<(f64, f64)>, String, Vec<(f64, f64)>);

/// Measured points (markers joined by nothing) with each series' fitted curve dashed, both
/// in the legend.
pub(crate) fn measured_and_fit(
    title: &str,
    x: &str,
    y: &str,
    series: &[FittedSeries],
) -> Option<String> {
    let all: Vec<Series> = series
        .iter()
        .flat_map(|(n, p, f, c)| [(n.clone(), p.clone()), (f.clone(), c.clone())])
        .collect();
    let (x0, x1, y1) = bounds(&all, true)?;
    let pts: Vec<(f64, f64)> = all.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    chart(title, x0..x1, 0f64..y1, Some(&pts), |chart| {
        chart.configure_mesh().x_desc(x).y_desc(y).draw().ok()?;
        for (i, (name, pts, fit_name, fit)) in series.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .ok()?
                .label(name.as_str())
                .legend(move |(a, b)| Circle::new((a + 10, b), 4, c.filled()));
            chart
                .draw_series(DashedLineSeries::new(fit.iter().copied(), 6, 4, c.stroke_width(1)))
                .ok()?
                .label(fit_name.as_str())
                .legend(move |(a, b)| {
                    PathElement::new(vec![(a, b), (a + 20, b)], c.stroke_width(1))
                });
        }
        Some(())
    })
}

/// The mesh of a bar chart: one label under the middle of each bar slot, `y` on the side.
fn bar_axes(chart: &mut Chart<'_, '_>, labels: Vec<String>, y: &str) -> Option<()> {
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(labels.len() * 2 + 1)
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
        .ok()
}

/// Stacked bars, one colour per part, with each bar's total written above it (`unit` after the
/// number).
pub(crate) fn stacked_with_totals(
    title: &str,
    y: &str,
    unit: &str,
    parts: &[&str],
    bars: &[(String, Vec<f64>)],
) -> Option<String> {
    let top = bars.iter().map(|(_, v)| v.iter().sum::<f64>()).fold(0f64, f64::max) * 1.3;
    let n = bars.len() as f64;
    let pts = bar_tops(bars.iter().map(|(_, v)| v.iter().sum::<f64>()));
    chart(title, 0f64..n, 0f64..top.max(1.0), Some(&pts), |chart| {
        bar_axes(chart, bars.iter().map(|(l, _)| l.clone()).collect(), y)?;
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
        let totals = bars.iter().enumerate().map(|(i, (_, v))| {
            let total: f64 = v.iter().sum();
            let text = if total >= 100.0 {
                format!("{total:.0} {unit}")
            } else {
                format!("{total:.1} {unit}")
            };
            Text::new(text, (i as f64 + 0.25, total + top * 0.02), ("sans-serif", 12).into_font())
        });
        chart.draw_series(totals).ok()?;
        Some(())
    })
}

/// Grouped bars: one group per label, one bar per series in it, each bar's value written
/// above it (`unit` after the number).
pub(crate) fn grouped_bars(
    title: &str,
    y: &str,
    unit: &str,
    series: &[&str],
    groups: &[(String, Vec<f64>)],
) -> Option<String> {
    let top = groups.iter().flat_map(|(_, v)| v.iter().copied()).fold(0f64, f64::max) * 1.25;
    let n = groups.len() as f64;
    let per = series.len().max(1) as f64;
    let pts = bar_tops(groups.iter().map(|(_, v)| v.iter().copied().fold(0f64, f64::max)));
    chart(title, 0f64..n, 0f64..top.max(1.0), Some(&pts), |chart| {
        bar_axes(chart, groups.iter().map(|(l, _)| l.clone()).collect(), y)?;
        let width = 0.8 / per;
        for (k, name) in series.iter().enumerate() {
            let c = COLOURS[k % COLOURS.len()];
            let left = |i: usize| i as f64 + 0.1 + k as f64 * width;
            let rects = groups.iter().enumerate().filter_map(|(i, (_, v))| {
                v.get(k).map(|&h| {
                    Rectangle::new([(left(i), 0.0), (left(i) + width * 0.9, h)], c.filled())
                })
            });
            chart
                .draw_series(rects)
                .ok()?
                .label(*name)
                .legend(move |(a, b)| Rectangle::new([(a, b - 5), (a + 12, b + 5)], c.filled()));
            let texts = groups.iter().enumerate().filter_map(|(i, (_, v))| {
                v.get(k).map(|&h| {
                    let text = if h >= 100.0 { format!("{h:.0}") } else { format!("{h:.1}") };
                    Text::new(
                        format!("{text}{unit}"),
                        (left(i), h + top * 0.02),
                        ("sans-serif", 11).into_font(),
                    )
                })
            });
            chart.draw_series(texts).ok()?;
        }
        Some(())
    })
}
