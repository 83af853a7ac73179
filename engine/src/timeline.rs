//! The memory timeline: the engine's occupancy reduced to bytes per category and queue lengths
//! ([`Sample`], which `kvlens bench serve` reads from `/v1/memory`), and the recorder a lesson or a
//! chat fills ([`Recording`]): every occupancy the engine reported, with marks for what happened
//! between them (a reset, a lesson step, a preemption, an eviction). A recording is exported as
//! JSON, loaded back and replayed frame by frame, or drawn as an SVG like the bench's plot.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::VecDeque;

use crate::occupancy::Occupancy;

/// One reading of the engine's memory (`/v1/memory`, or an [`Occupancy`]), reduced to bytes per
/// category and the queues' lengths.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds after the recording's start.
    pub t: f64,
    /// Model weights.
    pub weights_bytes: u64,
    /// KV blocks referenced by requests.
    pub kv_in_use_bytes: u64,
    /// Free KV blocks that still hold a prefix-cache hash.
    pub kv_cached_free_bytes: u64,
    /// Vision-encoder outputs kept for reuse.
    pub encoder_cache_bytes: u64,
    /// Preprocessed images kept in host memory (the multimodal processor cache).
    pub processor_cache_bytes: u64,
    /// Transient activations.
    pub activations_bytes: u64,
    /// Requests running.
    pub num_running: u64,
    /// Requests waiting.
    pub num_waiting: u64,
}

fn u64_at(v: &Value, pointer: &str) -> Option<u64> {
    v.pointer(pointer).and_then(Value::as_u64)
}

/// Bytes of one ledger category: `[{"category": c, "bytes": n}, …]` or `{c: n | {"bytes": n}}`.
fn ledger(v: &Value, category: &str) -> Option<u64> {
    match v.get("ledger")? {
        Value::Array(entries) => entries
            .iter()
            .find(|e| e.get("category").and_then(Value::as_str) == Some(category))
            .and_then(|e| u64_at(e, "/bytes")),
        Value::Object(map) => map
            .get(category)
            .and_then(|e| e.as_u64().or_else(|| u64_at(e, "/bytes"))),
        _ => None,
    }
}

impl Sample {
    /// Reads a `/v1/memory` answer taken `t` seconds after the start. KV bytes are the ledger's
    /// KV pool shared out over the usable blocks (all but the null block).
    pub fn from_memory(t: f64, v: &Value) -> Sample {
        let kv_pool = ledger(v, "kv_cache").unwrap_or(0) as u128;
        let usable = u64_at(v, "/kv/num_blocks").unwrap_or(0).saturating_sub(1) as u128;
        let kv_share = |pointer: &str| match usable {
            0 => 0,
            n => (kv_pool * u64_at(v, pointer).unwrap_or(0) as u128 / n) as u64,
        };
        let encoder = ledger(v, "encoder_cache")
            .or_else(|| u64_at(v, "/encoder_cache/used_bytes"))
            .or_else(|| Some(u64_at(v, "/encoder_cache/used_tokens")? * u64_at(v, "/encoder_cache/bytes_per_token")?));
        let processor = u64_at(v, "/processor_cache/bytes_used").or_else(|| u64_at(v, "/processor_cache/used_bytes"));
        Sample {
            t,
            weights_bytes: ledger(v, "weights").unwrap_or(0),
            kv_in_use_bytes: kv_share("/kv/num_in_use"),
            kv_cached_free_bytes: kv_share("/kv/num_cached_free"),
            encoder_cache_bytes: encoder.unwrap_or(0),
            processor_cache_bytes: processor.unwrap_or(0),
            activations_bytes: ledger(v, "activations").unwrap_or(0),
            num_running: u64_at(v, "/num_running").unwrap_or(0),
            num_waiting: u64_at(v, "/num_waiting").unwrap_or(0),
        }
    }
}

impl Sample {
    /// The sample of an occupancy taken `t` seconds after the start.
    pub fn of(t: f64, o: &Occupancy) -> Sample {
        serde_json::to_value(o).map_or_else(|_| Sample::default(), |v| Sample::from_memory(t, &v))
    }
}

