//! A fetched file's copy into Cache Storage, written while the file is read. The copy's stream
//! holds one chunk at most: the reader waits for a slow cache write, and a refused one (over
//! quota, a private window) ends the copy, not the load. A `Response.clone()` tees the body
//! instead, and its copy's queue grows without bound while the cache lags: a 1.1 GB GGUF file
//! stayed whole in the tab's memory after Cache Storage refused it (docs/PERFORMANCE-HISTORY.md).

use js_sys::{Function, Object, Promise, Reflect, Uint8Array};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::JsFuture;
use web_sys::{Cache, ReadableStream, ReadableStreamDefaultController, Response, ResponseInit};

/// What the copy's stream callbacks and its writer share.
#[derive(Default)]
struct Shared {
    controller: RefCell<Option<ReadableStreamDefaultController>>,
    /// Resolves the writer's wait for room in the stream.
    wake: RefCell<Option<Function>>,
    /// The cache write has ended (kept, refused or cancelled): nothing more is copied.
    over: Cell<bool>,
}

impl Shared {
    fn wake(&self) {
        if let Some(resolve) = self.wake.borrow_mut().take() {
            let _ = resolve.call0(&JsValue::UNDEFINED);
        }
    }

    fn end(&self) {
        self.over.set(true);
        self.wake();
    }
}

/// The copy of one fetched file being written into Cache Storage.
pub struct CacheCopy {
    shared: Rc<Shared>,
}

impl CacheCopy {
    /// Starts keeping `url` in `cache`, with `response`'s headers (its length among them); None
    /// when the browser will not make the copy's stream.
    pub fn start(cache: &Cache, url: &str, response: &Response) -> Option<Self> {
        let shared = Rc::new(Shared::default());
        let start = {
            let s = Rc::clone(&shared);
            Closure::<dyn FnMut(ReadableStreamDefaultController)>::new(move |c| {
                *s.controller.borrow_mut() = Some(c);
            })
        };
        let pull = {
            let s = Rc::clone(&shared);
            Closure::<dyn FnMut()>::new(move || s.wake())
        };
        let cancel = {
            let s = Rc::clone(&shared);
            Closure::<dyn FnMut()>::new(move || s.end())
        };
        let source = Object::new();
        for (name, f) in [
            ("start", start.as_ref()),
            ("pull", pull.as_ref()),
            ("cancel", cancel.as_ref()),
        ] {
            Reflect::set(&source, &name.into(), f).ok()?;
        }
        let stream = ReadableStream::new_with_underlying_source(&source).ok()?;
        let init = ResponseInit::new();
        init.set_headers(&response.headers());
        let copy = Response::new_with_opt_readable_stream_and_init(Some(&stream), &init).ok()?;
        let put = cache.put_with_str(url, &copy);
        let s = Rc::clone(&shared);
        let url = url.to_string();
        wasm_bindgen_futures::spawn_local(async move {
            let kept = JsFuture::from(put).await;
            s.end();
            if let Err(e) = kept {
                let why = e
                    .dyn_ref::<js_sys::Error>()
                    .map(|e| String::from(e.message()))
                    .unwrap_or_default();
                web_sys::console::warn_1(&format!("{url} not kept in Cache Storage: {why}").into());
            }
            // The stream calls these until the write has ended.
            drop((start, pull, cancel));
        });
        Some(CacheCopy { shared })
    }

    /// Copies the file's next chunk, then waits until the cache has taken it (or the write ended).
    pub async fn write(&self, chunk: &Uint8Array) {
        let s = &self.shared;
        let Some(controller) = s.controller.borrow().clone() else {
            return;
        };
        if s.over.get() {
            return;
        }
        if controller.enqueue_with_chunk(chunk).is_err() {
            s.end();
            return;
        }
        while !s.over.get() && controller.desired_size().is_some_and(|room| room <= 0.0) {
            let room = Promise::new(&mut |resolve, _| *s.wake.borrow_mut() = Some(resolve));
            let _ = JsFuture::from(room).await;
        }
    }

    /// Ends the copy of a file read whole: Cache Storage keeps it.
    pub fn finish(self) {
        if let (Some(controller), false) = (self.shared.controller.borrow().as_ref(), self.shared.over.get()) {
            let _ = controller.close();
        }
        self.shared.over.set(true);
    }
}

impl Drop for CacheCopy {
    /// A copy dropped unfinished (the read failed, or the file was refused) errors its stream, so
    /// Cache Storage keeps nothing of it.
    fn drop(&mut self) {
        if let (Some(controller), false) = (self.shared.controller.borrow().as_ref(), self.shared.over.get()) {
            controller.error_with_e(&"the file was not read whole".into());
        }
    }
}
