//! Threads for the CPU backend in wasm: helper Web Workers that compute shares of the products'
//! rows ([`row_partners`]). Rust's wasm threads need a nightly toolchain, so each helper is the
//! page's module again with its own memory, holding a copy of its rows of every matrix, and it
//! talks to the engine's worker through one `SharedArrayBuffer` (a page that is cross-origin
//! isolated has them): the engine writes a command and its data, bumps a counter and wakes the
//! helper (`Atomics.notify`); the helper, blocked in `Atomics.wait`, runs it, writes the answer
//! and bumps the other counter. One round trip costs tens of microseconds; a decode step's products
//! take milliseconds.

use js_sys::{Atomics, Float32Array, Int32Array, SharedArrayBuffer, Uint32Array, Uint8Array};
use kvlens_engine::arch::ggml::GgmlType;
use kvlens_engine::backend::cpu::row_partners::{self, RowPartner};
use kvlens_engine::backend::cpu::PackedMatrix;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use web_sys::{DedicatedWorkerGlobalScope, MessageEvent, Worker};

/// The worker name that makes the module run [`run`].
pub const NAME: &str = "kvlens-row-helper";

/// Bytes of each helper's buffer: the control words, then the data.
const BUFFER_BYTES: u32 = 32 << 20;
/// Bytes of the control words at the buffer's start.
const CONTROL_BYTES: u32 = 64;
/// Words of the data area kept for a product's matrix ids.
const ID_WORDS: u32 = 1024;

/// Control words.
const REQUEST: u32 = 0;
const DONE: u32 = 1;
const COMMAND: u32 = 2;
const FAILED: u32 = 3;
/// The command's arguments, and the answer's.
const ARGS: u32 = 4;

/// Commands.
const ADOPT_PART: i32 = 1;
const ADOPT: i32 = 2;
const PRODUCT: i32 = 3;
const FORGET: i32 = 4;

/// How long the engine waits for a helper to start.
const START_TIMEOUT_MS: i32 = 60_000;
/// How long the engine waits for a helper's answer before giving up on it.
const ANSWER_TIMEOUT_MS: f64 = 120_000.0;

/// Views of a helper's buffer.
struct Buffer {
    control: Int32Array,
    sab: SharedArrayBuffer,
}

impl Buffer {
    fn new(sab: SharedArrayBuffer) -> Self {
        Buffer {
            control: Int32Array::new_with_byte_offset_and_length(&sab, 0, CONTROL_BYTES / 4),
            sab,
        }
    }

    fn get(&self, word: u32) -> i32 {
        Atomics::load(&self.control, word).unwrap_or(0)
    }

    fn set(&self, word: u32, value: i32) {
        let _ = Atomics::store(&self.control, word, value);
    }

    /// `len` bytes of the data area from byte `at`.
    fn bytes(&self, at: u32, len: u32) -> Uint8Array {
        Uint8Array::new_with_byte_offset_and_length(&self.sab, CONTROL_BYTES + at, len)
    }

    /// `len` words of the data area from word `at`.
    fn words(&self, at: u32, len: u32) -> Uint32Array {
        Uint32Array::new_with_byte_offset_and_length(&self.sab, CONTROL_BYTES + 4 * at, len)
    }

    /// `len` f32 of the data area from value `at` (after the ids).
    fn values(&self, at: u32, len: u32) -> Float32Array {
        Float32Array::new_with_byte_offset_and_length(&self.sab, CONTROL_BYTES + 4 * (ID_WORDS + at), len)
    }

    /// f32 values the data area holds after the ids.
    fn capacity() -> usize {
        ((BUFFER_BYTES - CONTROL_BYTES) / 4 - ID_WORDS) as usize
    }
}

/// The engine's side of one helper.
pub struct Helper {
    worker: Worker,
    buffer: Buffer,
    /// Commands sent.
    sent: Cell<i32>,
    /// Rows of each matrix the helper holds.
    rows: RefCell<HashMap<u32, usize>>,
    /// The product in flight: its matrices' rows and its activation rows.
    started: RefCell<Option<(Vec<usize>, usize)>>,
}

