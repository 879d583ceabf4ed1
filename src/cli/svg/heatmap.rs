//! A heatmap of fractions in `[0, 1]` (`upipe eval --task`'s accuracy by
//! needle depth × context length): one coloured cell per value, red at 0
//! through yellow to green at 1, its percentage written in it, a colour
//! key beside.

use super::{Area, Svg};

/// A grid of values, `values[row][column]`, with its labels.
pub struct Heatmap<'a> {
    pub title: &'a str,
    pub column_name: &'a str,
    pub row_name: &'a str,
    pub columns: Vec<String>,
    pub rows: Vec<String>,
    /// `None`: no value (drawn grey).
    pub values: Vec<Vec<Option<f64>>>,
    /// Each cell's tooltip.
    pub tips: Vec<Vec<String>>,
}

/// Colour stops: red, yellow, green.
const STOPS: [(f64, [f64; 3]); 3] = [
    (0.0, [215.0, 48.0, 39.0]),
    (0.5, [254.0, 224.0, 139.0]),
    (1.0, [26.0, 152.0, 80.0]),
];

/// The colour of `v` in `[0, 1]` (clamped), as `#rrggbb`.
pub fn colour(v: f64) -> String {
    let v = if v.is_finite() {
        v.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let i = usize::from(v > STOPS[1].0);
    let ((a, ca), (b, cb)) = (STOPS[i], STOPS[i + 1]);
    let t = (v - a) / (b - a);
    let c: Vec<String> = (0..3)
        .map(|k| format!("{:02x}", (ca[k] + t * (cb[k] - ca[k])).round() as u8))
        .collect();
    format!("#{}", c.concat())
}

/// Draws `h` in `area` (the key takes its right 70 pixels; the title
/// goes 22 pixels above it).
pub fn heatmap(svg: &mut Svg, area: Area, h: &Heatmap) {
    let Area { x, y, w, h: height } = area;
    svg.text(x + w / 2.0, y - 22.0, 14.0, "middle", h.title);
    let label_w = 56.0;
    let (grid_x, grid_w) = (x + label_w, w - label_w - 70.0);
    let grid_h = height - 40.0;
    let (cols, rows) = (h.columns.len().max(1), h.rows.len().max(1));
    let (cw, rh) = (grid_w / cols as f64, grid_h / rows as f64);
    for (r, row) in h.values.iter().enumerate() {
        let cy = y + r as f64 * rh;
        svg.text(grid_x - 6.0, cy + rh / 2.0 + 4.0, 10.0, "end", &h.rows[r]);
        for (c, v) in row.iter().enumerate() {
            let cx = grid_x + c as f64 * cw;
            let fill = v.map_or("#cccccc".to_string(), colour);
            let tip = h.tips.get(r).and_then(|t| t.get(c)).map(String::as_str);
            svg.rect(cx, cy, cw - 1.0, rh - 1.0, &fill, tip);
            if let Some(v) = v
                && rh >= 11.0
            {
                let text = format!("{:.0}", v * 100.0);
                svg.text(cx + cw / 2.0, cy + rh / 2.0 + 4.0, 10.0, "middle", &text);
            }
        }
    }
    for (c, label) in h.columns.iter().enumerate() {
        let cx = grid_x + (c as f64 + 0.5) * cw;
        svg.text(cx, y + grid_h + 14.0, 10.0, "middle", label);
    }
    svg.text(
        grid_x + grid_w / 2.0,
        y + grid_h + 32.0,
        11.0,
        "middle",
        h.column_name,
    );
    svg.text(x + 4.0, y - 6.0, 11.0, "start", h.row_name);
    key(svg, grid_x + grid_w + 16.0, y, grid_h);
}

/// The colour key: 100 % at the top, 0 % at the bottom.
fn key(svg: &mut Svg, x: f64, y: f64, h: f64) {
    let steps = 20;
    let sh = h / steps as f64;
    for i in 0..steps {
        let v = 1.0 - (i as f64 + 0.5) / steps as f64;
        svg.rect(x, y + i as f64 * sh, 14.0, sh + 0.5, &colour(v), None);
    }
    svg.text(x + 18.0, y + 8.0, 10.0, "start", "100 %");
    svg.text(x + 18.0, y + h / 2.0 + 4.0, 10.0, "start", "50 %");
    svg.text(x + 18.0, y + h, 10.0, "start", "0 %");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colours_run_from_red_through_yellow_to_green() {
        assert_eq!(colour(0.0), "#d73027");
        assert_eq!(colour(0.5), "#fee08b");
        assert_eq!(colour(1.0), "#1a9850");
        assert_eq!(colour(2.0), colour(1.0));
        assert_eq!(colour(f64::NAN), colour(0.0));
    }

    #[test]
    fn every_cell_is_drawn_with_its_percentage_and_tip() {
        let mut svg = Svg::new(400.0, 300.0);
        let h = Heatmap {
            title: "t",
            column_name: "length",
            row_name: "depth",
            columns: vec!["4K".into(), "8K".into()],
            rows: vec!["0 %".into(), "100 %".into()],
            values: vec![vec![Some(1.0), Some(0.25)], vec![None, Some(0.0)]],
            tips: vec![vec!["a".into(), "b".into()], vec!["c".into(), "d".into()]],
        };
        heatmap(
            &mut svg,
            Area {
                x: 10.0,
                y: 30.0,
                w: 380.0,
                h: 250.0,
            },
            &h,
        );
        let doc = svg.finish();
        assert!(
            doc.contains(">100</text>") && doc.contains(">25</text>") && doc.contains(">0</text>")
        );
        assert!(doc.contains("#cccccc") && doc.contains("<title>d</title>"));
        assert!(doc.contains(">8K</text>") && doc.contains(">100 %</text>"));
    }
}
