//! The playground page: the in-browser engine, its chat and its live memory view.

use leptos::prelude::*;

/// The playground page.
#[component]
pub fn Playground() -> impl IntoView {
    view! { <main><h1>"kvlens playground"</h1></main> }
}
