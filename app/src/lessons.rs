//! `/lessons` and `/lessons/NAME`: the lessons in memory profiling (kvlens_engine::lessons;
//! `kvlens lesson NAME` prints the same). A full-size step's figures are computed by the planner
//! when the page opens, and each such step links to the planner with its inputs; a live lesson
//! opens the playground, which loads the demo model and runs the lesson's steps on it
//! ([`LessonPanel`]).

use crate::playground::Playground;
use kvlens_engine::lessons::{lesson, Lesson, Step, LESSONS};
use leptos::prelude::*;

/// The lesson named by the path after `/lessons/`, or the list of lessons.
#[component]
pub fn LessonsPage(name: Option<String>) -> impl IntoView {
    let Some(name) = name else {
        return view! {
            <main class="lessons">
                <h1>"Lessons in memory profiling"</h1>
                <p class="muted">"Incidents that cost vLLM users days, replayed step by step; every number is computed as the page runs: by the planner at the incident's full size, and by the engine in this tab (the demo model) at a small one."</p>
                <ol data-testid="lesson-list">
                    {LESSONS.iter().map(|l| view! {
                        <li><a href=format!("/lessons/{}", l.name)>{l.title}</a>" — "{l.incident}
</li>
                    }).collect_view()}
                </ol>
            </main>
        }
        .into_any();
    };
    let body = match lesson(&name).and_then(|l| Ok((l, l.run_planned()?))) {
        Ok((l, steps)) => view! {
            {(l.live_offset() > 0).then(|| view! { <h1>{l.title}</h1><p>{l.incident}</p> })}
            {steps.into_iter().enumerate().map(|(i, s)| planned_step(i, s)).collect_view()}
            <Playground lesson=l.name />
        }
        .into_any(),
        Err(e) => view! { <p data-testid="lesson-error">{e.to_string()}</p> }.into_any(),
    };
    view! {
        <main class="lessons">
            <p><a href="/lessons">"all lessons"</a></p>
            {body}
        </main>
    }
    .into_any()
}

/// A full-size step: its sentence, a link to the planner with its inputs, its figures.
fn planned_step(i: usize, s: Step) -> impl IntoView {
    view! {
        <section class="lesson-step" data-testid="lesson-step">
            <h2>{format!("Step {}", i + 1)}</h2>
            <p>{s.say}</p>
            {s.query.map(|q| view! { <p class="muted"><a href=format!("/planner?{q}")>"these inputs in the planner"</a></p> })}
            <table>
                {s.figures.into_iter().map(|f| view! {
                    <tr data-testid="lesson-figure">
                        <td>{f.name}</td><td class="num">{f.value}</td><td class="muted">{f.source}</td>
                    </tr>
                }).collect_view()}
            </table>
        </section>
    }
}

/// Where the playground's lesson is.
#[derive(Clone, Debug, PartialEq)]
pub enum LessonState {
    /// Waiting for the model (the lesson starts once it is loaded).
    Waiting,
    /// Running its steps.
    Running,
    /// Every step ran.
    Done,
    /// It stopped, and why.
    Failed(String),
}

/// The memory view's areas a step's figures are about, to highlight: `kv`, `encoder`,
/// `processor`, `ledger`, `counters`.
pub fn areas(step: &Step) -> Vec<&'static str> {
    ["kv", "encoder", "processor", "ledger", "counters"]
        .into_iter()
        .filter(|a| step.figures.iter().any(|f| f.area == *a))
        .collect()
}

/// A live lesson beside the memory view: its sentences, and each step's figures as the engine in
/// this tab computes them.
#[component]
pub fn LessonPanel(
    lesson: &'static Lesson,
    steps: RwSignal<Vec<Step>>,
    state: RwSignal<LessonState>,
    /// What the lesson runs on, in one sentence.
    setting: Signal<String>,
    /// Shows the memory as it was when step N (from 0) ended.
    on_show: Callback<usize>,
) -> impl IntoView {
    let total = lesson.live_sentences().count();
    let offset = lesson.live_offset();
    let status = move || match state.get() {
        LessonState::Waiting => "waiting for the demo model to load…".to_string(),
        LessonState::Running => format!(
            "running step {} of {}…",
            offset + steps.with(Vec::len) + 1,
            offset + total
        ),
        LessonState::Done => format!("done: {total} steps, every figure read from the engine in this tab"),
        LessonState::Failed(e) => format!("stopped: {e}"),
    };
    let rows = move || {
        let done = steps.get();
        lesson
            .live_sentences()
            .enumerate()
            .map(|(i, say)| {
                let figures = done.get(i).map(|s| {
                    s.figures
                        .iter()
                        .map(|f| {
                            view! {
                                <tr data-testid="lesson-figure" data-name=f.name.clone()
                                    data-raw=f.raw.map(|r| r.to_string()).unwrap_or_default()>
                                    <td>{f.name.clone()}</td><td class="num">{f.value.clone()}</td><td class="muted">{f.source.clone()}</td>
                                </tr>
                            }
                        })
                        .collect_view()
                });
                view! {
                    <section class="lesson-step" class:pending=done.len() <= i data-testid="lesson-step" data-index=i.to_string()>
                        <h3>{format!("Step {}", offset + i + 1)}</h3>
                        <p>{say}</p>
                        <table>{figures}</table>
                        {(done.len() > i).then(|| view! {
                            <button data-testid="lesson-show" on:click=move |_| on_show.run(i)>"show the memory as this step left it"</button>
                        })}
                    </section>
                }
            })
            .collect_view()
    };
    view! {
        <section class="lesson-panel" data-testid="lesson-panel" data-lesson=lesson.name>
            {if offset == 0 {
                view! { <h2>{lesson.title}</h2><p>{lesson.incident}</p> }.into_any()
            } else {
                view! { <h2>"At tab scale, on the model in this tab"</h2> }.into_any()
            }}
            <p class="muted">"The lesson drives the engine in this tab with small budgets; each figure says where it comes from. The memory view below draws the engine live; the highlighted parts are the ones the step is about. When the lesson ends, the engine goes back to its own size with every cache empty: a step's button brings back the memory as that step left it. Chat and resets wait for the lesson's end."</p>
            <p data-testid="lesson-setting">{move || setting.get()}</p>
            <p data-testid="lesson-status" data-state=move || format!("{:?}", state.get()).split('(').next().unwrap_or_default().to_lowercase()>{status}</p>
            {rows}
        </section>
    }
}
