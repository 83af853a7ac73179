//! The kvlens playground: a Qwen-VL model running in the browser while its KV blocks, encoder
//! cache and memory ledger fill and empty (`/`), and the start-up memory planner (`/planner`).
//! Both pages run the engine crate's own code in wasm. The same module started in a Web Worker
//! (no window there) runs the in-browser engine instead of the page ([`worker`]).

mod chat;
mod checkpoint;
mod engine_worker;
mod local_engine;
mod memory_view;
mod planner;
mod playground;
mod protocol;
mod server_mode;
mod worker;

use leptos::prelude::*;

fn main() {
    console_error_panic_hook::set_once();
    if web_sys::window().is_none() {
        worker::run();
        return;
    }
    leptos::mount::mount_to_body(App);
}

/// The page for the location's path: the planner at `/planner`, the playground anywhere else.
#[component]
fn App() -> impl IntoView {
    let path = window().location().pathname().unwrap_or_default();
    let on_planner = path.trim_end_matches('/').ends_with("/planner");
    view! {
        <nav class="top">
            <a href="/" class:current=!on_planner>"playground"</a>
            <a href="/planner" class:current=on_planner>"planner"</a>
        </nav>
        {if on_planner { view! { <planner::PlannerPage /> }.into_any() } else { view! { <playground::Playground /> }.into_any() }}
    }
}
