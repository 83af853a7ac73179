//! The memory timeline recorder under the memory view: every occupancy the engine reports (and a
//! mark for each lesson step and reset) goes into a [`Recording`], which exports as JSON or as an
//! SVG plot (kvlens_engine::timeline, the same code `kvlens lesson --record` writes with), and a
//! recorded JSON loads back and replays frame by frame in the memory view.

use kvlens_engine::occupancy::Occupancy;
use kvlens_engine::timeline::Recording;
use leptos::prelude::*;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;

/// Time between replayed frames.
const REPLAY_FRAME_MS: i32 = 25;

/// Offers `text` as a download named `name`.
fn download(name: &str, mime: &str, text: &str) -> Result<(), String> {
    let parts = js_sys::Array::of1(&text.into());
    let props = web_sys::BlobPropertyBag::new();
    props.set_type(mime);
    let blob = web_sys::Blob::new_with_str_sequence_and_options(&parts, &props).map_err(|e| format!("{e:?}"))?;
    let url = web_sys::Url::create_object_url_with_blob(&blob).map_err(|e| format!("{e:?}"))?;
    let document = window().document().ok_or("no document")?;
    let a: web_sys::HtmlAnchorElement = document
        .create_element("a")
        .map_err(|e| format!("{e:?}"))?
        .unchecked_into();
    a.set_href(&url);
    a.set_download(name);
    let body = document.body().ok_or("no body")?;
    body.append_child(&a).map_err(|e| format!("{e:?}"))?;
    a.click();
    a.remove();
    // Some browsers read the URL after the click returns: let it go a little later.
    wasm_bindgen_futures::spawn_local(async move {
        sleep(10_000).await;
        let _ = web_sys::Url::revoke_object_url(&url);
    });
    Ok(())
}

/// Resolves after `ms` milliseconds.
async fn sleep(ms: i32) {
    let promise = js_sys::Promise::new(&mut |resolve, _| {
        let _ = window().set_timeout_with_callback_and_timeout_and_arguments_0(&resolve, ms);
    });
    let _ = JsFuture::from(promise).await;
}

/// A file name for a recording's title.
fn file_stem(title: &str) -> String {
    let stem: String = title
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let stem = stem.split('-').filter(|s| !s.is_empty()).collect::<Vec<_>>().join("-");
    format!("kvlens-timeline-{}", if stem.is_empty() { "chat" } else { &stem })
}

/// Export and replay of the page's recording; `frames` counts what it holds (the page bumps it),
/// `replaying` is true while a loaded timeline plays into `occupancy`.
#[component]
pub fn Recorder(
    recording: StoredValue<Recording, LocalStorage>,
    frames: RwSignal<usize>,
    occupancy: RwSignal<Option<Occupancy>>,
    replaying: RwSignal<bool>,
) -> impl IntoView {
    let said = RwSignal::new(String::new());
    let export = move |svg: bool| {
        let (name, mime, text) = recording.with_value(|r| {
            let stem = file_stem(&r.title);
            if svg {
                (format!("{stem}.svg"), "image/svg+xml", r.svg())
            } else {
                (format!("{stem}.json"), "application/json", r.to_json())
            }
        });
        if let Err(e) = download(&name, mime, &text) {
            said.set(format!("cannot export: {e}"));
        }
    };
    let replay = move |ev: leptos::ev::Event| {
        let input: web_sys::HtmlInputElement = event_target(&ev);
        let Some(file) = input.files().and_then(|l| l.get(0)) else {
            return;
        };
        wasm_bindgen_futures::spawn_local(async move {
            let text = match JsFuture::from(file.text()).await {
                Ok(t) => t.as_string().unwrap_or_default(),
                Err(e) => return said.set(format!("cannot read {}: {e:?}", file.name())),
            };
            let loaded = match Recording::from_json(&text) {
                Ok(r) => r,
                Err(e) => return said.set(format!("{}: {e}", file.name())),
            };
            replaying.set(true);
            let n = loaded.frames.len();
            for (i, frame) in loaded.frames.iter().enumerate() {
                said.set(format!("replaying {}: frame {} of {n}", loaded.title, i + 1));
                occupancy.set(Some(frame.clone()));
                sleep(REPLAY_FRAME_MS).await;
            }
            said.set(format!(
                "replayed {}: {n} frames, {} marks; the memory view shows its final state",
                loaded.title,
                loaded.marks.len()
            ));
            replaying.set(false);
        });
    };
    view! {
        <section class="recorder">
            <h3>"Memory timeline"</h3>
            <p class="muted" data-testid="recorder-status">{move || {
                let n = frames.get();
                let (title, marks) = recording.with_value(|r| (r.title.clone(), r.marks.len()));
                format!("{title}: {n} frames recorded (one per engine step, reset or resize), {marks} marks")
            }}</p>
            <button data-testid="export-json" on:click=move |_| export(false)>"export JSON"</button>
            <button data-testid="export-svg" on:click=move |_| export(true)>"export SVG"</button>
            <label>" replay a recorded timeline "
                <input type="file" accept=".json,application/json" data-testid="replay-file" on:change=replay />
            </label>
            <p data-testid="replay-status">{move || said.get()}</p>
        </section>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_from_titles() {
        assert_eq!(
            file_stem("Memory that /reset_mm_cache does not return"),
            "kvlens-timeline-memory-that-reset-mm-cache-does-not-return"
        );
        assert_eq!(file_stem(""), "kvlens-timeline-chat");
    }
}
