//! The playground page: load a checkpoint into the in-browser engine (the bundled demo model, a
//! URL or files from disk), see the planner's verdict first, chat with images, and watch the
//! engine's memory live. Or watch a running server instead (server mode). The engine runs in a Web
//! Worker ([`crate::engine_worker`]); this page only draws what it reports.

use crate::chat::Chat;
use crate::checkpoint::Source;
use crate::engine_worker::EngineWorker;
use crate::lessons::{areas, LessonPanel, LessonState};
use crate::local_engine::{Progress, Settings};
use crate::memory_view::{size, Budget, MemoryView, ResetKind};
use crate::protocol::FromWorker;
use crate::recorder::Recorder;
use crate::server_mode::ServerMode;
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::lessons::{lesson as find_lesson, Step, LESSONS};
use kvlens_engine::occupancy::Occupancy;
use kvlens_engine::timeline::Recording;
use leptos::prelude::*;
use std::collections::HashMap;
use std::rc::Rc;

/// The bundled demo checkpoint, beside the page.
const DEMO_DIR: &str = "demo-model/";

/// The demo model's URL, relative to the site's root.
/// Whether a URL names a GGUF file (which comes with a projector URL).
fn demo_url() -> String {
    let origin = window().location().origin().unwrap_or_default();
    format!("{origin}/{DEMO_DIR}")
}

