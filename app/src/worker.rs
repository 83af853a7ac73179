//! The engine's side of the playground, in a dedicated Web Worker: the same wasm module as the
//! page, started by [`crate::engine_worker::EngineWorker`], which finds no window and runs
//! [`run`] instead of the page. It opens the backend (the worker's WebGPU adapter, else the CPU
//! backend), loads checkpoints, turns chat turns into requests (images decoded and preprocessed
//! here), steps the engine and posts tokens, detokenized once each, and the occupancy after every
//! step ([`crate::protocol`]).

use crate::checkpoint::{Source, Weights};
use crate::local_engine::{verdict, weight_format, Device, Local, Progress, Settings};
use crate::memory_view::size;
use crate::protocol::{decode, encode, FromWorker, ToWorker, Turn};
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::engine::TokenEvent;
use kvlens_engine::input::chat::{ChatMessage, Content, ContentPart, ImageUrl};
use kvlens_engine::input::processor::InlineImages;
use kvlens_engine::lessons::{lesson, Step};
use kvlens_engine::output::Output;
use kvlens_engine::sample::SamplingParams;
use std::cell::RefCell;
use std::rc::Rc;
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use web_sys::{DedicatedWorkerGlobalScope, File, MessageEvent};

/// The worker's device and loaded model.
#[derive(Default)]
struct State {
    device: Option<Rc<Device>>,
    local: Option<Rc<Local>>,
    loading: bool,
}

fn scope() -> DedicatedWorkerGlobalScope {
    js_sys::global().unchecked_into()
}

/// Posts a message to the page.
fn post(msg: &FromWorker) {
    if let Err(e) = scope().post_message(&JsValue::from_str(&encode(msg))) {
        web_sys::console::error_2(&JsValue::from_str("the worker cannot post to the page"), &e);
    }
}

/// Starts the worker: opens the device, then answers the page's messages.
pub fn run() {
    let state = Rc::new(RefCell::new(State::default()));
    let handler = {
        let state = Rc::clone(&state);
        Closure::<dyn Fn(MessageEvent)>::new(move |e: MessageEvent| {
            // A string, or [string, files] for a load from disk.
            let data = e.data();
            let (text, files) = match data.as_string() {
                Some(text) => (text, Vec::new()),
                None => {
                    let parts: js_sys::Array = data.unchecked_into();
                    let files = js_sys::Array::from(&parts.get(1))
                        .iter()
                        .filter_map(|f| f.dyn_into::<File>().ok())
                        .collect();
                    (parts.get(0).as_string().unwrap_or_default(), files)
                }
            };
            match decode::<ToWorker>(&text) {
                Ok(msg) => handle(&state, msg, files),
                Err(e) => post(&FromWorker::Failed(e)),
            }
        })
    };
    scope().set_onmessage(Some(handler.as_ref().unchecked_ref()));
    handler.forget();
    wasm_bindgen_futures::spawn_local(async move {
        let device = Device::open().await;
        if matches!(device, Device::Cpu(_)) {
            crate::row_helper::start_for_engine().await;
        }
        post(&FromWorker::Device {
            text: device.describe(),
            cpu: matches!(device, Device::Cpu(_)),
        });
        state.borrow_mut().device = Some(Rc::new(device));
    });
}

fn handle(state: &Rc<RefCell<State>>, msg: ToWorker, files: Vec<File>) {
    match msg {
        ToWorker::Load { url, mmproj, settings } => {
            let source = match url {
                Some(model) => Source::from_urls(model, mmproj),
                None => Source::Files(files),
            };
            load(Rc::clone(state), source, settings);
        }
        ToWorker::Chat { id, turns, params } => {
            let local = state.borrow().local.clone();
            match local {
                Some(local) => chat(&local, id, &turns, params),
                None => post(&FromWorker::Refused {
                    id,
                    error: "no model is loaded".into(),
                }),
            }
        }
        ToWorker::Abort { id } => {
            if let Some(local) = state.borrow().local.clone() {
                local.abort(&id.as_str().into());
            }
        }
        ToWorker::Reset(kind) => {
            if let Some(local) = state.borrow().local.clone() {
                post(&FromWorker::Reset(local.reset(kind)));
            }
        }
        ToWorker::Lesson { name } => {
            let local = state.borrow().local.clone();
            let lesson = lesson(&name).map_err(|e| e.to_string());
            match (local, lesson) {
                (Some(local), Ok(lesson)) => wasm_bindgen_futures::spawn_local(async move {
                    let post_step = |index, step: &Step| {
                        post(&FromWorker::LessonStep {
                            index,
                            step: step.clone(),
                        })
                    };
                    let post_setting = |said: &str| post(&FromWorker::LessonSetting(said.to_string()));
                    let ended = local.lesson(lesson, &post_setting, &post_step).await;
                    post(&FromWorker::LessonEnded(ended.err()));
                }),
                (None, _) => post(&FromWorker::LessonEnded(Some("no model is loaded".into()))),
                (_, Err(e)) => post(&FromWorker::LessonEnded(Some(e))),
            }
        }
    }
}

