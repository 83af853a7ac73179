//! The kvlens playground: a Qwen-VL model running in the browser while its KV blocks, encoder
//! cache and memory ledger fill and empty (`/`), the start-up memory planner (`/planner`) and the
//! lessons (`/lessons`).
//! Both pages run the engine crate's own code in wasm. The same module started in a Web Worker
//! (no window there) runs the in-browser engine instead of the page ([`worker`]).

mod cache_copy;
mod chat;
mod checkpoint;
mod engine_worker;
mod lessons;
mod local_engine;
mod memory_view;
mod planner;
mod playground;
mod protocol;
mod recorder;
mod row_helper;
mod server_mode;
mod worker;

use leptos::prelude::*;

fn main() {
    console_error_panic_hook::set_once();
    if web_sys::window().is_none() {
        let scope: web_sys::DedicatedWorkerGlobalScope = wasm_bindgen::JsCast::unchecked_into(js_sys::global());
        if scope.name() == row_helper::NAME {
            row_helper::run();
        } else {
            worker::run();
        }
        return;
    }
    leptos::mount::mount_to_body(App);
}

/// The page for the location's path: the planner at `/planner`, the lessons under `/lessons`, the
/// playground anywhere else.
#[component]
fn App() -> impl IntoView {
    let path = window().location().pathname().unwrap_or_default();
    let path = path.trim_end_matches('/');
    let on_planner = path.ends_with("/planner");
    let lesson = path
        .split_once("/lessons")
        .map(|(_, rest)| rest.trim_start_matches('/').to_string());
    let on_lessons = lesson.is_some();
    view! {
        <nav class="top">
            <a href="/" class:current=!on_planner && !on_lessons>"playground"</a>
            <a href="/planner" class:current=on_planner>"planner"</a>
            <a href="/lessons" class:current=on_lessons>"lessons"</a>
        </nav>
        {match lesson {
            Some(name) => view! { <lessons::LessonsPage name=(!name.is_empty()).then_some(name) /> }.into_any(),
            None if on_planner => view! { <planner::PlannerPage /> }.into_any(),
            None => view! { <playground::Playground /> }.into_any(),
        }}
    }
}
