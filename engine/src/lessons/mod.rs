//! Lessons in memory profiling: the incidents that cost vLLM users days, replayed step by step,
//! each step's figures computed when it runs, never recorded. A lesson is data (each step's
//! sentence and what it does) plus the engine calls that produce its figures, so `kvlens lesson`
//! and the playground show the same thing:
//!
//! - full-size steps ([`planned`]) run the planner at the incident's sizes; the sentences quote
//!   the seeds' numbers, and the tests check each quote against the computed figure;
//! - live steps ([`live`]) drive a loaded engine with scaled-down budgets (KV blocks, image
//!   sizes), so the effect happens in seconds on the demo model, and read their figures from the
//!   engine's own counters and ledger.

mod catalog;
mod live;
mod planned;

use serde::{Deserialize, Serialize};

use crate::memory::planner::PlanError;
pub use catalog::LESSONS;
pub use live::{run_live, Bench, Watch};

/// One lesson: its URL name, its title, the incident it replays and its steps.
#[derive(Debug)]
pub struct Lesson {
    /// The name in `/lessons/NAME` and `kvlens lesson NAME`.
    pub name: &'static str,
    /// Its title.
    pub title: &'static str,
    /// The incident, in one sentence.
    pub incident: &'static str,
    planned: &'static [planned::StepSpec],
    live: &'static [live::LiveSpec],
}

/// One figure of a step, with where it comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    /// What it is.
    pub name: String,
    /// Its value, formatted.
    pub value: String,
    /// Where the number comes from (the planner, the engine's counters, the ledger).
    pub source: String,
    /// The value as a plain number, where it is a count or bytes (for checks against counters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<u64>,
    /// The part of the memory view it is about (`kv`, `encoder`, `processor`, `ledger`,
    /// `counters`; empty for the planner's figures).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub area: String,
}

/// A step as run: its sentence, its inputs and its figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// What to look at and why.
    pub say: String,
    /// A full-size step's planner inputs, as `/planner?QUERY` takes them.
    pub query: Option<String>,
    /// The figures, computed now.
    pub figures: Vec<Figure>,
}

/// Why a lesson could not run.
#[derive(Debug, thiserror::Error)]
pub enum LessonError {
    /// No lesson by that name.
    #[error("no lesson {0:?}; the lessons are: {1}")]
    Unknown(String, String),
    /// A step's planner inputs were refused.
    #[error("{0}")]
    Plan(#[from] PlanError),
    /// A live step failed in the engine (it is left idle, at its own sizes).
    #[error("the engine: {0}")]
    Engine(String),
}

/// The lesson called `name`.
pub fn lesson(name: &str) -> Result<&'static Lesson, LessonError> {
    LESSONS.iter().find(|l| l.name == name).ok_or_else(|| {
        LessonError::Unknown(
            name.into(),
            LESSONS.iter().map(|l| l.name).collect::<Vec<_>>().join(", "),
        )
    })
}

impl Lesson {
    /// Runs the full-size steps (none for a lesson that is only live).
    pub fn run_planned(&self) -> Result<Vec<Step>, LessonError> {
        planned::run(self.planned)
    }

    /// How many full-size steps come before the live ones (the live steps are numbered after them).
    pub fn live_offset(&self) -> usize {
        self.planned.len()
    }

    /// Whether it has steps that run on a loaded engine.
    pub fn has_live_steps(&self) -> bool {
        !self.live.is_empty()
    }

    /// The live steps' sentences, before they run.
    pub fn live_sentences(&self) -> impl Iterator<Item = &'static str> {
        self.live.iter().map(|s| s.say)
    }
}
