//! A small SVG writer for `upipe report` and `upipe plan --svg`: line
//! charts (one `<polyline>` per series) and stacked bars of bytes by
//! category. Written by hand: the charts need a handful of elements, not a
//! plotting library.

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
/// (`(name, value)`, drawn in [`PALETTE`] order).
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

/// `[lo, hi]` with room, never empty.
fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(v), h.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo < 1e-12 * hi.abs().max(1.0) {
        hi = lo + lo.abs().max(1.0) * 0.1;
        lo -= (hi - lo) * 0.5;
    }
    (lo, hi)
}

/// A short number for an axis label.
pub fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.1}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}K", v / 1e3)
    } else if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

/// A line chart in `area`: axes, four labelled ticks on y, the x range,
/// and one polyline per series (its points that are finite).
pub fn line_chart(svg: &mut Svg, area: Area, title: &str, x_label: &str, series: &[Series]) {
    let Area { x, y, w, h } = area;
    svg.text(x + w / 2.0, y - 8.0, 14.0, "middle", title);
    svg.line((x, y), (x, y + h), "#333333");
    svg.line((x, y + h), (x + w, y + h), "#333333");
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = range(all().map(|p| p.0));
    let (y0, y1) = range(all().map(|p| p.1));
    for i in 0..=4 {
        let v = y0 + (y1 - y0) * i as f64 / 4.0;
        let py = y + h - h * i as f64 / 4.0;
        svg.line((x - 4.0, py), (x, py), "#333333");
        svg.text(x - 6.0, py + 4.0, 10.0, "end", &short(v));
    }
    svg.text(x, y + h + 14.0, 10.0, "middle", &short(x0));
    svg.text(x + w, y + h + 14.0, 10.0, "middle", &short(x1));
    svg.text(x + w / 2.0, y + h + 28.0, 11.0, "middle", x_label);
    for (i, s) in series.iter().enumerate() {
        let px: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|p| {
                (
                    x + w * (p.0 - x0) / (x1 - x0),
                    y + h - h * (p.1 - y0) / (y1 - y0),
                )
            })
            .collect();
        svg.polyline(&px, PALETTE[i % PALETTE.len()], s.name);
    }
}

/// Horizontal stacked bars in `area`, one per [`Bar`], scaled to the largest
/// total (or `limit`, drawn as a line with its label, when larger), with a
/// legend of the segment names under the bars.
pub fn stacked_bars(
    svg: &mut Svg,
    area: Area,
    title: &str,
    bars: &[Bar],
    limit: Option<(f64, &str)>,
) {
    let Area { x, y, w, h } = area;
    svg.text(x + w / 2.0, y - 8.0, 14.0, "middle", title);
    let total = |b: &Bar| b.segments.iter().map(|s| s.1.max(0.0)).sum::<f64>();
    let max = bars
        .iter()
        .map(total)
        .chain(limit.map(|l| l.0))
        .fold(0.0, f64::max)
        .max(1.0);
    let legend_h = 20.0;
    let row = (h - legend_h) / bars.len().max(1) as f64;
    let label_w = 90.0;
    let scale = (w - label_w - 60.0) / max;
    for (i, b) in bars.iter().enumerate() {
        let by = y + i as f64 * row + row * 0.15;
        svg.text(x + label_w - 6.0, by + row * 0.45, 11.0, "end", &b.label);
        let mut bx = x + label_w;
        for (j, (name, v)) in b.segments.iter().enumerate() {
            let bw = v.max(0.0) * scale;
            let tip = format!("{}: {name} {}", b.label, short(*v));
            svg.rect(
                bx,
                by,
                bw,
                row * 0.7,
                PALETTE[j % PALETTE.len()],
                Some(&tip),
            );
            bx += bw;
        }
        svg.text(bx + 4.0, by + row * 0.45, 10.0, "start", &short(total(b)));
    }
    if let Some((v, name)) = limit {
        let lx = x + label_w + v * scale;
        svg.line((lx, y), (lx, y + h - legend_h), "#000000");
        svg.text(lx, y + h - legend_h + 10.0, 10.0, "middle", name);
    }
    let names = bars.first().map(|b| &b.segments[..]).unwrap_or(&[]);
    let step = w / names.len().max(1) as f64;
    for (j, (name, _)) in names.iter().enumerate() {
        let lx = x + j as f64 * step;
        svg.rect(
            lx,
            y + h - 8.0,
            10.0,
            10.0,
            PALETTE[j % PALETTE.len()],
            None,
        );
        svg.text(lx + 14.0, y + h + 1.0, 10.0, "start", name);
    }
}
