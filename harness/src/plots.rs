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
    Some((x0, if x1 > x0 { x1 } else { x0 + 1.0 }, if y1 > 0.0 { y1 * 1.15 } else { 1.0 }))
}

/// Common cards' memory in GiB, for capacity lines on real-size memory plots.
const CARDS: &[(&str, f64)] = &[
    ("16 GiB card (V100, T4)", 16.0),
    ("24 GiB card (RTX 4090, A10)", 24.0),
    ("40 GiB card (A100 40GB)", 40.0),
    ("80 GiB card (A100, H100)", 80.0),
];

/// The capacity lines worth drawing on a plot whose largest value is `max_gib`: the cards
/// the data pass and the next larger one within reach (at most 4x the data's top), the two
/// nearest the data at most; none for data far below every card.
pub(crate) fn cards_near(max_gib: f64) -> Vec<(String, f64)> {
    let passed = CARDS.iter().filter(|c| c.1 <= max_gib);
    let next = CARDS.iter().find(|c| c.1 > max_gib && c.1 <= 4.0 * max_gib);
    let mut out: Vec<(String, f64)> =
        passed.chain(next).map(|(n, g)| (n.to_string(), *g)).collect();
    if out.len() > 2 {
        out.drain(..out.len() - 2);
    }
    out
}

/// Width of the panel right of the plot that holds the legend, in pixels: the legend never
/// covers data.
const LEGEND_WIDTH: u32 = 390;
/// Characters per line of a chart's title (18 px sans-serif across the plot and the legend)
/// and the height of a line.
const TITLE_CHARS: usize = 110;
const TITLE_LINE: u32 = 24;

/// How an entry of the legend shows its series.
#[derive(Clone, Copy)]
enum Sample {
    /// A solid line of this width.
    Line(RGBColor, u32),
    /// A dashed line of this width.
    Dashed(RGBColor, u32),
    /// A filled circle.
    Dot(RGBColor),
    /// A cross.
    Cross(RGBColor),
    /// A filled square (a bar's colour).
    Square(RGBColor),
}

/// The legend's entries, in the order drawn.
type Legend = Vec<(Sample, String)>;

/// Draws `entries` into `area` from the top: each sample, then its text, wrapped at about
/// 54 characters.
fn draw_legend(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    entries: &Legend,
) -> Option<()> {
    let font = ("sans-serif", 12).into_font();
    let mut y = 24i32;
    for (sample, text) in entries {
        let (x0, x1) = (8i32, 30i32);
        match *sample {
            Sample::Line(c, w) => {
                area.draw(&PathElement::new(vec![(x0, y), (x1, y)], c.stroke_width(w))).ok()?
            }
            Sample::Dashed(c, w) => {
                for k in (x0..x1).step_by(7) {
                    let seg = vec![(k, y), ((k + 4).min(x1), y)];
                    area.draw(&PathElement::new(seg, c.stroke_width(w))).ok()?;
                }
            }
            Sample::Dot(c) => area.draw(&Circle::new((19, y), 5, c.filled())).ok()?,
            Sample::Cross(c) => area.draw(&Cross::new((19, y), 6, c.stroke_width(2))).ok()?,
            Sample::Square(c) => {
                area.draw(&Rectangle::new([(13, y - 6), (25, y + 6)], c.filled())).ok()?
            }
        }
        for (i, line) in wrap(text, 54).iter().enumerate() {
            let at = (38, y - 7 + 15 * i as i32);
            area.draw(&Text::new(line.clone(), at, font.clone())).ok()?;
        }
        y += 15 * wrap(text, 54).len() as i32 + 8;
    }
    Some(())
}

/// `text` in lines of at most `width` characters, broken at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for word in text.split(' ') {
        let last = lines.last_mut().expect("one line at least");
        if !last.is_empty() && last.chars().count() + 1 + word.chars().count() > width {
            lines.push(word.to_string());
        } else {
            if !last.is_empty() {
                last.push(' ');
            }
            last.push_str(word);
        }
    }
    lines
}

/// Draws a titled cartesian chart over `x` and `y` into an SVG string; `body` draws in it
/// and lists its series in the legend, drawn in a panel right of the plot (never over the
/// data).
fn chart(
    title: &str,
    x: Range<f64>,
    y: Range<f64>,
    body: impl FnOnce(&mut Chart<'_, '_>, &mut Legend) -> Option<()>,
) -> Option<String> {
    let mut svg = String::new();
    {
        // The title across the whole width, wrapped (a title that names its model, dropout,
        // attention form and precision is long), above the plot and the legend.
        let lines = wrap(title, TITLE_CHARS);
        let title_height = TITLE_LINE * lines.len() as u32 + 12;
        let root =
            SVGBackend::with_string(&mut svg, (SIZE.0 + LEGEND_WIDTH, SIZE.1 + title_height))
                .into_drawing_area();
        root.fill(&WHITE).ok()?;
        let (top, rest) = root.split_vertically(title_height);
        let font = ("sans-serif", 18).into_font();
        for (i, line) in lines.iter().enumerate() {
            let at = (12, 8 + (TITLE_LINE * i as u32) as i32);
            top.draw(&Text::new(line.clone(), at, font.clone())).ok()?;
        }
        let (plot, side) = rest.split_horizontally(SIZE.0);
        let mut chart = ChartBuilder::on(&plot)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x, y)
            .ok()?;
        let mut legend = Legend::new();
        body(&mut chart, &mut legend)?;
        draw_legend(&side, &legend)?;
        root.present().ok()?;
    }
    Some(svg)
}