/// Loads a checkpoint in place of the one loaded before, posting its verdict, progress and end.
fn load(state: Rc<RefCell<State>>, source: Source, s: Settings) {
    let device = {
        let mut st = state.borrow_mut();
        if st.loading {
            return post(&FromWorker::Failed("a checkpoint is loading already".into()));
        }
        let Some(device) = st.device.clone() else {
            return post(&FromWorker::Failed(
                "still looking for a device; try again in a moment".into(),
            ));
        };
        if st.local.as_ref().is_some_and(|l| l.in_lesson()) {
            return post(&FromWorker::Failed(
                "a lesson is running on the loaded model; load another when it ends".into(),
            ));
        }
        st.loading = true;
        // The model before goes first: its memory is the new one's.
        st.local = None;
        device
    };
    wasm_bindgen_futures::spawn_local(async move {
        let result = async {
            post(&FromWorker::Status("reading the checkpoint's small files…".into()));
            let info = source.info().await?;
            let plan = verdict(&info, &device, s)?;
            let weights = match (&info.weights, weight_format(&info, s)) {
                (Weights::Gguf { .. }, _) => "as stored in the GGUF files".to_string(),
                (_, WeightFormat::Unquantized) => "f32".to_string(),
                (_, q) => format!("{q}, other tensors f32"),
            };
            post(&FromWorker::Verdict(format!(
                "fits on {}: weights {} ({weights}), KV cache {} = {} blocks × {} tokens, the longest context {} tokens",
                plan.device,
                size(plan.weights_bytes),
                size(plan.available_kv_bytes.max(0) as u64),
                plan.num_gpu_blocks,
                plan.block_size,
                plan.max_model_len
            )));
            post(&FromWorker::Status("loading the weights…".into()));
            let progress = |p: Progress| post(&FromWorker::Progress(p));
            Local::load(
                &source,
                &info,
                &device,
                s,
                &progress,
                Box::new(|o| post(&FromWorker::Occupancy(Box::new(o)))),
                Box::new(|e| post(&FromWorker::StepFailed(e))),
            )
            .await
        }
        .await;
        let mut st = state.borrow_mut();
        st.loading = false;
        match result {
            Ok(local) => {
                post(&FromWorker::Loaded {
                    device: format!("{}{}", local.device, crate::row_helper::holdings()),
                    budget: local.budget(),
                });
                st.local = Some(local);
            }
            Err(e) => post(&FromWorker::Failed(e)),
        }
    });
}

/// The engine-side conversation: every earlier turn, then the new user message.
fn chat_messages(turns: &[Turn]) -> Vec<ChatMessage> {
    turns
        .iter()
        .map(|t| {
            let mut parts: Vec<ContentPart> = t
                .images
                .iter()
                .map(|url| ContentPart::ImageUrl {
                    image_url: ImageUrl { url: url.clone() },
                })
                .collect();
            parts.push(ContentPart::Text { text: t.text.clone() });
            ChatMessage {
                role: t.role.clone(),
                content: Content::Parts(parts),
            }
        })
        .collect()
}

/// Queues a reply to `turns` and streams its tokens, each decoded once (as the server does:
/// re-decoding the whole reply per token is quadratic in its length).
fn chat(local: &Rc<Local>, id: String, turns: &[Turn], params: SamplingParams) {
    // Before any preprocessing: a lesson is measuring the caches it would fill.
    if local.in_lesson() {
        return post(&FromWorker::Refused {
            id,
            error: "a lesson is running; send it when the lesson ends".into(),
        });
    }
    let request = match local
        .input
        .request(&id, &chat_messages(turns), params, false, &mut InlineImages)
    {
        Ok(r) => r,
        Err(e) => {
            return post(&FromWorker::Refused {
                id,
                error: e.to_string(),
            })
        }
    };
    post(&FromWorker::Accepted {
        id: id.clone(),
        prompt_len: request.prompt.len(),
        mm_hashes: request.images.iter().map(|i| i.mm_hash.as_str().to_string()).collect(),
    });
    let decoder = Rc::clone(local);
    let mut output = Output::new(Vec::new(), false);
    let sink_id = id.clone();
    let sink = Box::new(move |e: &TokenEvent| {
        let text = match output.push(&decoder.input.tokenizer, e.clone()) {
            Ok(delta) => delta.text,
            Err(err) => format!(" (cannot decode: {err})"),
        };
        post(&FromWorker::Token {
            id: sink_id.clone(),
            token: e.token,
            text,
            finish: e.finish.map(|f| f.as_str().to_string()),
        });
    });
    if let Err(error) = local.submit(request, sink) {
        post(&FromWorker::Refused { id, error });
    }
}
