//! The page's handle on the engine's Web Worker ([`crate::worker`]): it starts the worker on the
//! page's own wasm module (the glue and wasm trunk preloads), posts the user's actions and hands
//! each answer to the request it is about, or else to the page.

use crate::checkpoint::Source;
use crate::local_engine::Settings;
use crate::protocol::{decode, encode, FromWorker, ToWorker, Turn};
use kvlens_engine::sample::SamplingParams;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use web_sys::{Blob, BlobPropertyBag, MessageEvent, Url, Worker, WorkerOptions, WorkerType};

/// Called with each message about one request.
pub type RequestListener = Box<dyn FnMut(&FromWorker)>;

/// The worker and where its messages go.
pub struct EngineWorker {
    worker: Worker,
    requests: Rc<RefCell<HashMap<String, RequestListener>>>,
    _on_message: Closure<dyn Fn(MessageEvent)>,
}

impl std::fmt::Debug for EngineWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineWorker").finish_non_exhaustive()
    }
}

/// The `href` of the first `selector` in the page.
fn link(selector: &str) -> Result<String, String> {
    let document = web_sys::window().and_then(|w| w.document()).ok_or("no document")?;
    let element = document
        .query_selector(selector)
        .ok()
        .flatten()
        .ok_or_else(|| format!("the page has no {selector}: it was not built by trunk"))?;
    element
        .get_attribute("href")
        .map(|href| {
            let origin = web_sys::window()
                .and_then(|w| w.location().origin().ok())
                .unwrap_or_default();
            if href.starts_with('/') {
                format!("{origin}{href}")
            } else {
                href
            }
        })
        .ok_or_else(|| format!("{selector} has no href"))
}

/// Threads for the CPU backend in wasm: the page's `?threads=N`, else the cores the browser
/// reports (at most 4).
fn threads() -> usize {
    let window = web_sys::window();
    let asked = window
        .as_ref()
        .and_then(|w| w.location().search().ok())
        .and_then(|q| web_sys::UrlSearchParams::new_with_str(&q).ok())
        .and_then(|q| q.get("threads"))
        .and_then(|t| t.parse::<usize>().ok());
    let cores = window.map_or(1.0, |w| w.navigator().hardware_concurrency()) as usize;
    asked.unwrap_or(cores.min(4)).max(1)
}

/// A module Web Worker named `name` running the page's module (its `glue` and `wasm`), which
/// finds the module's address and the thread count in `globalThis.kvlensModule`.
pub fn module_worker(glue: &str, wasm: &str, name: &str, threads: usize) -> Result<Worker, String> {
    let script = format!(
        "globalThis.kvlensModule = {{ glue: {glue:?}, wasm: {wasm:?}, threads: {threads} }};\n\
         import init from {glue:?};\nawait init({{ module_or_path: {wasm:?} }});\n"
    );
    let parts = js_sys::Array::of1(&JsValue::from_str(&script));
    let props = BlobPropertyBag::new();
    props.set_type("text/javascript");
    let blob = Blob::new_with_str_sequence_and_options(&parts, &props).map_err(|e| format!("{e:?}"))?;
    let url = Url::create_object_url_with_blob(&blob).map_err(|e| format!("{e:?}"))?;
    let options = WorkerOptions::new();
    options.set_type(WorkerType::Module);
    options.set_name(name);
    Worker::new_with_options(&url, &options).map_err(|e| format!("{e:?}"))
}

impl EngineWorker {
    /// Starts the worker; `on_event` gets every message not about a request.
    pub fn spawn(on_event: impl Fn(FromWorker) + 'static) -> Result<Rc<Self>, String> {
        // The page's own module: trunk preloads its glue and its wasm.
        let glue = link("link[rel=modulepreload]")?;
        let wasm = link("link[rel=preload][as=fetch]")?;
        let worker = module_worker(&glue, &wasm, "kvlens-engine", threads())?;
        let requests: Rc<RefCell<HashMap<String, RequestListener>>> = Rc::default();
        let routed = Rc::clone(&requests);
        let on_message = Closure::<dyn Fn(MessageEvent)>::new(move |e: MessageEvent| {
            let text = e.data().as_string().unwrap_or_default();
            let msg = match decode::<FromWorker>(&text) {
                Ok(msg) => msg,
                Err(e) => return on_event(FromWorker::Failed(e)),
            };
            let Some(id) = msg.request() else {
                return on_event(msg);
            };
            let ends = matches!(
                &msg,
                FromWorker::Refused { .. } | FromWorker::Token { finish: Some(_), .. }
            );
            // Taken out while it runs, so that it may post to the worker.
            let listener = routed.borrow_mut().remove(id);
            if let Some(mut listener) = listener {
                listener(&msg);
                if !ends {
                    routed.borrow_mut().insert(id.to_string(), listener);
                }
            }
        });
        worker.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        Ok(Rc::new(EngineWorker {
            worker,
            requests,
            _on_message: on_message,
        }))
    }

    fn post(&self, msg: &ToWorker) {
        if let Err(e) = self.worker.post_message(&JsValue::from_str(&encode(msg))) {
            web_sys::console::error_2(&JsValue::from_str("cannot post to the engine worker"), &e);
        }
    }

    /// Loads a checkpoint (the worker drops the one before).
    pub fn load(&self, source: &Source, settings: Settings) {
        match source {
            Source::Url(url) => self.post(&ToWorker::Load {
                url: Some(url.clone()),
                mmproj: None,
                settings,
            }),
            Source::GgufUrls { model, mmproj } => self.post(&ToWorker::Load {
                url: Some(model.clone()),
                mmproj: mmproj.clone(),
                settings,
            }),
            Source::Files(files) => {
                let text = encode(&ToWorker::Load {
                    url: None,
                    mmproj: None,
                    settings,
                });
                let files: js_sys::Array = files.iter().collect();
                let msg = js_sys::Array::of2(&JsValue::from_str(&text), &files);
                if let Err(e) = self.worker.post_message(&msg) {
                    web_sys::console::error_2(&JsValue::from_str("cannot post the files to the engine worker"), &e);
                }
            }
        }
    }

    /// Asks for a reply to `turns`; `listener` gets the request's messages until its last.
    pub fn chat(&self, id: &str, turns: Vec<Turn>, params: SamplingParams, listener: RequestListener) {
        self.requests.borrow_mut().insert(id.to_string(), listener);
        self.post(&ToWorker::Chat {
            id: id.to_string(),
            turns,
            params,
        });
    }

    /// Stops a request; its listener hears nothing more.
    pub fn abort(&self, id: &str) {
        self.requests.borrow_mut().remove(id);
        self.post(&ToWorker::Abort { id: id.to_string() });
    }

    /// Runs a lesson's live steps (the answers come as [`FromWorker::LessonStep`]s and one
    /// [`FromWorker::LessonEnded`]).
    pub fn lesson(&self, name: &str) {
        self.post(&ToWorker::Lesson { name: name.to_string() });
    }

    /// Empties one cache (the answer comes as [`FromWorker::Reset`]).
    pub fn reset(&self, kind: crate::memory_view::ResetKind) {
        self.post(&ToWorker::Reset(kind));
    }
}