impl Helper {
    /// Sends command `command` with `args`.
    fn send(&self, command: i32, args: &[i32]) {
        for (i, &a) in args.iter().enumerate() {
            self.buffer.set(ARGS + i as u32, a);
        }
        self.buffer.set(COMMAND, command);
        self.sent.set(self.sent.get().wrapping_add(1));
        self.buffer.set(REQUEST, self.sent.get());
        let _ = Atomics::notify(&self.buffer.control, REQUEST);
    }

    /// Waits for the answer to the last command: Err with the helper's message if it failed.
    fn answer(&self) -> Result<(), String> {
        loop {
            let done = self.buffer.get(DONE);
            if done == self.sent.get() {
                break;
            }
            match Atomics::wait_with_timeout(&self.buffer.control, DONE, done, ANSWER_TIMEOUT_MS) {
                Ok(r) if r == "timed-out" => return Err("a row helper did not answer in two minutes".into()),
                Ok(_) => {}
                Err(e) => return Err(format!("cannot wait for a row helper: {e:?}")),
            }
        }
        if self.buffer.get(FAILED) == 0 {
            return Ok(());
        }
        let len = self.buffer.get(ARGS) as u32;
        Err(String::from_utf8_lossy(&self.buffer.bytes(0, len).to_vec()).into_owned())
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        self.worker.terminate();
    }
}

