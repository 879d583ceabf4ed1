//! A small SVG writer for `upipe report`, `upipe plan --svg` and `upipe
//! eval --task`: line charts (one `<polyline>` per series), stacked bars
//! of bytes by category, and heatmaps (`heatmap.rs`). Written by hand:
//! the charts need a handful of elements, not a plotting library; where
//! their labels go is `layout.rs`.

pub mod heatmap;
pub mod layout;

use crate::backend::Bytes;
use layout::{Rect, SWATCH, axis, byte_unit, legend, legend_height, text_width};
use std::fmt::Write;

/// Fill colours of the memory categories and curves, in order.
pub const PALETTE: [&str; 8] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f",
];

/// An SVG document being written.
pub struct Svg {
    width: f64,
    height: f64,
    body: String,
}

/// A plotting area inside a document, in its pixels.
#[derive(Debug, Clone, Copy)]
pub struct Area {
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
}

/// One curve of a line chart.
pub struct Series<'a> {
    pub name: &'a str,
    pub points: Vec<(f64, f64)>,
}

/// One bar of a stacked bar chart: its label and its segments
/// (`(name, bytes)`, drawn in [`PALETTE`] order).
pub struct Bar {
    pub label: String,
    pub segments: Vec<(String, f64)>,
}

/// Text with `&`, `<`, `>` and quotes escaped.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Svg {
    pub fn new(width: f64, height: f64) -> Self {
        let mut s = Svg {
            width,
            height,
            body: String::new(),
        };
        s.rect(0.0, 0.0, width, height, "#ffffff", None);
        s
    }

    pub fn text(&mut self, x: f64, y: f64, size: f64, anchor: &str, s: &str) {
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}" text-anchor="{anchor}" font-family="sans-serif">{}</text>"#,
            escape(s)
        );
    }

    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, fill: &str, title: Option<&str>) {
        let _ = write!(
            self.body,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{fill}">"#,
            w.max(0.0),
            h.max(0.0)
        );
        if let Some(t) = title {
            let _ = write!(self.body, "<title>{}</title>", escape(t));
        }
        self.body.push_str("</rect>\n");
    }

    pub fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), stroke: &str) {
        let _ = writeln!(
            self.body,
            r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{stroke}" stroke-width="1"/>"#
        );
    }

    fn polyline(&mut self, points: &[(f64, f64)], stroke: &str, name: &str) {
        let pts: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = writeln!(
            self.body,
            r#"<polyline points="{}" fill="none" stroke="{stroke}" stroke-width="1.5"><title>{}</title></polyline>"#,
            pts.join(" "),
            escape(name)
        );
    }

    /// The finished document.
    pub fn finish(self) -> String {
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\n{}</svg>\n",
            self.body,
            w = self.width,
            h = self.height
        )
    }
}

/// Font sizes of tick labels and of axis names.
const TICK_FONT: f64 = 10.0;
const NAME_FONT: f64 = 11.0;

/// A line chart in `area`: axes with ticks at round values (whole numbers
/// on x when `integer_x`, as steps are), and one polyline per series (its
/// finite points).
pub fn line_chart(
    svg: &mut Svg,
    area: Area,
    title: &str,
    (x_label, integer_x): (&str, bool),
    series: &[Series],
) {
    let Area { x, y, w, h } = area;
    svg.text(x + w / 2.0, y - 8.0, 14.0, "middle", title);
    svg.line((x, y), (x, y + h), "#333333");
    svg.line((x, y + h), (x + w, y + h), "#333333");
    let all = || series.iter().flat_map(|s| s.points.iter());
    let ya = axis(all().map(|p| p.1), 6, false);
    for (v, label) in ya.ticks.iter().zip(&ya.labels) {
        let py = ya.place(*v, y + h, y);
        svg.line((x - 4.0, py), (x, py), "#333333");
        svg.text(x - 6.0, py + 4.0, TICK_FONT, "end", label);
    }
    let xa = x_axis(all().map(|p| p.0), w, integer_x);
    for (v, label) in xa.ticks.iter().zip(&xa.labels) {
        let px = xa.place(*v, x, x + w);
        svg.line((px, y + h), (px, y + h + 4.0), "#333333");
        svg.text(px, y + h + 15.0, TICK_FONT, "middle", label);
    }
    svg.text(x + w / 2.0, y + h + 30.0, NAME_FONT, "middle", x_label);
    for (i, s) in series.iter().enumerate() {
        let px: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|p| (xa.place(p.0, x, x + w), ya.place(p.1, y + h, y)))
            .collect();
        svg.polyline(&px, PALETTE[i % PALETTE.len()], s.name);
    }
}

