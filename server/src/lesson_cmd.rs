//! `kvlens lesson [NAME]`: the playground's lessons in memory profiling from the command line, the
//! same steps and the same computed figures (kvlens_engine::lessons).

use anyhow::Result;
use kvlens_engine::lessons::{lesson, LESSONS};

use crate::usage;

/// Flags of `kvlens lesson`.
#[derive(Debug, clap::Args)]
pub struct LessonArgs {
    /// The lesson to run (none: list them).
    pub name: Option<String>,
    /// Print the steps and figures as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs `kvlens lesson`.
pub fn run(a: &LessonArgs) -> Result<()> {
    let Some(name) = &a.name else {
        for l in LESSONS {
            println!("{:<20} {}", l.name, l.title);
        }
        return Ok(());
    };
    let l = lesson(name).map_err(|e| usage(e.to_string()))?;
    let steps = l.run().map_err(|e| usage(e.to_string()))?;
    if a.json {
        let out = serde_json::json!({"name": l.name, "title": l.title, "incident": l.incident, "steps": steps});
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{}\n{}\n", l.title, l.incident);
    for (i, s) in steps.iter().enumerate() {
        println!("Step {}. {}", i + 1, s.say);
        println!("  inputs: kvlens plan, or the playground's /planner?{}", s.query);
        let width = s.figures.iter().map(|f| f.name.chars().count()).max().unwrap_or(0);
        for f in &s.figures {
            println!("  {:<width$}  {:>16}  {}", f.name, f.value, f.source);
        }
        println!();
    }
    Ok(())
}
