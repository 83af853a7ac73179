//! `/lessons` and `/lessons/NAME`: the lessons in memory profiling, each step's sentence beside its
//! figures, computed here by the engine crate's code when the page opens (kvlens_engine::lessons;
//! `kvlens lesson NAME` prints the same). Each step links to the planner with its inputs.

use kvlens_engine::lessons::{lesson, LESSONS};
use leptos::prelude::*;

/// The lesson named by the path after `/lessons/`, or the list of lessons.
#[component]
pub fn LessonsPage(name: Option<String>) -> impl IntoView {
    let Some(name) = name else {
        return view! {
            <main class="lessons">
                <h1>"Lessons in memory profiling"</h1>
                <p class="muted">"Incidents that cost vLLM users days, replayed step by step; every number is computed as the page opens."</p>
                <ul data-testid="lesson-list">
                    {LESSONS.iter().map(|l| view! {
                        <li><a href=format!("/lessons/{}", l.name)>{l.title}</a>" — "{l.incident}</li>
                    }).collect_view()}
                </ul>
            </main>
        }
        .into_any();
    };
    let body = match lesson(&name).and_then(|l| Ok((l, l.run()?))) {
        Ok((l, steps)) => view! {
            <h1>{l.title}</h1>
            <p>{l.incident}</p>
            {steps.into_iter().enumerate().map(|(i, s)| view! {
                <section class="lesson-step" data-testid="lesson-step">
                    <h2>{format!("Step {}", i + 1)}</h2>
                    <p>{s.say}</p>
                    <p class="muted"><a href=format!("/planner?{}", s.query)>"these inputs in the planner"</a></p>
                    <table>
                        {s.figures.into_iter().map(|f| view! {
                            <tr data-testid="lesson-figure">
                                <td>{f.name}</td><td class="num">{f.value}</td><td class="muted">{f.source}</td>
                            </tr>
                        }).collect_view()}
                    </table>
                </section>
            }).collect_view()}
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