/// The format name a recording's JSON carries.
pub const FORMAT: &str = "kvlens-timeline/1";

/// The most frames a recording keeps (the newest).
pub const MAX_FRAMES: usize = 4096;

/// What happened between two frames.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mark {
    /// How many frames were recorded before it: the state it follows is `frames[frame - 1]`
    /// (a lesson step's end), the first that shows its effect `frames[frame]`.
    pub frame: usize,
    /// What, in a few words.
    pub what: String,
}

/// A memory timeline as recorded: the occupancy after every engine step, reset and resize.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Recording {
    /// [`FORMAT`].
    pub format: String,
    /// What was recorded (a lesson's title, "chat").
    pub title: String,
    /// The occupancies, oldest first.
    pub frames: VecDeque<Occupancy>,
    /// What happened between them.
    pub marks: Vec<Mark>,
}

impl Recording {
    /// An empty recording.
    pub fn new(title: impl Into<String>) -> Self {
        Recording {
            format: FORMAT.into(),
            title: title.into(),
            frames: VecDeque::new(),
            marks: Vec::new(),
        }
    }

    /// Notes what happens before the next frame.
    pub fn mark(&mut self, what: impl Into<String>) {
        self.marks.push(Mark {
            frame: self.frames.len(),
            what: what.into(),
        });
    }

    /// Adds a frame, marking the preemptions and evictions since the one before.
    pub fn push(&mut self, o: Occupancy) {
        if let Some(last) = self.frames.back() {
            let preempted = o
                .engine
                .counters
                .num_preemptions
                .saturating_sub(last.engine.counters.num_preemptions);
            let evicted = o.engine.kv.num_evictions.saturating_sub(last.engine.kv.num_evictions);
            if preempted > 0 {
                self.mark(format!("{preempted} preempted"));
            }
            if evicted > 0 {
                self.mark(format!("{evicted} KV blocks evicted"));
            }
        }
        if self.frames.len() == MAX_FRAMES {
            // The oldest frame goes, and the marks before it.
            self.frames.pop_front();
            self.marks.retain(|m| m.frame > 0);
            self.marks.iter_mut().for_each(|m| m.frame -= 1);
        }
        self.frames.push_back(o);
    }

    /// The recording as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A recording from its JSON; refuses other files with a sentence.
    pub fn from_json(text: &str) -> Result<Recording, String> {
        let r: Recording = serde_json::from_str(text).map_err(|e| format!("not a kvlens timeline ({FORMAT}): {e}"))?;
        if r.format != FORMAT {
            return Err(format!(
                "a timeline in format {:?}; this build reads {FORMAT}",
                r.format
            ));
        }
        if let Some(m) = r.marks.iter().find(|m| m.frame > r.frames.len()) {
            return Err(format!("a mark at frame {} of {}", m.frame, r.frames.len()));
        }
        Ok(r)
    }

    /// The frames as samples, `t` in seconds since the first.
    pub fn samples(&self) -> Vec<Sample> {
        let t0 = self.frames.front().map_or(0.0, |o| o.time);
        self.frames.iter().map(|o| Sample::of(o.time - t0, o)).collect()
    }

    /// The timeline drawn as `kvlens bench serve --plot` draws one: bytes by category stacked
    /// (weights named in the caption), requests running and waiting on the right axis, a dashed
    /// line at every mark; frames along the x axis.
    pub fn svg(&self) -> String {
        svg::draw(&self.title, &self.samples(), &self.marks)
    }
}

mod svg {
    use super::{Mark, Sample};
    use std::fmt::Write as _;

    const W: f64 = 1200.0;
    const H: f64 = 700.0;
    const LEFT: f64 = 90.0;
    const RIGHT: f64 = 1060.0;
    /// The caches' band (and the requests, on the right axis).
    const CACHES: (f64, f64) = (60.0, 430.0);
    /// The transient memory's band below it, on a scale of its own: on a GPU its pool dwarfs a
    /// small KV cache.
    const TRANSIENT: (f64, f64) = (460.0, 590.0);

