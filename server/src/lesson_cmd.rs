//! `kvlens lesson [NAME]`: the playground's lessons in memory profiling from the command line, the
//! same steps and the same computed figures (kvlens_engine::lessons). A live lesson loads the
//! checkpoint (the demo model unless `--model`) with `kvlens serve`'s start-up code and drives the
//! engine on it; `--record` writes its memory timeline.

use anyhow::{Context, Result};
use kvlens_engine::backend::block_on;
use kvlens_engine::lessons::{lesson, run_live, Bench, Step, Watch, LESSONS};
use kvlens_engine::timeline::Recording;
use std::path::PathBuf;

use crate::serve::occupancy_of;
use crate::startup::{start, EngineArgs};
use crate::usage;

/// The largest image a live lesson allows unless `--mm-processor-kwargs` says otherwise: 256
/// tokens of Qwen3-VL's 32-pixel cells, the playground's default, so the lesson runs in seconds.
const LESSON_MAX_PIXELS: &str = r#"{"max_pixels": 262144}"#;

/// The KV cache a live lesson allocates unless `--kv-cache-memory-bytes` says otherwise: some
/// thousands of the demo model's blocks, not 40% of the machine.
const LESSON_KV_BYTES: u64 = 64 << 20;

/// Flags of `kvlens lesson`.
#[derive(Debug, clap::Args)]
pub struct LessonArgs {
    /// The lesson to run (none: list them).
    pub name: Option<String>,
    /// Print the steps and figures as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Write a live lesson's memory timeline: FILE.json (load it back in the playground) or
    /// FILE.svg (a plot); may be given twice.
    #[arg(long)]
    pub record: Vec<PathBuf>,
    /// The engine a live lesson runs on, as `kvlens serve` takes it [default here:
    /// --kv-cache-memory-bytes 64 MiB, --mm-processor-kwargs '{"max_pixels": 262144}'].
    #[command(flatten)]
    pub engine: EngineArgs,
}

fn print_step(i: usize, s: &Step) {
    println!("Step {}. {}", i + 1, s.say);
    if let Some(q) = &s.query {
        println!("  inputs: kvlens plan, or the playground's /planner?{q}");
    }
    let width = s.figures.iter().map(|f| f.name.chars().count()).max().unwrap_or(0);
    for f in &s.figures {
        println!("  {:<width$}  {:>16}  {}", f.name, f.value, f.source);
    }
    println!();
}

/// Whether a `--record` file is a JSON timeline (else an SVG plot).
fn records_json(path: &std::path::Path) -> Result<bool> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("json") => Ok(true),
        Some("svg") => Ok(false),
        _ => Err(usage(format!("--record {}: name a .json or .svg file", path.display()))),
    }
}

/// Runs `kvlens lesson`: the full-size steps on the planner, then the live ones on the engine.
pub fn run(a: &LessonArgs) -> Result<()> {
    let Some(name) = &a.name else {
        for l in LESSONS {
            println!("{:<24} {}", l.name, l.title);
        }
        return Ok(());
    };
    let l = lesson(name).map_err(|e| usage(e.to_string()))?;
    let formats = a.record.iter().map(|p| records_json(p)).collect::<Result<Vec<_>>>()?;
    if !a.json {
        println!("{}\n{}\n", l.title, l.incident);
    }
    let mut steps = l.run_planned().map_err(|e| usage(e.to_string()))?;
    if !a.json {
        steps.iter().enumerate().for_each(|(i, s)| print_step(i, s));
    }
    if !l.has_live_steps() {
        if a.json {
            let out = serde_json::json!({"name": l.name, "title": l.title, "incident": l.incident, "steps": steps});
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        return Ok(());
    }
    let mut args = a.engine.clone();
    args.vllm
        .mm_processor_kwargs
        .get_or_insert_with(|| LESSON_MAX_PIXELS.into());
    args.kv_cache_memory_bytes.get_or_insert(LESSON_KV_BYTES);
    let mut started = start(&args)?;
    let mut recording = Recording::new(l.title);
    let offset = l.live_offset();
    let frontend = &started.frontend;
    let mut seq = 0;
    let mut watch = |w: Watch<'_>| match w {
        Watch::Stepped(engine) => {
            seq += 1;
            recording.push(occupancy_of(engine, frontend, seq));
        }
        Watch::Setting(said) => {
            if !a.json {
                println!("{said}\n");
            }
        }
        Watch::Done(i, step) => {
            recording.mark(format!("step {} done", offset + i + 1));
            if !a.json {
                print_step(offset + i, step);
            }
        }
    };
    let bench = Bench {
        engine: &mut started.engine,
        input: frontend,
        profile: &started.profile,
        profiled_images: started.plan.encoder_profile_items,
    };
    let ran = block_on(run_live(l, bench, &mut watch));
    // The timeline as far as it went, a failed lesson's too.
    for (path, json) in a.record.iter().zip(formats) {
        let text = if json { recording.to_json() } else { recording.svg() };
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    steps.extend(ran?);
    if a.json {
        let out = serde_json::json!({"name": l.name, "title": l.title, "incident": l.incident, "steps": steps});
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}