/// The playground page; with `lesson`, it loads the demo model and runs that lesson on it (the
/// lesson's page, `/lessons/NAME`).
#[component]
pub fn Playground(#[prop(optional)] lesson: Option<&'static str>) -> impl IntoView {
    let engine = StoredValue::new_local(None::<Rc<EngineWorker>>);
    let device_text = RwSignal::new(String::from(
        "starting the engine's worker, looking for a WebGPU adapter…",
    ));
    let has_device = RwSignal::new(false);
    let status = RwSignal::new(String::from("no model loaded"));
    let ready = RwSignal::new(false);
    let busy = RwSignal::new(false);
    let verdict_text = RwSignal::new(None::<String>);
    let progress = RwSignal::new(None::<Progress>);
    let occupancy = RwSignal::new(None::<Occupancy>);
    let budget = RwSignal::new(None::<Budget>);
    let reset_result = RwSignal::new(None::<String>);
    let thumbnails = RwSignal::new(HashMap::<String, String>::new());
    let settings = RwSignal::new(Settings::default());
    let url = RwSignal::new(String::new());
    let mmproj_url = RwSignal::new(String::new());
    let picked = StoredValue::new_local(Vec::<web_sys::File>::new());
    // Watching a server instead of the engine in this tab (which stays loaded meanwhile).
    let watching = RwSignal::new(false);
    // The lesson shown beside the memory view, its finished steps and where it is.
    let lesson_name = RwSignal::new(lesson);
    let lesson_steps = RwSignal::new(Vec::<Step>::new());
    let lesson_state = RwSignal::new(LessonState::Waiting);
    let lesson_setting = RwSignal::new(String::new());
    // A live step's number as the lesson shows it: after the lesson's full-size steps.
    let step_number = move |live_index: usize| {
        let offset = lesson_name
            .get_untracked()
            .and_then(|n| find_lesson(n).ok())
            .map_or(0, |l| l.live_offset());
        offset + live_index + 1
    };
    let picked_lesson = RwSignal::new(lesson.unwrap_or_else(|| LESSONS.first().map_or("", |l| l.name)));
    // The lesson step whose recorded memory the view shows (None: the engine live).
    let shown_step = RwSignal::new(None::<usize>);
    // Every occupancy reported, for export and replay; `frames` counts them for the page.
    let recording = StoredValue::new_local(Recording::new("chat"));
    let frames = RwSignal::new(0usize);
    let replaying = RwSignal::new(false);

    let on_event = move |msg: FromWorker| match msg {
        FromWorker::Device { text, cpu } => {
            device_text.set(text);
            has_device.set(true);
            if cpu {
                settings.update(Settings::for_cpu_fallback);
            }
        }
        FromWorker::Status(text) => status.set(text),
        FromWorker::Verdict(text) => verdict_text.set(Some(text)),
        FromWorker::Progress(p) => progress.set(Some(p)),
        FromWorker::Loaded { device, budget: b } => {
            budget.set(Some(b));
            status.set(format!("ready · {device}"));
            ready.set(true);
            busy.set(false);
        }
        FromWorker::Failed(e) => {
            if verdict_text.get_untracked().is_none() {
                verdict_text.set(Some(format!("refused: {e}")));
            }
            status.set(format!("not loaded: {e}"));
            busy.set(false);
        }
        FromWorker::Occupancy(o) => {
            recording.update_value(|r| r.push((*o).clone()));
            frames.set(recording.with_value(|r| r.frames.len()));
            if !replaying.get_untracked() {
                shown_step.set(None);
                occupancy.set(Some(*o));
            }
        }
        FromWorker::LessonSetting(said) => lesson_setting.set(said),
        FromWorker::LessonStep { index, step } => {
            let number = step_number(index);
            recording.update_value(|r| r.mark(format!("step {number} done")));
            lesson_steps.update(|s| s.push(step));
        }
        FromWorker::LessonEnded(error) => lesson_state.set(match error {
            None => LessonState::Done,
            Some(e) => LessonState::Failed(e),
        }),
        FromWorker::StepFailed(e) => status.set(format!("ready, after a failed step: {e}")),
        FromWorker::Reset(text) => reset_result.set(Some(text)),
        // Messages about a request go to its listener.
        FromWorker::Accepted { .. } | FromWorker::Refused { .. } | FromWorker::Token { .. } => {}
    };
    match EngineWorker::spawn(on_event) {
        Ok(w) => engine.set_value(Some(w)),
        Err(e) => device_text.set(format!("no engine: {e}")),
    }

    let load = move |source: Source| {
        let Some(worker) = engine.get_value() else { return };
        if !has_device.get_untracked() {
            status.set("still looking for a device; try again in a moment".into());
            return;
        }
        if busy.get_untracked() {
            return;
        }
        busy.set(true);
        ready.set(false);
        occupancy.set(None);
        verdict_text.set(None);
        worker.load(&source, settings.get_untracked());
    };

    let on_reset = Callback::new(move |kind: ResetKind| {
        if let Some(w) = engine.get_value() {
            // During a lesson the worker refuses the reset: nothing to mark.
            if lesson_state.get_untracked() != LessonState::Running {
                recording.update_value(|r| r.mark(format!("{kind:?} reset")));
            }
            w.reset(kind);
        }
    });

    // Runs `name`'s live steps on the loaded model, recording afresh.
    let run_lesson = move |name: &'static str| {
        let (Some(w), Ok(l)) = (engine.get_value(), find_lesson(name)) else {
            return;
        };
        lesson_name.set(Some(name));
        lesson_steps.set(Vec::new());
        lesson_state.set(LessonState::Running);
        recording.set_value(Recording::new(l.title));
        frames.set(0);
        w.lesson(name);
    };
    // A lesson's page loads the demo model once the worker has a device, then runs the lesson.
    if lesson.is_some() {
        Effect::new(move |_| {
            if has_device.get() && !ready.get_untracked() && !busy.get_untracked() {
                load(Source::Url(demo_url()));
            }
        });
        Effect::new(move |_| {
            if ready.get() && lesson_state.get_untracked() == LessonState::Waiting {
                if let Some(name) = lesson_name.get_untracked() {
                    run_lesson(name);
                }
            }
        });
    }
    let lesson_running = move || lesson_state.get() == LessonState::Running;
    let highlight = Signal::derive(move || match (shown_step.get(), lesson_state.get()) {
        (Some(i), _) => lesson_steps.with(|s| s.get(i).map(areas).unwrap_or_default()),
        (None, LessonState::Running) => lesson_steps.with(|s| s.last().map(areas).unwrap_or_default()),
        _ => Vec::new(),
    });
    let show_step = Callback::new(move |i: usize| {
        let done = format!("step {} done", step_number(i));
        let frame = recording.with_value(|r| {
            let m = r.marks.iter().find(|m| m.what == done)?;
            r.frames.get(m.frame.checked_sub(1)?).cloned()
        });
        if let Some(frame) = frame {
            occupancy.set(Some(frame));
            shown_step.set(Some(i));
        }
    });

    // A folder picker: `webkitdirectory` is not one of leptos' typed attributes.
    let folder = NodeRef::<leptos::html::Input>::new();
    Effect::new(move |_| {
        if let Some(input) = folder.get() {
            let _ = input.set_attribute("webkitdirectory", "");
        }
    });
    let pick = move |ev: leptos::ev::Event| {
        let input: web_sys::HtmlInputElement = event_target(&ev);
        let files = input
            .files()
            .map(|l| (0..l.length()).filter_map(|i| l.get(i)).collect())
            .unwrap_or_default();
        picked.set_value(files);
    };

    let progress_view = move || {
        progress.get().map(|p| {
            let of = p.total_bytes.map(|t| format!(" of {}", size(t))).unwrap_or_default();
            let value = p.total_bytes.map_or(0.0, |t| p.bytes as f64 / t.max(1) as f64);
            view! {
                <div data-testid="load-progress">
                    <progress max="1" value=value.to_string()></progress>
                    {format!(" {} tensors on the device · {} read{of}", p.tensors, size(p.bytes))}
                </div>
            }
        })
    };

    view! {
        <main class="playground">
            <h1>"kvlens playground"</h1>
            <p>"A Qwen-VL model running in this tab, on " <span data-testid="device">{move || device_text.get()}</span>
               ". Watch its KV blocks, encoder cache and memory ledger fill and empty as you chat."</p>
            <div class="tabs">
                <button data-testid="mode-local" class:current=move || !watching.get()
                    on:click=move |_| watching.set(false)>"the model in this tab"</button>
                <button data-testid="mode-server" class:current=move || watching.get()
                    on:click=move |_| watching.set(true)>"watch a server (kvlens serve or vLLM)"</button>
            </div>
            {move || watching.get().then(|| view! { <ServerMode /> })}
            <div class="local" style:display=move || if watching.get() { "none" } else { "block" }>
            <section class="load">
                <div class="controls">
                    <button data-testid="load-demo" disabled=move || busy.get()
                        on:click=move |_| load(Source::Url(demo_url()))>"load the demo model"</button>
                    <label>"or a checkpoint URL (a directory, e.g. …/resolve/main/, or a llama.cpp text model …/M-Q4_K_M.gguf)"
                        <input type="url" data-testid="checkpoint-url" prop:value=move || url.get()
                            on:input=move |ev| url.set(event_target_value(&ev)) />
                    </label>
                    <label style:display=move || if crate::checkpoint::is_gguf(&url.get()) { "inline" } else { "none" }>
                        "with its projector's URL (…/mmproj-M-F16.gguf; empty: the language model alone, no images)"
                        <input type="url" data-testid="checkpoint-mmproj-url" prop:value=move || mmproj_url.get()
                            on:input=move |ev| mmproj_url.set(event_target_value(&ev)) />
                    </label>
                    <button data-testid="load-url"
                        disabled=move || busy.get() || url.get().is_empty()
                        on:click=move |_| {
                            let mmproj = Some(mmproj_url.get_untracked()).filter(|m| !m.is_empty());
                            load(Source::from_urls(url.get_untracked(), mmproj))
                        }>"load URL"</button>
                    <label>"or a folder from disk"
                        <input type="file" node_ref=folder data-testid="checkpoint-folder" on:change=pick />
                    </label>
                    <label>"or its files (or a .gguf and its mmproj-….gguf)"
                        <input type="file" multiple data-testid="checkpoint-files" on:change=pick />
                    </label>
                    <button data-testid="load-files" disabled=move || busy.get()
                        on:click=move |_| load(Source::Files(picked.get_value()))>"load files"</button>
                    <label>"KV blocks (sets --kv-cache-memory)"
                        <input type="number" min="2" data-testid="kv-blocks" prop:value=move || settings.get().kv_blocks.to_string()
                            on:change=move |ev| settings.update(|s| s.kv_blocks = event_target_value(&ev).parse().unwrap_or(256)) />
                    </label>
                    <label>"context (sets --max-model-len; empty: the model's)"
                        <input type="number" min="16" data-testid="max-model-len"
                            prop:value=move || settings.get().max_model_len.map(|n| n.to_string()).unwrap_or_default()
                            on:change=move |ev| settings.update(|s| s.max_model_len = event_target_value(&ev).parse().ok()) />
                    </label>
                    <label>"tokens per step (sets --max-num-batched-tokens; start-up profiles a batch this large)"
                        <input type="number" min="16" data-testid="max-num-batched-tokens"
                            prop:value=move || settings.get().max_num_batched_tokens.to_string()
                            on:change=move |ev| settings.update(|s| s.max_num_batched_tokens = event_target_value(&ev).parse().unwrap_or(2048)) />
                    </label>
                    <label>"largest image, tokens (sets --mm-processor-kwargs max_pixels)"
                        <input type="number" min="4" data-testid="max-image-tokens" prop:value=move || settings.get().max_image_tokens.to_string()
                            on:change=move |ev| settings.update(|s| s.max_image_tokens = event_target_value(&ev).parse().unwrap_or(256)) />
                    </label>
                    <label>"weights (sets --quantization)"
                        <select data-testid="weights-format"
                            on:change=move |ev| settings.update(|s| s.quantization = event_target_value(&ev).parse().unwrap_or_default())>
                            {WeightFormat::ALL.into_iter().map(|f| {
                                let text = match f.block() {
                                    None => "f32".to_string(),
                                    Some((values, bytes)) => format!("{f} ({} bits per weight)", bytes as f64 * 8.0 / values as f64),
                                };
                                view! { <option value=f.name() prop:selected=move || settings.get().quantization == f>{text}</option> }
                            }).collect_view()}
                        </select>
                    </label>
                </div>
                <p class="verdict" data-testid="verdict">{move || verdict_text.get()}</p>
                {progress_view}
                <p data-testid="model-status">{move || status.get()}</p>
            </section>
            <div class="lesson-pick">
                <label>"lesson: "
                    <select data-testid="lesson-pick" on:change=move |ev| {
                        let v = event_target_value(&ev);
                        if let Some(l) = LESSONS.iter().find(|l| l.name == v) {
                            picked_lesson.set(l.name);
                        }
                    }>
                        {LESSONS.iter().map(|l| view! {
                            <option value=l.name prop:selected=move || picked_lesson.get() == l.name>{l.title}</option>
                        }).collect_view()}
                    </select>
                </label>
                <button data-testid="run-lesson" disabled=move || !ready.get() || lesson_running()
                    on:click=move |_| run_lesson(picked_lesson.get_untracked())>"run it on this model"</button>
                <a href="/lessons">" all lessons"</a>
            </div>
            {move || lesson_name.get().and_then(|n| find_lesson(n).ok()).map(|l| view! {
                <LessonPanel lesson=l steps=lesson_steps state=lesson_state setting=lesson_setting.into() on_show=show_step />
            })}
            {move || shown_step.get().map(|i| view! {
                <p class="muted" data-testid="shown-step">{format!(
                    "The memory view shows the engine as step {} left it (recorded); it goes live again with the engine's next step.",
                    step_number(i))}</p>
            })}
            <div class="columns">
                <Chat engine=engine ready=ready.into() thumbnails=thumbnails />
                <div>
                    <MemoryView occupancy=occupancy.into() budget=budget.into() on_reset=on_reset
                        reset_result=reset_result.into() thumbnails=thumbnails.into() highlight=highlight />
                    <Recorder recording=recording frames=frames occupancy=occupancy replaying=replaying />
                </div>
            </div>
            </div>
        </main>
    }
}