    /// A plotted quantity: its name, its colour and its value in a sample.
    type Series = (&'static str, &'static str, fn(&Sample) -> u64);

    /// The caches, stacked bottom first, with the bench plot's colours.
    const CACHE_LAYERS: [Series; 4] = [
        ("KV in use", "#1f77b4", |s| s.kv_in_use_bytes),
        ("KV cached-free", "#9ecae1", |s| s.kv_cached_free_bytes),
        ("encoder cache", "#ff7f0e", |s| s.encoder_cache_bytes),
        ("processor cache (host)", "#9467bd", |s| s.processor_cache_bytes),
    ];

    /// The transient memory.
    const TRANSIENT_LAYERS: [Series; 1] = [("activations", "#d62728", |s| s.activations_bytes)];

    /// The request counts, on the right axis of the caches' band.
    const QUEUES: [Series; 2] = [
        ("requests running", "black", |s| s.num_running),
        ("requests waiting", "#2ca02c", |s| s.num_waiting),
    ];

    /// Bytes in MiB, or in KiB below one MiB (a small KV cache's ticks).
    fn mib(b: f64) -> String {
        if b < (1u64 << 20) as f64 {
            format!("{:.0} KiB", b / 1024.0)
        } else {
            format!("{:.1} MiB", b / (1u64 << 20) as f64)
        }
    }

    fn escape(s: &str) -> String {
        s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
    }

    /// Draws `layers` stacked in the band `(top, bottom)` on a bytes scale of their own, with the
    /// band's frame and its left ticks.
    fn band(
        out: &mut String,
        samples: &[Sample],
        layers: &[Series],
        (top, bottom): (f64, f64),
        x: &dyn Fn(usize) -> f64,
    ) {
        let most = samples
            .iter()
            .map(|s| layers.iter().map(|l| l.2(s)).sum::<u64>())
            .max()
            .unwrap_or(0)
            .max(1) as f64
            * 1.1;
        let y = |b: u64| bottom - (bottom - top) * b as f64 / most;
        let mut below = vec![0u64; samples.len()];
        for (name, colour, value) in layers {
            let above: Vec<u64> = samples.iter().zip(&below).map(|(s, b)| b + value(s)).collect();
            let mut points = String::new();
            for (i, a) in above.iter().enumerate() {
                let _ = write!(points, "{:.1},{:.1} ", x(i), y(*a));
            }
            for (i, b) in below.iter().enumerate().rev() {
                let _ = write!(points, "{:.1},{:.1} ", x(i), y(*b));
            }
            let _ = write!(
                out,
                r#"<polygon points="{}" fill="{colour}" fill-opacity="0.85"><title>{name}</title></polygon>"#,
                points.trim_end()
            );
            below = above;
        }
        let _ = write!(
            out,
            r#"<rect x="{LEFT}" y="{top}" width="{}" height="{}" fill="none" stroke="black"/>"#,
            RIGHT - LEFT,
            bottom - top
        );
        let ticks = if bottom - top > 200.0 { 4 } else { 2 };
        for k in 0..=ticks {
            let f = k as f64 / ticks as f64;
            let _ = write!(
                out,
                r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                bottom - (bottom - top) * f + 4.0,
                mib(most * f)
            );
        }
    }