/// A dashed horizontal line at `at` across the chart, labelled in the legend: the capacity
/// of a card, where the data approach or pass it.
fn capacity_line(
    chart: &mut Chart<'_, '_>,
    legend: &mut Legend,
    x: &Range<f64>,
    (name, at): &(String, f64),
    i: usize,
) -> Option<()> {
    // One colour per card (`i`: its place among the chart's capacity lines), so that two
    // lines are told apart.
    const CAPACITY: [RGBColor; 2] = [RGBColor(200, 0, 0), RGBColor(120, 0, 150)];
    let red = CAPACITY[i % CAPACITY.len()];
    chart
        .draw_series(DashedLineSeries::new(
            [(x.start, *at), (x.end, *at)],
            8,
            5,
            red.stroke_width(2),
        ))
        .ok()?;
    legend.push((Sample::Dashed(red, 2), name.clone()));
    Some(())
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
    /// A card's capacity: a dashed red horizontal line at this y.
    Capacity(String, f64),
}

/// The y range a set of marks needs (capacities and error bars must be in the chart).
fn marks_top(marks: &[Mark]) -> f64 {
    marks
        .iter()
        .map(|m| match m {
            Mark::Capacity(_, y) => *y * 1.08,
            Mark::Crosses(_, c, _) => c.iter().map(|p| p.1 * 1.1).fold(0.0, f64::max),
            Mark::Vertical(..) => 0.0,
        })
        .fold(0.0, f64::max)
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
    let y1 = y1.max(marks_top(marks));
    chart(title, x0..x1, 0f64..y1, |chart, legend| {
        chart.configure_mesh().x_desc(x).y_desc(y).draw().ok()?;
        for (i, (name, pts)) in series.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            chart.draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2))).ok()?;
            legend.push((Sample::Line(c, 2), name.clone()));
            if points {
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled()))).ok()?;
            }
        }
        let mut cards = 0;
        for m in marks {
            match m {
                Mark::Vertical(name, xs) => {
                    let grey = RGBColor(110, 110, 110);
                    for &vx in xs {
                        chart
                            .draw_series(DashedLineSeries::new(
                                [(vx, 0.0), (vx, y1)],
                                5,
                                4,
                                grey.stroke_width(1),
                            ))
                            .ok()?;
                    }
                    if !xs.is_empty() {
                        legend.push((Sample::Dashed(grey, 1), name.clone()));
                    }
                }
                Mark::Crosses(name, at, colour) => {
                    let red = colour.map_or(RGBColor(200, 0, 0), |i| COLOURS[i % COLOURS.len()]);
                    chart
                        .draw_series(at.iter().map(|&p| Cross::new(p, 6, red.stroke_width(2))))
                        .ok()?;
                    legend.push((Sample::Cross(red), name.clone()));
                }
                Mark::Capacity(name, at) => {
                    capacity_line(chart, legend, &(x0..x1), &(name.clone(), *at), cards)?;
                    cards += 1;
                }
            }
        }
        Some(())
    })
}