/// The x axis of a chart `w` wide: as many ticks as fit with their labels
/// apart.
fn x_axis(values: impl Iterator<Item = f64> + Clone, w: f64, integer: bool) -> layout::Axis {
    let mut ticks = 8;
    loop {
        let a = axis(values.clone(), ticks, integer);
        let widest = a
            .labels
            .iter()
            .map(|l| text_width(l, TICK_FONT))
            .fold(0.0, f64::max);
        let gap = w / (a.ticks.len() - 1) as f64;
        if gap >= widest + 8.0 || ticks == 2 {
            return a;
        }
        ticks -= 1;
    }
}

/// Horizontal stacked bars of bytes in `area`, one per [`Bar`], in the
/// binary unit of the largest total (the title's `{unit}` becomes it),
/// scaled to the largest total (or `limit`, drawn as a line with its name,
/// when larger), each total at its end, and a legend of the segment names
/// flowed into rows under the bars.
pub fn stacked_bars(
    svg: &mut Svg,
    area: Area,
    title: &str,
    bars: &[Bar],
    limit: Option<(f64, &str)>,
) {
    let Area { x, y, w, h } = area;
    let total = |b: &Bar| b.segments.iter().map(|s| s.1.max(0.0)).sum::<f64>();
    let max = bars
        .iter()
        .map(total)
        .chain(limit.map(|l| l.0))
        .fold(0.0, f64::max)
        .max(1.0);
    let (per_unit, unit) = byte_unit(max);
    svg.text(
        x + w / 2.0,
        y - 8.0,
        14.0,
        "middle",
        &title.replace("{unit}", unit),
    );
    let names: Vec<String> = bars
        .first()
        .map(|b| b.segments.iter().map(|s| s.0.clone()).collect())
        .unwrap_or_default();
    let keys = legend(&names, x, 0.0, w, TICK_FONT);
    let keys_h = legend_height(&keys);
    let limit_h = if limit.is_some() { 14.0 } else { 0.0 };
    let bars_h = (h - keys_h - limit_h - 8.0).max(10.0);
    let row = bars_h / bars.len().max(1) as f64;
    let label_w = bars
        .iter()
        .map(|b| text_width(&b.label, NAME_FONT))
        .fold(40.0, f64::max)
        + 8.0;
    let total_w = text_width("1023.99 MiB", TICK_FONT) + 6.0;
    let scale = (w - label_w - total_w) / max;
    for (i, b) in bars.iter().enumerate() {
        let by = y + i as f64 * row + row * 0.15;
        svg.text(
            x + label_w - 6.0,
            by + row * 0.4,
            NAME_FONT,
            "end",
            &b.label,
        );
        let mut bx = x + label_w;
        for (j, (name, v)) in b.segments.iter().enumerate() {
            let bw = v.max(0.0) * scale;
            let tip = format!("{}: {name} {}", b.label, Bytes(v.max(0.0) as usize));
            let fill = PALETTE[j % PALETTE.len()];
            svg.rect(bx, by, bw, row * 0.7, fill, Some(&tip));
            bx += bw;
        }
        let text = format!("{:.2} {unit}", total(b) / per_unit);
        svg.text(bx + 4.0, by + row * 0.4, TICK_FONT, "start", &text);
    }
    if let Some((v, name)) = limit {
        let lx = x + label_w + v * scale;
        svg.line((lx, y), (lx, y + bars_h), "#000000");
        let text = format!("{name} {:.2} {unit}", v / per_unit);
        svg.text(lx, y + bars_h + 11.0, TICK_FONT, "middle", &text);
    }
    let top = y + bars_h + limit_h + 8.0;
    for (j, (k, name)) in keys.iter().zip(&names).enumerate() {
        let Rect { x: kx, y: ky, .. } = *k;
        let fill = PALETTE[j % PALETTE.len()];
        svg.rect(kx, top + ky, SWATCH, SWATCH, fill, None);
        svg.text(kx + SWATCH + 4.0, top + ky + 9.0, TICK_FONT, "start", name);
    }
}