    pub(super) fn draw(title: &str, samples: &[Sample], marks: &[Mark]) -> String {
        let n = samples.len().max(2) - 1;
        let x = |i: usize| LEFT + (RIGHT - LEFT) * i as f64 / n as f64;
        let weights = samples.last().map_or(0, |s| s.weights_bytes);
        let mut out = String::new();
        let _ = write!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="DejaVu Sans Mono, monospace" font-size="13">"#
        );
        let _ = write!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = write!(
            out,
            r#"<text x="{LEFT}" y="24" font-size="17">{}</text><text x="{LEFT}" y="46">memory by category (weights {} not drawn); transient memory below, on its own scale</text>"#,
            escape(title),
            mib(weights as f64)
        );
        band(&mut out, samples, &CACHE_LAYERS, CACHES, &x);
        band(&mut out, samples, &TRANSIENT_LAYERS, TRANSIENT, &x);
        let (top, bottom) = CACHES;
        let most_requests = samples
            .iter()
            .map(|s| s.num_running.max(s.num_waiting))
            .max()
            .unwrap_or(0)
            .max(1) as f64
            * 1.25;
        let yr = |r: u64| bottom - (bottom - top) * r as f64 / most_requests;
        for (name, colour, value) in QUEUES {
            let points: Vec<String> = samples
                .iter()
                .enumerate()
                .map(|(i, s)| format!("{:.1},{:.1}", x(i), yr(value(s))))
                .collect();
            let _ = write!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"><title>{name}</title></polyline>"#,
                points.join(" ")
            );
        }
        for k in 0..=4 {
            let f = k as f64 / 4.0;
            let _ = write!(
                out,
                r#"<text x="{}" y="{:.1}">{:.0}</text>"#,
                RIGHT + 6.0,
                bottom - (bottom - top) * f + 4.0,
                most_requests * f
            );
        }
        let _ = write!(
            out,
            r#"<text transform="translate({},{:.1}) rotate(90)" text-anchor="middle">requests</text>"#,
            RIGHT + 40.0,
            (top + bottom) / 2.0
        );
        for m in marks {
            let at = LEFT + (RIGHT - LEFT) * (m.frame as f64 - 0.5).clamp(0.0, n as f64) / n as f64;
            let _ = write!(
                out,
                r##"<line x1="{at:.1}" y1="{top}" x2="{at:.1}" y2="{}" stroke="#555" stroke-dasharray="4 3"/><text transform="translate({:.1},{}) rotate(-90)" font-size="11" fill="#333">{}</text>"##,
                TRANSIENT.1,
                at + 12.0,
                bottom - 6.0,
                escape(&m.what)
            );
        }
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">frames: the engine after each step, reset or resize ({} in all)</text>"#,
            (LEFT + RIGHT) / 2.0,
            TRANSIENT.1 + 22.0,
            samples.len()
        );
        let legend = CACHE_LAYERS
            .iter()
            .chain(&TRANSIENT_LAYERS)
            .chain(&QUEUES)
            .map(|l| (l.0, l.1));
        for (i, (name, colour)) in legend.enumerate() {
            let lx = LEFT + (i % 4) as f64 * 250.0;
            let ly = TRANSIENT.1 + 48.0 + (i / 4) as f64 * 22.0;
            let _ = write!(
                out,
                r#"<rect x="{lx}" y="{}" width="14" height="14" fill="{colour}"/><text x="{}" y="{}">{name}</text>"#,
                ly - 11.0,
                lx + 20.0,
                ly
            );
        }
        out.push_str("</svg>");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_kvlens_memory() {
        let v = json!({
            "ledger": [
                {"category": "weights", "bytes": 1000, "peak_bytes": 1000},
                {"category": "kv_cache", "bytes": 4000, "peak_bytes": 4000},
                {"category": "encoder_cache", "bytes": 300, "peak_bytes": 900},
                {"category": "activations", "bytes": 50, "peak_bytes": 70},
                {"category": "staging", "bytes": 0, "peak_bytes": 0}
            ],
            "kv": {"num_blocks": 41, "block_size": 16, "num_free": 30, "num_cached_free": 10,
                   "num_in_use": 10, "usage": 0.25, "runs": [["null", 1], ["in_use", 10]]},
            "encoder_cache": {"used_tokens": 3, "bytes_per_token": 100, "entries": []},
            "processor_cache": {"bytes_used": 777, "capacity_bytes": 4096, "entries": []},
            "num_running": 2, "num_waiting": 5, "counters": {}
        });
        let s = Sample::from_memory(1.5, &v);
        assert_eq!(
            s,
            Sample {
                t: 1.5,
                weights_bytes: 1000,
                kv_in_use_bytes: 1000,
                kv_cached_free_bytes: 1000,
                encoder_cache_bytes: 300,
                processor_cache_bytes: 777,
                activations_bytes: 50,
                num_running: 2,
                num_waiting: 5,
            }
        );
    }

    #[test]
    fn tolerates_other_shapes() {
        let v = json!({"ledger": {"weights": 5, "kv_cache": {"bytes": 8}},
                       "encoder_cache": {"used_tokens": 4, "bytes_per_token": 2}});
        let s = Sample::from_memory(0.0, &v);
        assert_eq!((s.weights_bytes, s.encoder_cache_bytes, s.kv_in_use_bytes), (5, 8, 0));
        assert_eq!(Sample::from_memory(0.0, &json!({})), Sample::default());
    }

    fn frame(seq: u64, preemptions: u64, in_use: usize) -> Occupancy {
        let mut o: Occupancy = serde_json::from_value(json!({
            "seq": seq, "time": seq as f64,
            "ledger": [{"category": "kv_cache", "bytes": 1024, "peak_bytes": 1024}],
            "kv": {"num_blocks": 9, "block_size": 16, "num_free": 8, "num_cached_free": 0, "num_in_use": 0,
                   "usage": 0.0, "num_evictions": 0, "runs": [], "tables": {}},
            "encoder_cache": {"capacity_tokens": 0, "used_tokens": 0, "referenced_tokens": 0, "freeable_tokens": 0,
                              "num_free_slots": 0, "num_freeable_slots": 0, "bytes_per_token": 0, "capacity_bytes": 0,
                              "used_bytes": 0, "pending_freed": [], "entries": [],
                              "stats": {"queries": 0, "hits": 0, "evictions": 0, "evicted_tokens": 0}},
            "num_running": 1, "num_waiting": 0, "counters": crate::engine::EngineCounters::default(),
            "prefix_cache": {"reset": false, "requests": 0, "queries": 0, "hits": 0},
            "processor_cache": {"capacity_bytes": 0, "bytes_used": 0, "entries": [],
                                "stats": crate::cache::processor_cache::ProcessorCacheStats::default()},
            "process": {}
        }))
        .unwrap();
        o.engine.counters.num_preemptions = preemptions;
        o.engine.kv.num_in_use = in_use;
        o
    }

    #[test]
    fn a_recording_survives_its_json_and_marks_preemptions() {
        let mut r = Recording::new("preemption <lesson>");
        r.push(frame(1, 0, 2));
        r.mark("reset_mm_cache");
        r.push(frame(2, 1, 8));
        assert_eq!(
            r.marks.iter().map(|m| (m.frame, m.what.as_str())).collect::<Vec<_>>(),
            [(1, "reset_mm_cache"), (1, "1 preempted")]
        );
        let back = Recording::from_json(&r.to_json()).unwrap();
        assert_eq!(back.marks, r.marks);
        assert_eq!(
            serde_json::to_value(back.frames.back()).unwrap(),
            serde_json::to_value(r.frames.back()).unwrap()
        );
        assert_eq!(back.samples()[1].kv_in_use_bytes, 1024);
        let svg = back.svg();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"), "{svg}");
        assert!(svg.contains("preemption &lt;lesson&gt;") && svg.contains("1 preempted"));
        assert!(
            Recording::from_json("{\"format\": \"other\", \"title\": \"\", \"frames\": [], \"marks\": []}").is_err()
        );
        assert!(Recording::from_json("[1, 2]").unwrap_err().contains(FORMAT));
    }

    #[test]
    fn the_oldest_frame_goes_with_the_marks_before_it() {
        let mut r = Recording::new("long");
        r.mark("before everything");
        r.push(frame(0, 0, 0));
        r.mark("after the first frame");
        for k in 1..=MAX_FRAMES as u64 {
            r.push(frame(k, 0, 0));
        }
        assert_eq!(r.frames.len(), MAX_FRAMES);
        assert_eq!(r.frames.front().unwrap().seq, 1);
        assert_eq!(
            r.marks,
            [Mark {
                frame: 0,
                what: "after the first frame".into()
            }]
        );
    }
}