/// Labelled points, each in its own colour, named in the legend (in the corner with the
/// fewest points) and, where the name fits without touching an earlier one or covering
/// another point, beside the point in the point's colour: close points keep their names apart in the legend instead of
/// having them pushed away from the points they name.
/// With a horizontal error bar per point where `x_intervals` has one (the same order as
/// `pts`; `None` for a point without an interval): an x that is a mean with its confidence
/// interval.
pub(crate) fn scatter(
    title: &str,
    x: &str,
    y: &str,
    pts: &[(String, f64, f64)],
    x_intervals: &[Option<(f64, f64)>],
) -> Option<String> {
    let mut extent: Vec<(f64, f64)> = pts.iter().map(|p| (p.1, p.2)).collect();
    for (p, i) in pts.iter().zip(x_intervals) {
        if let Some((lo, hi)) = i {
            extent.extend([(*lo, p.2), (*hi, p.2)]);
        }
    }
    let series = vec![(String::new(), extent)];
    let (x0, x1, y1) = bounds(&series, true)?;
    let x1 = x1.max(x0 + 1e-9);
    let pad = (x1 - x0) * 0.15;
    chart(title, (x0 - pad)..(x1 + pad), 0f64..y1, |chart, legend| {
        chart.configure_mesh().x_desc(x).y_desc(y).draw().ok()?;
        let (w, h) = (x1 - x0 + 2.0 * pad, y1);
        let mut named: Vec<(f64, f64)> = Vec::new();
        for (i, (name, px, py)) in pts.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            if let Some(Some((lo, hi))) = x_intervals.get(i) {
                let cap = h * 0.012;
                let lines = [
                    vec![(*lo, *py), (*hi, *py)],
                    vec![(*lo, py - cap), (*lo, py + cap)],
                    vec![(*hi, py - cap), (*hi, py + cap)],
                ];
                chart
                    .draw_series(lines.into_iter().map(|l| PathElement::new(l, c.stroke_width(1))))
                    .ok()?;
            }
            let label = name.split(" (").next().unwrap_or(name).to_string();
            chart.draw_series(std::iter::once(Circle::new((*px, *py), 5, c.filled()))).ok()?;
            legend.push((Sample::Dot(c), name.clone()));
            // A name is about 12% of the width wide and 5% of the height tall, right of and
            // just above its point: it must neither touch a name already written nor cover
            // another point.
            let clear = named
                .iter()
                .all(|&(qx, qy)| (qx - px).abs() >= 0.13 * w || (qy - py).abs() >= 0.05 * h)
                && pts.iter().enumerate().all(|(j, (_, qx, qy))| {
                    let covered = (0.0..0.13 * w).contains(&(qx - px))
                        && (-0.01 * h..0.06 * h).contains(&(qy - py));
                    j == i || !covered
                });
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
/// in the legend, and cards' capacities as dashed red lines.
pub(crate) fn measured_and_fit(
    title: &str,
    x: &str,
    y: &str,
    series: &[FittedSeries],
    capacities: &[(String, f64)],
) -> Option<String> {
    let all: Vec<Series> = series
        .iter()
        .flat_map(|(n, p, f, c)| [(n.clone(), p.clone()), (f.clone(), c.clone())])
        .collect();
    let (x0, x1, y1) = bounds(&all, true)?;
    let y1 = capacities.iter().map(|c| c.1 * 1.08).fold(y1, f64::max);
    chart(title, x0..x1, 0f64..y1, |chart, legend| {
        chart.configure_mesh().x_desc(x).y_desc(y).draw().ok()?;
        for (i, c) in capacities.iter().enumerate() {
            capacity_line(chart, legend, &(x0..x1), c, i)?;
        }
        for (i, (name, pts, fit_name, fit)) in series.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled()))).ok()?;
            legend.push((Sample::Dot(c), name.clone()));
            chart
                .draw_series(DashedLineSeries::new(fit.iter().copied(), 6, 4, c.stroke_width(1)))
                .ok()?;
            legend.push((Sample::Dashed(c, 1), fit_name.clone()));
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
    chart(title, 0f64..n, 0f64..top.max(1.0), |chart, legend| {
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
            chart.draw_series(rects).ok()?;
            legend.push((Sample::Square(c), part.to_string()));
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
    chart(title, 0f64..n, 0f64..top.max(1.0), |chart, legend| {
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
            chart.draw_series(rects).ok()?;
            legend.push((Sample::Square(c), name.to_string()));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn height(svg: &str) -> u32 {
        let at = svg.find("height=\"").expect("an SVG height") + 8;
        svg[at..].split('"').next().and_then(|h| h.parse().ok()).expect("a number")
    }

    #[test]
    fn a_long_title_wraps_into_lines_and_the_chart_grows_to_hold_them() {
        let series = [("a".to_string(), vec![(0.0, 1.0), (1.0, 2.0)])];
        let draw = |title: &str| lines_with_marks(title, "x (s)", "y (MiB)", &series, false, &[]);
        let short = draw("short title").unwrap();
        let long_title = format!("{}zebra", "word ".repeat(50));
        let long = draw(&long_title).unwrap();
        assert_eq!(wrap(&long_title, TITLE_CHARS).len(), 3);
        assert_eq!(height(&long), height(&short) + 2 * TITLE_LINE);
        // Every word is drawn, the last on the third line.
        assert!(short.contains("short title"));
        assert!(long.contains("zebra"), "the title's last line");
    }

    #[test]
    fn a_point_name_that_would_cover_another_point_is_left_to_the_legend() {
        let pts = |names: [&str; 3]| {
            let at = [(0.0, 10.0), (0.5, 10.0), (10.0, 1.0)];
            names.iter().zip(at).map(|(n, (x, y))| (format!("{n} (more)"), x, y)).collect()
        };
        let names = ["alpha", "bravo", "charlie"];
        let pts: Vec<(String, f64, f64)> = pts(names);
        let svg = scatter("t", "x (%)", "y (MiB)", &pts, &[None, None, None]).unwrap();
        // In the legend each full name once; beside its point the short name, unless bravo
        // (0.5 to the right, at the same height) would lie under it.
        let beside = |n: &str| svg.matches(&format!(">\n{n}\n<")).count();
        assert_eq!(svg.matches("alpha (more)").count(), 1);
        assert_eq!([beside("alpha"), beside("bravo"), beside("charlie")], [0, 1, 1]);
    }
}
