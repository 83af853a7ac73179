//! `--plot FILE.svg|FILE.png`: the memory timeline as stacked areas by category, with the running
//! and waiting requests on a second axis. Text is laid out with DejaVu Sans Mono, embedded (its
//! licence is in `font/LICENSE-DejaVu`), so neither backend needs system font libraries; PNG is the
//! bitmap backend's RGB buffer written by the `image` crate.

use super::timeline::{Event, Sample};
use crate::UsageError;
use anyhow::{anyhow, Context, Result};
use kvlens_engine::memory::GIB;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;
use std::sync::OnceLock;

const SIZE: (u32, u32) = (1200, 640);
const FONT: &[u8] = include_bytes!("font/DejaVuSansMono.ttf");

/// A plotted quantity: name, colour, value of a sample.
type Series = (&'static str, RGBColor, fn(&Sample) -> u64);

/// The stacked layers (bytes), bottom first. The weights are constant and usually dwarf the rest,
/// so they are named in the caption instead of stacked.
const LAYERS: [Series; 5] = [
    ("KV in use", RGBColor(31, 119, 180), |s| s.kv_in_use_bytes),
    ("KV cached-free", RGBColor(158, 202, 225), |s| s.kv_cached_free_bytes),
    ("encoder cache", RGBColor(255, 127, 14), |s| s.encoder_cache_bytes),
    ("activations", RGBColor(214, 39, 40), |s| s.activations_bytes),
    ("processor cache (host)", RGBColor(148, 103, 189), |s| {
        s.processor_cache_bytes
    }),
];

/// The request counts, on the second axis.
const QUEUES: [Series; 2] = [
    ("requests running", BLACK, |s| s.num_running),
    ("requests waiting", RGBColor(44, 160, 44), |s| s.num_waiting),
];

fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    ok.then_some(())
        .ok_or_else(|| anyhow!("the embedded font does not load"))
}

/// Draws the samples (and the after-run events as vertical lines) into `path`; the extension picks
/// SVG or PNG.
pub fn draw(samples: &[Sample], events: &[Event], path: &Path) -> Result<()> {
    register_font()?;
    let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    let fail = |e: String| anyhow!("drawing {}: {e}", path.display());
    match ext.as_deref() {
        Some("svg") => chart(SVGBackend::new(path, SIZE).into_drawing_area(), samples, events).map_err(fail),
        Some("png") => {
            let mut rgb = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
            chart(
                BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area(),
                samples,
                events,
            )
            .map_err(fail)?;
            image::RgbImage::from_raw(SIZE.0, SIZE.1, rgb)
                .context("plot buffer")?
                .save_with_format(path, image::ImageFormat::Png)
                .with_context(|| format!("cannot write {}", path.display()))
        }
        _ => Err(UsageError(format!("--plot {}: give a .svg or .png file", path.display())).into()),
    }
}

fn chart<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, samples: &[Sample], events: &[Event]) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let t_end = samples.iter().map(|s| s.t).fold(0.0, f64::max).max(1e-3);
    let top = |s: &Sample| LAYERS.iter().map(|(_, _, f)| f(s)).sum::<u64>();
    let peak = samples.iter().map(top).max().unwrap_or(0);
    let (unit, scale) = if peak >= 1 << 30 {
        ("GiB", GIB)
    } else {
        ("MiB", (1u64 << 20) as f64)
    };
    let y_end = (peak as f64 / scale * 1.15).max(1e-3);
    let requests = samples.iter().map(|s| s.num_running + s.num_waiting).max().unwrap_or(0);
    let weights = samples.iter().map(|s| s.weights_bytes).max().unwrap_or(0);
    let caption = format!(
        "kvlens bench serve: memory by category (weights {:.2} GiB, constant, not stacked)",
        weights as f64 / GIB
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .right_y_label_area_size(60)
        .build_cartesian_2d(0.0..t_end, 0.0..y_end)
        .map_err(err)?
        .set_secondary_coord(0.0..t_end, 0.0..(requests as f64 * 1.15).max(1.0));
    chart
        .configure_mesh()
        .x_desc("time since the first request (s)")
        .y_desc(format!("memory ({unit})"))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    chart
        .configure_secondary_axes()
        .y_desc("requests")
        .draw()
        .map_err(err)?;
    let mut below = vec![0u64; samples.len()];
    for (name, colour, bytes) in LAYERS {
        let above: Vec<u64> = samples.iter().zip(&below).map(|(s, b)| b + bytes(s)).collect();
        let outline = samples
            .iter()
            .zip(&above)
            .map(|(s, a)| (s.t, *a as f64 / scale))
            .chain(samples.iter().zip(&below).rev().map(|(s, b)| (s.t, *b as f64 / scale)));
        chart
            .draw_series(std::iter::once(Polygon::new(
                outline.collect::<Vec<_>>(),
                colour.mix(0.85).filled(),
            )))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], colour.filled()));
        below = above;
    }
    for (name, colour, count) in QUEUES {
        chart
            .draw_secondary_series(LineSeries::new(
                samples.iter().map(|s| (s.t, count(s) as f64)),
                colour.stroke_width(2),
            ))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], colour.stroke_width(2)));
    }
    for e in events {
        chart
            .draw_series(std::iter::once(PathElement::new(
                [(e.t, 0.0), (e.t, y_end)],
                RGBColor(90, 90, 90).stroke_width(2),
            )))
            .map_err(err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{} ", e.what),
                (e.t, y_end * 0.97),
                ("sans-serif", 14)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Right, VPos::Top)),
            )))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Sample> {
        (0..20)
            .map(|i| Sample {
                t: i as f64 * 0.2,
                weights_bytes: 300 << 20,
                kv_in_use_bytes: (i % 7) << 22,
                kv_cached_free_bytes: i << 21,
                encoder_cache_bytes: (i / 3) << 20,
                processor_cache_bytes: 5 << 20,
                activations_bytes: (i % 2) << 24,
                num_running: i % 5,
                num_waiting: i % 3,
            })
            .collect()
    }

    #[test]
    fn svg_and_png() {
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("m.svg");
        let reset = [Event {
            t: 2.0,
            what: "POST /reset_encoder_cache".into(),
            status: 200,
        }];
        draw(&samples(), &reset, &svg).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains("<svg") && text.contains("encoder cache") && text.contains("memory (MiB)"));
        assert!(text.contains("POST /reset_encoder_cache") && text.contains("weights 0.29 GiB"));
        let png = dir.path().join("m.png");
        draw(&samples(), &[], &png).unwrap();
        let img = image::open(&png).unwrap();
        assert_eq!((img.width(), img.height()), SIZE);
        // Something besides the white background was drawn, text included.
        assert!(img.to_rgb8().pixels().filter(|p| p.0 != [255, 255, 255]).count() > 10_000);
        assert!(draw(&samples(), &[], &dir.path().join("m.pdf")).is_err());
        draw(&[], &[], &dir.path().join("empty.svg")).unwrap();
    }
}
