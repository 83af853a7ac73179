//! The chat with the in-browser engine: messages with text and images (file input, drag-and-drop,
//! paste), streamed tokens, sampling settings, stop, a new conversation, and per-message prefill
//! and decode speeds.

use crate::engine_worker::EngineWorker;
use crate::protocol::{FromWorker, Turn};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use js_sys::Uint8Array;
use kvlens_engine::sample::SamplingParams;
use leptos::prelude::*;
use std::collections::HashMap;
use std::rc::Rc;
use wasm_bindgen_futures::JsFuture;
use web_sys::{File, FileList};

/// One message of the conversation.
#[derive(Debug, Clone, PartialEq)]
struct Message {
    /// `user` or `assistant`.
    role: &'static str,
    text: String,
    /// Images as data URLs.
    images: Vec<String>,
    /// The generated ids (assistant messages).
    token_ids: Vec<u32>,
    /// Prefill and decode speeds once known.
    stats: String,
    /// Still generating.
    live: bool,
}

/// Sampling settings the page exposes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sampling {
    temperature: f32,
    top_p: f32,
    max_tokens: usize,
}

/// The conversation as the engine's worker takes it.
fn turns(history: &[Message]) -> Vec<Turn> {
    history
        .iter()
        .map(|m| Turn {
            role: m.role.to_string(),
            text: m.text.clone(),
            images: m.images.clone(),
        })
        .collect()
}

/// A picked or dropped image file as a data URL.
async fn data_url(file: File) -> Result<String, String> {
    let buffer = JsFuture::from(file.array_buffer())
        .await
        .map_err(|e| format!("{}: {e:?}", file.name()))?;
    let bytes = Uint8Array::new(&buffer).to_vec();
    let mime = match file.type_() {
        t if t.is_empty() => "application/octet-stream".to_string(),
        t => t,
    };
    Ok(format!("data:{mime};base64,{}", STANDARD.encode(bytes)))
}

/// A rate with the digits that matter: two decimals below 1 (a 2B model on SwiftShader decodes a
/// token in 13 s), one below 10, none above.
fn rate(per_second: f64) -> String {
    match per_second {
        r if r < 1.0 => format!("{r:.2}"),
        r if r < 10.0 => format!("{r:.1}"),
        r => format!("{r:.0}"),
    }
}

/// Milliseconds since the epoch.
fn now_ms() -> f64 {
    js_sys::Date::now()
}