impl RowPartner for Helper {
    fn adopt(&self, ggml: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<u32, String> {
        if bytes.is_empty() {
            return Err("no rows to adopt".into());
        }
        let part = Buffer::capacity() * 4;
        let mut chunks = bytes.chunks(part).peekable();
        while let Some(chunk) = chunks.next() {
            self.buffer.bytes(0, chunk.len() as u32).copy_from(chunk);
            if chunks.peek().is_some() {
                self.send(ADOPT_PART, &[chunk.len() as i32]);
            } else {
                self.send(ADOPT, &[chunk.len() as i32, ggml.id() as i32, rows as i32, cols as i32]);
            }
            self.answer()?;
        }
        let id = self.buffer.get(ARGS) as u32;
        self.rows.borrow_mut().insert(id, rows);
        Ok(id)
    }

    fn start(&self, ids: &[u32], x: &[f32], m: usize) -> Result<(), String> {
        let rows = self.rows.borrow();
        let widths = ids
            .iter()
            .map(|id| {
                rows.get(id)
                    .copied()
                    .ok_or(format!("the row helper has no matrix {id}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if ids.len() > ID_WORDS as usize || x.len() + m * widths.iter().sum::<usize>() > Buffer::capacity() {
            return Err("a product larger than the row helper's buffer".into());
        }
        self.buffer.words(0, ids.len() as u32).copy_from(ids);
        self.buffer.values(0, x.len() as u32).copy_from(x);
        self.send(PRODUCT, &[m as i32, (x.len() / m.max(1)) as i32, ids.len() as i32]);
        *self.started.borrow_mut() = Some((widths, m));
        Ok(())
    }

    fn finish(&self) -> Result<Vec<Vec<f32>>, String> {
        let (widths, m) = self.started.borrow_mut().take().ok_or("no product started")?;
        self.answer()?;
        let mut at = self.buffer.get(ARGS) as u32;
        Ok(widths
            .iter()
            .map(|&w| {
                let len = (w * m) as u32;
                let out = self.buffer.values(at, len).to_vec();
                at += len;
                out
            })
            .collect())
    }

    fn forget(&self, id: u32) {
        if self.rows.borrow_mut().remove(&id).is_some() {
            self.send(FORGET, &[id as i32]);
            if let Err(e) = self.answer() {
                web_sys::console::error_1(&JsValue::from_str(&e));
            }
        }
    }

    fn capacity(&self) -> usize {
        Buffer::capacity()
    }
}

/// Whether this page may share memory with its workers (`crossOriginIsolated`).
pub fn isolated() -> bool {
    js_sys::Reflect::get(&js_sys::global(), &JsValue::from_str("crossOriginIsolated"))
        .map(|v| v.is_truthy())
        .unwrap_or(false)
}

thread_local! {
    /// The CPU backend's threads, in words.
    static THREADS: RefCell<String> = RefCell::new("1 thread".into());
}

/// The CPU backend's threads, in words ("2 threads", or 1 and why).
pub fn threads() -> String {
    THREADS.with_borrow(|t| t.clone())
}

/// What the helper workers hold, for the status line ("" without helpers).
pub fn holdings() -> String {
    match row_partners::shared_bytes() {
        0 => String::new(),
        b => format!(
            "; helper workers hold {:.1} MiB of weight rows",
            b as f64 / (1u64 << 20) as f64
        ),
    }
}

/// In the engine's worker: starts the helpers its page asked for (`globalThis.kvlensModule`, set
/// by [`crate::engine_worker::module_worker`]) where the page is cross-origin isolated.
pub async fn start_for_engine() {
    let module = js_sys::Reflect::get(&js_sys::global(), &JsValue::from_str("kvlensModule")).unwrap_or_default();
    let field = |k: &str| js_sys::Reflect::get(&module, &JsValue::from_str(k)).unwrap_or_default();
    let threads = field("threads").as_f64().unwrap_or(1.0) as usize;
    let (glue, wasm) = (field("glue").as_string(), field("wasm").as_string());
    let note = match (glue, wasm) {
        _ if threads <= 1 => "1 thread".to_string(),
        _ if !isolated() => {
            "1 thread (the page is not cross-origin isolated: no memory to share with helper workers)".into()
        }
        (Some(glue), Some(wasm)) => match start(threads - 1, &glue, &wasm).await {
            Ok(()) => format!("{threads} threads"),
            Err(e) => format!("1 thread (the helper workers did not start: {e})"),
        },
        _ => "1 thread (the worker was not told the module's address)".into(),
    };
    THREADS.set(note);
}

/// A promise rejected after `ms` milliseconds.
fn timeout(ms: i32) -> js_sys::Promise {
    js_sys::Promise::new(&mut |_, reject| {
        let scope: web_sys::WorkerGlobalScope = js_sys::global().unchecked_into();
        let on_time = Closure::once_into_js(move || {
            let _ = reject.call1(
                &JsValue::NULL,
                &JsValue::from_str(&format!("no answer in {} s", ms / 1000)),
            );
        });
        let _ = scope.set_timeout_with_callback_and_timeout_and_arguments_0(on_time.unchecked_ref(), ms);
    })
}

/// Starts `count` helpers on the module at `glue`/`wasm` and installs them as this thread's row
/// partners once every one has answered; Err (and none installed) if one could not start.
async fn start(count: usize, glue: &str, wasm: &str) -> Result<(), String> {
    let mut helpers: Vec<Rc<dyn RowPartner>> = Vec::with_capacity(count);
    for _ in 0..count {
        let worker = crate::engine_worker::module_worker(glue, wasm, NAME, 1)?;
        let sab = SharedArrayBuffer::new(BUFFER_BYTES);
        let alive = js_sys::Promise::new(&mut |resolve, reject| {
            let on_message = Closure::once_into_js(move |_: MessageEvent| {
                let _ = resolve.call0(&JsValue::NULL);
            });
            let on_error = Closure::once_into_js(move |e: JsValue| {
                let _ = reject.call1(&JsValue::NULL, &e);
            });
            worker.set_onmessage(Some(on_message.unchecked_ref()));
            worker.set_onerror(Some(on_error.unchecked_ref()));
        });
        // The helper says it runs before it gets its buffer: a module worker drops the messages
        // that arrive before its module has set a handler.
        let started = match wasm_bindgen_futures::JsFuture::from(js_sys::Promise::race(&js_sys::Array::of2(
            &alive,
            &timeout(START_TIMEOUT_MS),
        )))
        .await
        {
            Ok(_) => worker
                .post_message(&sab)
                .map_err(|e| format!("cannot hand a row helper its buffer: {e:?}")),
            Err(e) => Err(format!("a row helper did not start: {e:?}")),
        };
        if let Err(e) = started {
            worker.terminate();
            return Err(e);
        }
        worker.set_onmessage(None);
        worker.set_onerror(None);
        helpers.push(Rc::new(Helper {
            worker,
            buffer: Buffer::new(sab),
            sent: Cell::new(0),
            rows: RefCell::default(),
            started: RefCell::default(),
        }));
    }
    row_partners::install(helpers);
    Ok(())
}

/// The helper's side: says it runs, takes its buffer from the answer, then answers commands until
/// the tab closes (its event loop stays blocked in `Atomics.wait`).
pub fn run() {
    let scope: DedicatedWorkerGlobalScope = js_sys::global().unchecked_into();
    let on_message = Closure::once_into_js(move |e: MessageEvent| serve(&Buffer::new(e.data().unchecked_into())));
    scope.set_onmessage(Some(on_message.unchecked_ref()));
    let _ = scope.post_message(&JsValue::from_str("running"));
}

/// Answers commands forever.
fn serve(buffer: &Buffer) {
    let mut mats: HashMap<u32, PackedMatrix> = HashMap::new();
    let (mut next, mut pending, mut seen) = (0u32, Vec::<u8>::new(), 0i32);
    loop {
        while buffer.get(REQUEST) == seen {
            let _ = Atomics::wait(&buffer.control, REQUEST, seen);
        }
        seen = buffer.get(REQUEST);
        let arg = |i: u32| buffer.get(ARGS + i);
        let answer: Result<i32, String> = match buffer.get(COMMAND) {
            ADOPT_PART | ADOPT => {
                pending.extend(buffer.bytes(0, arg(0) as u32).to_vec());
                if buffer.get(COMMAND) == ADOPT_PART {
                    Ok(0)
                } else {
                    let bytes = std::mem::take(&mut pending);
                    let (rows, cols) = (arg(2) as usize, arg(3) as usize);
                    GgmlType::from_id(arg(1) as u32)
                        .and_then(|t| {
                            PackedMatrix::from_gguf(t, &bytes, rows, cols).ok_or(format!(
                                "{} bytes are not {rows} rows of {cols} {}",
                                bytes.len(),
                                t.name()
                            ))
                        })
                        .map(|w| {
                            next += 1;
                            mats.insert(next, w);
                            next as i32
                        })
                }
            }
            PRODUCT => product(buffer, &mats, arg(0) as usize, arg(1) as usize, arg(2) as u32),
            FORGET => {
                mats.remove(&(arg(0) as u32));
                Ok(0)
            }
            other => Err(format!("unknown command {other}")),
        };
        match answer {
            Ok(v) => {
                buffer.set(ARGS, v);
                buffer.set(FAILED, 0);
            }
            Err(e) => {
                let len = e.len().min(Buffer::capacity());
                buffer.bytes(0, len as u32).copy_from(&e.as_bytes()[..len]);
                buffer.set(ARGS, len as i32);
                buffer.set(FAILED, 1);
            }
        }
        buffer.set(DONE, seen);
        let _ = Atomics::notify(&buffer.control, DONE);
    }
}

/// Runs a product: `x [m, cols]` after the ids, the products written after it (their first value
/// returned).
fn product(buffer: &Buffer, mats: &HashMap<u32, PackedMatrix>, m: usize, cols: usize, n: u32) -> Result<i32, String> {
    let ids = buffer.words(0, n).to_vec();
    let ws = ids
        .iter()
        .map(|id| mats.get(id).ok_or(format!("no matrix {id}")))
        .collect::<Result<Vec<_>, _>>()?;
    let x = buffer.values(0, (m * cols) as u32).to_vec();
    let ys = PackedMatrix::matmul_many(&ws, &x, m).map_err(|e| e.to_string())?;
    let first = (m * cols) as u32;
    let mut at = first;
    for y in ys {
        buffer.values(at, y.len() as u32).copy_from(&y);
        at += y.len() as u32;
    }
    Ok(first as i32)
}