/// The chat panel for the engine in the worker (`ready` once a model is loaded).
#[component]
pub fn Chat(
    /// The engine's worker.
    engine: StoredValue<Option<Rc<EngineWorker>>, LocalStorage>,
    /// Whether a model is loaded.
    ready: Signal<bool>,
    /// Thumbnails by mm hash, filled as images are sent (for the memory view).
    thumbnails: RwSignal<HashMap<String, String>>,
) -> impl IntoView {
    let messages = RwSignal::new(Vec::<Message>::new());
    let pending = RwSignal::new(Vec::<String>::new());
    let text = RwSignal::new(String::from("Describe this image."));
    let error = RwSignal::new(None::<String>);
    let running = RwSignal::new(None::<String>);
    let sampling = RwSignal::new(Sampling {
        temperature: 0.0,
        top_p: 1.0,
        max_tokens: 16,
    });
    let next_id = StoredValue::new(0u64);
    // A new model starts a new conversation.
    Effect::new(move |_| {
        if !ready.get() {
            messages.set(Vec::new());
            error.set(None);
        }
    });

    let add_files = move |files: Option<FileList>| {
        let Some(files) = files else { return };
        let files: Vec<File> = (0..files.length()).filter_map(|i| files.get(i)).collect();
        wasm_bindgen_futures::spawn_local(async move {
            for f in files {
                match data_url(f).await {
                    Ok(url) => pending.update(|p| p.push(url)),
                    Err(e) => error.set(Some(e)),
                }
            }
        });
    };

    let send = move || {
        let Some(engine) = engine.get_value() else { return };
        if running.get_untracked().is_some() {
            return;
        }
        error.set(None);
        let user = Message {
            role: "user",
            text: text.get_untracked(),
            images: pending.get_untracked(),
            token_ids: Vec::new(),
            stats: String::new(),
            live: false,
        };
        let mut history = messages.get_untracked();
        history.push(user);
        let s = sampling.get_untracked();
        let params = SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            max_tokens: s.max_tokens,
            ..SamplingParams::default()
        };
        let n = next_id.get_value();
        next_id.set_value(n + 1);
        let id = format!("chat-{n}");
        let conversation = turns(&history);
        // The prompt's images in order are the messages' images in order.
        let urls: Vec<String> = history.iter().flat_map(|m| m.images.iter().cloned()).collect();
        history.push(Message {
            role: "assistant",
            text: String::new(),
            images: Vec::new(),
            token_ids: Vec::new(),
            stats: "tokenizing…".into(),
            live: true,
        });
        messages.set(history);
        pending.set(Vec::new());
        text.set(String::new());
        let started = now_ms();
        let mut first = None::<f64>;
        let mut prompt_len = 0;
        let listener = Box::new(move |msg: &FromWorker| match msg {
            FromWorker::Accepted {
                prompt_len: n,
                mm_hashes,
                ..
            } => {
                prompt_len = *n;
                thumbnails.update(|t| {
                    for (hash, url) in mm_hashes.iter().zip(urls.iter()) {
                        t.entry(hash.clone()).or_insert(url.clone());
                    }
                });
                messages.update(|m| {
                    if let Some(last) = m.last_mut() {
                        last.stats = format!("{n} prompt tokens…");
                    }
                });
            }
            FromWorker::Refused { error: e, .. } => {
                // The refused turn leaves the conversation (else every later request would carry
                // it again); its text goes back into the box.
                running.set(None);
                let mut refused = None;
                messages.update(|m| {
                    m.pop();
                    refused = m.pop();
                });
                if let Some(user) = refused.filter(|_| text.get_untracked().is_empty()) {
                    text.set(user.text);
                }
                error.set(Some(e.clone()));
            }
            FromWorker::Token {
                token,
                text: delta,
                finish,
                ..
            } => {
                let now = now_ms();
                let first_at = *first.get_or_insert(now);
                messages.update(|m| {
                    let Some(last) = m.last_mut() else { return };
                    last.token_ids.push(*token);
                    last.text.push_str(delta);
                    let n = last.token_ids.len();
                    let prefill = rate(prompt_len as f64 / ((first_at - started).max(1.0) / 1e3));
                    last.stats = if n > 1 {
                        let decode = rate((n - 1) as f64 / ((now - first_at).max(1.0) / 1e3));
                        format!("prefill {prompt_len} tokens at {prefill} tok/s · decode {n} tokens at {decode} tok/s")
                    } else {
                        format!("prefill {prompt_len} tokens at {prefill} tok/s")
                    };
                    if let Some(f) = finish {
                        last.live = false;
                        last.stats.push_str(&format!(" · finished: {f}"));
                    }
                });
                if finish.is_some() {
                    running.set(None);
                }
            }
            _ => {}
        });
        running.set(Some(id.clone()));
        engine.chat(&id, conversation, params, listener);
    };

    let stop = move |_| {
        if let (Some(engine), Some(id)) = (engine.get_value(), running.get_untracked()) {
            engine.abort(&id);
            running.set(None);
            messages.update(|m| {
                if let Some(last) = m.last_mut() {
                    last.live = false;
                    last.stats.push_str(" · stopped");
                }
            });
        }
    };

    let list = move || {
        messages
            .get()
            .into_iter()
            .map(|m| {
                let images = m
                    .images
                    .iter()
                    .map(|src| view! { <img class="thumb" src=src.clone() alt="image" /> })
                    .collect_view();
                let ids = m.token_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                if m.role == "assistant" {
                    view! {
                        <div class="msg assistant" class:live=m.live data-testid="assistant-message" data-token-ids=ids data-done=(!m.live).to_string()>
                            <p>{m.text}</p>
                            <p class="stats">{m.stats}</p>
                        </div>
                    }
                    .into_any()
                } else {
                    view! { <div class="msg user">{images}<p>{m.text}</p></div> }.into_any()
                }
            })
            .collect_view()
    };

    view! {
        <section class="chat"
            on:dragover=|ev: web_sys::DragEvent| ev.prevent_default()
            on:drop=move |ev: web_sys::DragEvent| {
                ev.prevent_default();
                add_files(ev.data_transfer().and_then(|d| d.files()));
            }
            on:paste=move |ev: web_sys::ClipboardEvent| add_files(ev.clipboard_data().and_then(|d| d.files()))>
            <div class="messages">{list}</div>
            <div class="pending">
                {move || pending.get().into_iter().map(|src| view! { <img class="thumb" src=src alt="image to send" /> }).collect_view()}
            </div>
            <p class="error" data-testid="chat-error">{move || error.get()}</p>
            <div class="compose">
                <input type="file" accept="image/*" multiple data-testid="image-input"
                    on:change=move |ev| {
                        let input: web_sys::HtmlInputElement = event_target(&ev);
                        add_files(input.files());
                        input.set_value("");
                    } />
                <textarea rows="2" data-testid="chat-input" placeholder="Ask about the image (drop or paste one here)"
                    prop:value=move || text.get()
                    on:input=move |ev| text.set(event_target_value(&ev))></textarea>
                <button data-testid="send" disabled=move || !ready.get() || running.get().is_some()
                    on:click=move |_| send()>"send"</button>
                <button data-testid="stop" disabled=move || running.get().is_none() on:click=stop>"stop"</button>
                <button data-testid="new-conversation" disabled=move || running.get().is_some()
                    on:click=move |_| { messages.set(Vec::new()); pending.set(Vec::new()); }>"new conversation"</button>
            </div>
            <div class="sampling controls">
                <label>"temperature"
                    <input type="number" step="0.1" min="0" prop:value=move || sampling.get().temperature.to_string()
                        on:change=move |ev| sampling.update(|s| s.temperature = event_target_value(&ev).parse().unwrap_or(0.0)) />
                </label>
                <label>"top-p"
                    <input type="number" step="0.05" min="0.01" max="1" prop:value=move || sampling.get().top_p.to_string()
                        on:change=move |ev| sampling.update(|s| s.top_p = event_target_value(&ev).parse().unwrap_or(1.0)) />
                </label>
                <label>"max tokens"
                    <input type="number" min="1" data-testid="max-tokens" prop:value=move || sampling.get().max_tokens.to_string()
                        on:change=move |ev| sampling.update(|s| s.max_tokens = event_target_value(&ev).parse().unwrap_or(16)) />
                </label>
            </div>
        </section>
    }
}
