//! Server mode: watch a running server in the playground's views instead of the in-browser engine.
//! A `kvlens serve` is read through `/v1/memory/stream` (every snapshot, in full, drawn by the
//! memory view, with its resets posted back); a vLLM or vllm-ascend server through its Prometheus
//! `/metrics`, read every second, with what vLLM does not expose said plainly; a `kvlens watch`
//! (a vLLM server's KV cache events) block by block, with the planner's figures beside the
//! server's.
//!
//! Another origin's server must allow this page's origin (CORS): `kvlens serve` and vLLM both do by
//! default (`--allowed-origins ["*"]`).

use crate::memory_view::size as bytes;
use crate::memory_view::{Budget, MemoryView, ResetKind};
use kvlens_engine::cache::KvWatchSnapshot;
use kvlens_engine::memory::vllm_metrics::VllmMetrics;
use kvlens_engine::memory::watch_check::{compare, PlannedKv};
use kvlens_engine::occupancy::Occupancy;
use leptos::prelude::*;
use serde_json::Value;
use std::rc::Rc;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_sys::{AbortSignal, EventSource, MessageEvent, RequestInit, Response};

/// How often a vLLM server's `/metrics` is read, in milliseconds.
const POLL_MS: i32 = 1000;

/// How long one request may take before it counts as unanswered, in milliseconds.
const REQUEST_TIMEOUT_MS: u32 = 5000;

/// What vLLM's metrics leave out of its memory.
const NOT_EXPOSED: [&str; 4] = [
    "per-block state: which KV blocks are free, cached or held, and by which request (only the usage fraction is exported; \
     its KV cache events, --kv-events-config, give the prefix cache block by block: watch them with kvlens watch)",
    "encoder-cache occupancy: the vision encoder's outputs held on the device (vllm:mm_cache_* counts lookups in the front end's processor cache, not this)",
    "processor-cache bytes: the host memory preprocessed images take (only lookups and hits are counted)",
    "the memory ledger by category (weights, activations, non-torch memory): printed once, in the start-up log, which kvlens plan --from-log reads",
];

/// Puts a good read of a server's metrics in words for the status line.
type Wording = Rc<dyn Fn(&VllmMetrics) -> String>;

/// Which kind of server is being watched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `kvlens serve`: the memory stream.
    Kvlens,
    /// vLLM's `/metrics`.
    Vllm,
    /// `kvlens watch`: a server's KV cache events, its metrics and the plan.
    Watch,
}

/// What answered at a URL.
#[derive(Debug)]
enum Found {
    /// `kvlens serve`, with its `/server_info`.
    Kvlens(Value),
    /// A server with vLLM's metrics, as first read.
    Vllm(Box<VllmMetrics>),
    /// `kvlens watch`, with its `/server_info`.
    Watch(Value),
}

/// An open server-sent event stream; dropping it closes the connection.
#[derive(Debug)]
struct Stream {
    source: EventSource,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
    _on_error: Closure<dyn FnMut(JsValue)>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.source.set_onmessage(None);
        self.source.set_onerror(None);
        self.source.close();
    }
}

impl Stream {
    /// Opens `url`; `on_data` gets each event's data, `on_error` whether the browser gave up
    /// (otherwise it reconnects by itself).
    fn open(url: &str, on_data: impl Fn(String) + 'static, on_error: impl Fn(bool) + 'static) -> Result<Self, String> {
        let source = EventSource::new(url).map_err(|e| js_text(&e))?;
        let on_message = Closure::<dyn FnMut(MessageEvent)>::new(move |e: MessageEvent| {
            on_data(e.data().as_string().unwrap_or_default());
        });
        let watched = source.clone();
        let on_error = Closure::<dyn FnMut(JsValue)>::new(move |_| {
            on_error(watched.ready_state() == EventSource::CLOSED);
        });
        source.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        source.set_onerror(Some(on_error.as_ref().unchecked_ref()));
        Ok(Stream {
            source,
            _on_message: on_message,
            _on_error: on_error,
        })
    }
}

/// A JavaScript error's message.
fn js_text(e: &JsValue) -> String {
    e.dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| e.as_string())
        .unwrap_or_else(|| format!("{e:?}"))
}

/// The server's base URL from what was typed: trimmed, `http://` added where no scheme is given,
/// without a trailing `/`, `/v1` or `/metrics` (an OpenAI base URL or the metrics URL work too).
fn base_url(typed: &str) -> Option<String> {
    let typed = typed.trim();
    if typed.is_empty() {
        return None;
    }
    let mut url = if typed.contains("://") {
        typed.to_string()
    } else {
        format!("http://{typed}")
    };
    loop {
        let trimmed = url
            .trim_end_matches('/')
            .trim_end_matches("/metrics")
            .trim_end_matches("/v1");
        if trimmed.len() == url.len() {
            return Some(url);
        }
        url.truncate(trimmed.len());
    }
}

/// `method url` with no body; the status and the body's text. A POST says it is JSON: `kvlens
/// serve` refuses a cross-origin POST that a browser may send without a CORS preflight.
async fn request(method: &str, url: &str) -> Result<(u16, String), String> {
    let window = web_sys::window().ok_or("no window")?;
    let init = RequestInit::new();
    init.set_method(method);
    if method == "POST" {
        let headers = web_sys::Headers::new().map_err(|e| js_text(&e))?;
        headers
            .set("Content-Type", "application/json")
            .map_err(|e| js_text(&e))?;
        init.set_headers(&headers);
    }
    init.set_signal(Some(&AbortSignal::timeout_with_u32(REQUEST_TIMEOUT_MS)));
    let response: Response = JsFuture::from(window.fetch_with_str_and_init(url, &init))
        .await
        .map_err(|e| {
            format!(
                "cannot be reached ({}): the server is down, does not allow this page's origin \
                 (CORS: vLLM's and kvlens's --allowed-origins), or is http:// while this page is https://",
                js_text(&e)
            )
        })?
        .unchecked_into();
    let text = response.text().map_err(|e| js_text(&e))?;
    let text = JsFuture::from(text).await.map_err(|e| js_text(&e))?;
    Ok((response.status(), text.as_string().unwrap_or_default()))
}

/// Tries `/server_info` (kvlens serve), then `/metrics` (vLLM's names); says why neither answered.
async fn detect(base: &str) -> Result<Found, String> {
    let info = match request("GET", &format!("{base}/server_info")).await {
        Ok((200, body)) => match serde_json::from_str::<Value>(&body) {
            Ok(v) if v["plan"].is_object() => return Ok(Found::Kvlens(v)),
            Ok(v) if v["watch"].is_object() => return Ok(Found::Watch(v)),
            _ => "/server_info is not kvlens's".to_string(),
        },
        Ok((401, _)) => "/server_info wants the API key (--api-key), which this page does not send".to_string(),
        Ok((status, _)) => format!("/server_info answered HTTP {status}"),
        Err(e) => e,
    };
    let metrics = match request("GET", &format!("{base}/metrics")).await {
        Ok((200, body)) => {
            let m = VllmMetrics::parse(&body);
            if m.is_vllm() {
                return Ok(Found::Vllm(Box::new(m)));
            }
            "/metrics has none of vLLM's metrics".to_string()
        }
        Ok((status, _)) => format!("/metrics answered HTTP {status}"),
        Err(e) => e,
    };
    Err(if info == metrics {
        info
    } else {
        format!("{info}; {metrics}")
    })
}

/// Waits `ms` milliseconds without blocking the page.
async fn sleep(ms: i32) {
    let promise = js_sys::Promise::new(&mut |resolve, _| {
        if let Some(w) = web_sys::window() {
            let _ = w.set_timeout_with_callback_and_timeout_and_arguments_0(&resolve, ms);
        }
    });
    let _ = JsFuture::from(promise).await;
}

/// The budget in `/server_info`'s `plan`.
fn budget_of(info: &Value) -> Option<Budget> {
    let plan = &info["plan"];
    Some(Budget {
        total_bytes: plan["total_bytes"].as_u64()?,
        requested_bytes: plan["requested_bytes"].as_u64()?,
        kv_cache_bytes: plan["available_kv_bytes"].as_i64()?.max(0) as u64,
    })
}

/// The endpoint a reset posts to.
fn reset_path(kind: ResetKind) -> &'static str {
    match kind {
        ResetKind::Prefix => "/reset_prefix_cache",
        ResetKind::Encoder => "/reset_encoder_cache",
        ResetKind::Processor => "/reset_mm_cache",
    }
}

/// A reset's answer in words.
fn reset_words(kind: ResetKind, status: u16, body: &str) -> String {
    let path = reset_path(kind);
    let v: Value = serde_json::from_str(body).unwrap_or_default();
    if status != 200 {
        let message = v["error"]["message"].as_str().unwrap_or(body.trim());
        return format!("{path} refused (HTTP {status}): {message}");
    }
    let n = |key: &str| v[key].as_u64().unwrap_or(0);
    match kind {
        ResetKind::Prefix => format!("{path}: the prefix cache is empty, its cached blocks are free blocks now"),
        ResetKind::Encoder => format!(
            "{path}: {} freed on the device, {} still held for running requests",
            bytes(n("freed_bytes")),
            bytes(n("encoder_cache_bytes"))
        ),
        ResetKind::Processor => format!(
            "{path} (what vLLM resets): {} preprocessed images dropped, {} of host memory; the encoder cache on the device is untouched",
            n("freed_entries"),
            bytes(n("freed_bytes"))
        ),
    }
}

/// A count, or that vLLM does not export it.
fn figure(x: Option<u64>) -> String {
    x.map_or_else(|| "not exported".to_string(), |v| v.to_string())
}

/// A hit rate with its counts.
fn hit_rate(rate: Option<f64>, hits: Option<u64>, queries: Option<u64>, unit: &str) -> String {
    match (rate, hits, queries) {
        (Some(r), Some(h), Some(q)) => format!("{:.1}% ({h} of {q} {unit})", 100.0 * r),
        (None, Some(_), Some(_)) => "no lookups yet".to_string(),
        _ => "not exported".to_string(),
    }
}

/// What vLLM's metrics say about its memory, and what they do not.
/// With `events`, the KV cache events already show the blocks, so that gap is not listed.
#[component]
fn VllmPanel(metrics: Signal<Option<VllmMetrics>>, #[prop(optional)] events: bool) -> impl IntoView {
    move || {
        metrics.get().map(|m| {
            let kv_text = match (m.blocks_in_use(), m.num_gpu_blocks) {
                (Some(used), Some(total)) => format!("{used}/{total} blocks"),
                _ => m.kv_cache_usage.map_or_else(
                    || "usage not exported".to_string(),
                    |u| {
                        format!(
                            "{:.1}% in use (no block count: vllm:cache_config_info is missing)",
                            100.0 * u
                        )
                    },
                ),
            };
            let width = m.kv_cache_usage.map_or(0.0, |u| (100.0 * u).clamp(0.0, 100.0));
            let detail = format!(
                "usage {} · {} tokens per block · {} tokens when full · {} {}",
                m.kv_cache_usage
                    .map_or_else(|| "not exported".to_string(), |u| format!("{:.1}%", 100.0 * u)),
                figure(m.block_size),
                figure(m.kv_cache_tokens()),
                m.engines,
                if m.engines == 1 {
                    "engine"
                } else {
                    "engines (data parallel), summed"
                }
            );
            let requests = format!(
                "requests running {} · waiting {}",
                figure(m.num_requests_running),
                figure(m.num_requests_waiting)
            );
            let prefix = format!(
                "prefix cache hit rate {}",
                hit_rate(
                    m.prefix_cache_hit_rate(),
                    m.prefix_cache_hits,
                    m.prefix_cache_queries,
                    "tokens"
                )
            );
            let mm = format!(
                "multimodal (processor) cache hit rate {}",
                hit_rate(m.mm_cache_hit_rate(), m.mm_cache_hits, m.mm_cache_queries, "items")
            );
            let preemptions = format!("preemptions {}", figure(m.num_preemptions));
            let weights = m.model_weights_bytes.map_or_else(
                || "weights not exported (vllm:model_weights_memory_bytes is newer)".to_string(),
                |b| format!("weights {}", bytes(b)),
            );
            view! {
                <h3>"KV cache " <span data-testid="kv-usage">{kv_text}</span></h3>
                <div class="bar" style="background: #d3f9d8" data-testid="kv-usage-bar">
                    <div style=format!("width: {width:.2}%; background: #2f9e44")></div>
                </div>
                <p class="muted">{detail}</p>
                <p data-testid="vllm-requests">{requests}</p>
                <p class="counters" data-testid="vllm-caches">{prefix}<br />{mm}<br />{preemptions}<br />{weights}</p>
                <h3>"What vLLM does not expose"</h3>
                <ul data-testid="vllm-not-exposed">
                    {NOT_EXPOSED.iter().skip(usize::from(events)).map(|t| view! { <li>{*t}</li> }).collect_view()}
                </ul>
            }
        })
    }
}

/// A watched server's prefix cache block by block, the stream's health, and the plan beside
/// what the server's metrics report.
#[component]
fn WatchPanel(
    snapshot: Signal<Option<KvWatchSnapshot>>,
    metrics: Signal<Option<VllmMetrics>>,
    planned: Signal<Option<PlannedKv>>,
) -> impl IntoView {
    let counts = move || {
        snapshot.get().map(|s| {
            format!(
                "{} resident blocks ({} with image keys) · stored {} · removed {} · cleared {} · {} batches (last #{}) · replayed {} · lost {} · restarts {}{}{}",
                s.num_resident,
                s.num_with_keys,
                s.stored,
                s.removed,
                s.cleared,
                s.batches,
                s.last_seq.map_or_else(|| "none".to_string(), |q| q.to_string()),
                s.replayed,
                s.lost,
                s.restarts,
                if s.unknown_removals > 0 {
                    format!(" · {} removals of blocks never seen stored", s.unknown_removals)
                } else {
                    String::new()
                },
                if s.other_medium > 0 {
                    format!(" · {} events of the CPU offloading tier (not drawn)", s.other_medium)
                } else {
                    String::new()
                }
            )
        })
    };
    let grid = move || {
        snapshot.get().map(|s| {
            let drawn: u64 = s.blocks.iter().map(|b| u64::from(b.copies)).sum();
            let more = s.num_resident.saturating_sub(drawn);
            view! {
                <div class="kv-grid" data-testid="watch-grid">
                    {s.blocks.iter().map(|b| {
                        let class = if b.keys.is_empty() { "cell cached" } else { "cell image" };
                        let title = format!(
                            "{} · {} cop{} · stored in batch {}{}",
                            b.hash,
                            b.copies,
                            if b.copies == 1 { "y" } else { "ies" },
                            b.since,
                            if b.keys.is_empty() { String::new() } else { format!(" · keys {}", b.keys.join(", ")) }
                        );
                        view! { <span class=class data-testid="watch-block" data-hash=b.hash.clone() title=title></span> }
                    }).collect_view()}
                </div>
                {(more > 0).then(|| view! { <p class="muted">{format!("and {more} more block copies not drawn (the first {} blocks are)", KvWatchSnapshot::MAX_BLOCKS)}</p> })}
            }
        })
    };
    let findings = move || {
        let plan = planned.get()?;
        let rows = metrics.get().map(|m| compare(&plan, &m)).unwrap_or_default();
        let title = format!(
            "The plan ({} on {}, TP {}, --gpu-memory-utilization {}): {} KV blocks per rank of {} tokens",
            plan.model,
            plan.device,
            plan.tensor_parallel_size,
            plan.gpu_memory_utilization,
            plan.num_gpu_blocks,
            plan.block_size
        );
        Some(view! {
            <h3>"Planner and server"</h3>
            <p class="muted" data-testid="watch-plan">{title}</p>
            <table data-testid="watch-findings">
                <tr><th>"figure"</th><th>"planned"</th><th>"server"</th><th>""</th></tr>
                {rows.into_iter().map(|f| view! {
                    <tr class:disagree=!f.agrees>
                        <td>{f.what}</td><td>{f.planned}</td><td>{f.reported}</td>
                        <td>{if f.agrees { "agree".to_string() } else { format!("differ: {}", f.note) }}</td>
                    </tr>
                }).collect_view()}
            </table>
        })
    };
    view! {
        <section class="memory">
            <h3>"KV cache, block by block (from the server's KV cache events)"</h3>
            <p data-testid="watch-counts">{counts}</p>
            <p class="muted">"A cell is a block in the server's prefix cache: stored by a BlockStored event, gone at its BlockRemoved. \
                Green: text; blue: the block holds image tokens (its extra keys name the image)."</p>
            {grid}
            {findings}
            <VllmPanel metrics=metrics events=true />
        </section>
    }
}

/// The server-mode panel: a URL, connect / disconnect, what was found there and its memory.
#[component]
pub fn ServerMode() -> impl IntoView {
    let url = RwSignal::new(String::new());
    let status = RwSignal::new(String::from("looking for a server where this page came from…"));
    let kind = RwSignal::new(None::<Kind>);
    let occupancy = RwSignal::new(None::<Occupancy>);
    let budget = RwSignal::new(None::<Budget>);
    let reset_result = RwSignal::new(None::<String>);
    let vllm = RwSignal::new(None::<VllmMetrics>);
    let watched = RwSignal::new(None::<KvWatchSnapshot>);
    let planned = RwSignal::new(None::<PlannedKv>);
    // The watched server's base URL; the generation ends the tasks of earlier connections.
    let base = StoredValue::new(String::new());
    let generation = StoredValue::new(0u64);
    let stream = StoredValue::new_local(None::<Stream>);
    let current = move |g: u64| generation.try_get_value() == Some(g);

    // Stops watching; returns the new generation.
    let stop = move || {
        let g = generation.get_value() + 1;
        generation.set_value(g);
        stream.set_value(None);
        kind.set(None);
        occupancy.set(None);
        budget.set(None);
        vllm.set(None);
        watched.set(None);
        planned.set(None);
        reset_result.set(None);
        g
    };
    on_cleanup(move || {
        generation.try_update_value(|g| *g += 1);
        stream.try_update_value(|s| *s = None);
    });

    // Watches the kvlens serve at `at` through its memory stream.
    let watch_kvlens = move |at: String, info: Value| -> Result<(), String> {
        let model = info["served_model_names"][0].as_str().unwrap_or("?").to_string();
        let connected = format!(
            "connected to kvlens serve ({at} · {model} · {} KV blocks)",
            figure(info["plan"]["num_gpu_blocks"].as_u64())
        );
        let said = connected.clone();
        let opened = Stream::open(
            &format!("{at}/v1/memory/stream"),
            move |data| match serde_json::from_str::<Occupancy>(&data) {
                Ok(o) => {
                    occupancy.set(Some(o));
                    status.set(said.clone());
                }
                Err(err) => status.set(format!(
                    "the memory stream sent an event that is not an occupancy: {err}"
                )),
            },
            move |closed| {
                status.set(if closed {
                    format!("lost kvlens serve at {at}: the memory stream closed; press connect to try again")
                } else {
                    format!("kvlens serve at {at} stopped answering; reconnecting…")
                })
            },
        )?;
        stream.set_value(Some(opened));
        budget.set(budget_of(&info));
        kind.set(Some(Kind::Kvlens));
        status.set(connected);
        Ok(())
    };

    // Reads vLLM's metrics at `metrics_url` every second until generation `g` ends; `said` puts
    // a good read in words for the status line (none: the status belongs to something else).
    let poll_metrics = move |metrics_url: String, g: u64, said: Option<Wording>| {
        wasm_bindgen_futures::spawn_local(async move {
            loop {
                if !current(g) {
                    return;
                }
                let read = request("GET", &metrics_url).await;
                if !current(g) {
                    return;
                }
                let problem = match read {
                    Ok((200, body)) => {
                        let m = VllmMetrics::parse(&body);
                        if m.is_vllm() {
                            if let Some(said) = &said {
                                status.set(said(&m));
                            }
                            vllm.set(Some(m));
                            sleep(POLL_MS).await;
                            continue;
                        }
                        "it has none of vLLM's metrics now".to_string()
                    }
                    Ok((s, _)) => format!("HTTP {s}"),
                    Err(e) => e,
                };
                status.set(format!(
                    "lost vLLM metrics at {metrics_url}: {problem}; trying again every second"
                ));
                sleep(POLL_MS).await;
            }
        });
    };

    // Reads the vLLM server's `/metrics` every second until generation `g` ends.
    let watch_vllm = move |at: String, first: VllmMetrics, g: u64| {
        let metrics_url = format!("{at}/metrics");
        let connected: Wording = Rc::new(move |m: &VllmMetrics| {
            format!(
                "connected to vLLM metrics ({at}/metrics · {} · {} {} · read every second)",
                if m.model_names.is_empty() {
                    "?".to_string()
                } else {
                    m.model_names.join(", ")
                },
                m.engines,
                if m.engines == 1 { "engine" } else { "engines" }
            )
        });
        status.set(connected(&first));
        vllm.set(Some(first));
        kind.set(Some(Kind::Vllm));
        poll_metrics(metrics_url, g, Some(connected));
    };

    // Watches a `kvlens watch` at `at`: its snapshots, its relayed metrics, its plan.
    let watch_events = move |at: String, info: Value, g: u64| -> Result<(), String> {
        let w = &info["watch"];
        let connected = format!(
            "connected to kvlens watch ({at} · events {} · topic {:?} · replay {} · metrics {})",
            w["events"].as_str().unwrap_or("?"),
            w["topic"].as_str().unwrap_or(""),
            w["replay"].as_str().unwrap_or("none"),
            w["metrics"].as_str().unwrap_or("none")
        );
        let said = connected.clone();
        let metrics_url = format!("{at}/v1/watch/metrics");
        let opened = Stream::open(
            &format!("{at}/v1/watch/stream"),
            move |data| match serde_json::from_str::<KvWatchSnapshot>(&data) {
                Ok(s) => {
                    watched.set(Some(s));
                    status.set(said.clone());
                }
                Err(err) => status.set(format!("the watch stream sent an event that is not a snapshot: {err}")),
            },
            move |closed| {
                status.set(if closed {
                    format!("lost kvlens watch at {at}: its stream closed; press connect to try again")
                } else {
                    format!("kvlens watch at {at} stopped answering; reconnecting…")
                })
            },
        )?;
        stream.set_value(Some(opened));
        planned.set(serde_json::from_value(info["planned"].clone()).ok());
        kind.set(Some(Kind::Watch));
        status.set(connected);
        if w["metrics"].is_string() {
            poll_metrics(metrics_url, g, None);
        }
        Ok(())
    };

    // Looks for a server at what was typed (or at the page's own origin) and watches it.
    let connect = move |typed: String, own_origin: bool| {
        let g = stop();
        let Some(at) = base_url(&typed) else {
            status.set("no server found: type a server's URL, e.g. http://host:8000".to_string());
            return;
        };
        status.set(format!("looking for a server at {at}…"));
        wasm_bindgen_futures::spawn_local(async move {
            let found = detect(&at).await;
            if !current(g) {
                return;
            }
            if found.is_ok() {
                base.set_value(at.clone());
                if own_origin {
                    url.set(at.clone());
                }
            }
            let watched = match found {
                Ok(Found::Kvlens(info)) => watch_kvlens(at.clone(), info),
                Ok(Found::Vllm(m)) => {
                    watch_vllm(at.clone(), *m, g);
                    Ok(())
                }
                Ok(Found::Watch(info)) => watch_events(at.clone(), info, g),
                Err(reason) => Err(reason),
            };
            if let Err(reason) = watched {
                status.set(format!("no server found at {at}: {reason}"));
            }
        });
    };

    // The page's own origin first: a page served by kvlens serve watches it at once.
    match window().location().origin() {
        Ok(origin) if origin.starts_with("http") => connect(origin, true),
        _ => status.set("no server found: this page was not served over http(s); type a server's URL".to_string()),
    }

    let on_reset = Callback::new(move |k: ResetKind| {
        let at = base.get_value();
        let g = generation.get_value();
        reset_result.set(Some(format!("{}…", reset_path(k))));
        wasm_bindgen_futures::spawn_local(async move {
            let said = match request("POST", &format!("{at}{}", reset_path(k))).await {
                Ok((s, body)) => reset_words(k, s, &body),
                Err(e) => format!("{} failed: {e}", reset_path(k)),
            };
            if current(g) {
                reset_result.set(Some(said));
            }
        });
    });

    let disconnect = move |_| {
        stop();
        status.set(format!("disconnected from {}", base.get_value()));
    };

    let view_of = move || match kind.get() {
        Some(Kind::Kvlens) => view! {
            <MemoryView occupancy=occupancy.into() budget=budget.into() on_reset=on_reset
                reset_result=reset_result.into() />
        }
        .into_any(),
        Some(Kind::Vllm) => view! { <section class="memory"><VllmPanel metrics=vllm.into() /></section> }.into_any(),
        Some(Kind::Watch) => view! {
            <WatchPanel snapshot=watched.into() metrics=vllm.into() planned=planned.into() />
        }
        .into_any(),
        None => ().into_any(),
    };

    view! {
        <section class="server-mode">
            <h2>"Server mode"</h2>
            <p class="muted">"Watch a running server instead of the engine in this tab: a kvlens serve (every snapshot, in full), \
                a vLLM / vllm-ascend server through its Prometheus /metrics, or through kvlens watch, its KV cache block by \
                block (vLLM's --kv-events-config)."</p>
            <div class="controls">
                <label>"server URL"
                    <input type="url" data-testid="server-url" placeholder="http://host:8000"
                        prop:value=move || url.get()
                        on:input=move |ev| url.set(event_target_value(&ev))
                        on:keydown=move |ev| if ev.key() == "Enter" { connect(url.get_untracked(), false) } />
                </label>
                <button data-testid="server-connect" on:click=move |_| connect(url.get_untracked(), false)>"connect"</button>
                <button data-testid="server-disconnect" disabled=move || kind.get().is_none() on:click=disconnect>"disconnect"</button>
            </div>
            <p data-testid="server-status">{move || status.get()}</p>
            {view_of}
        </section>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_urls_become_base_urls() {
        assert_eq!(base_url(" 10.0.0.5:8000 ").as_deref(), Some("http://10.0.0.5:8000"));
        assert_eq!(base_url("https://h/v1/").as_deref(), Some("https://h"));
        assert_eq!(base_url("http://h:8000/metrics").as_deref(), Some("http://h:8000"));
        assert_eq!(base_url("http://h/api/").as_deref(), Some("http://h/api"));
        assert_eq!(base_url("  "), None);
    }

    #[test]
    fn reset_answers_in_words() {
        let said = reset_words(
            ResetKind::Encoder,
            200,
            r#"{"freed_bytes": 2097152, "encoder_cache_bytes": 0}"#,
        );
        assert!(said.contains("2.00 MiB freed"), "{said}");
        let said = reset_words(
            ResetKind::Prefix,
            409,
            r#"{"error": {"message": "requests hold blocks"}}"#,
        );
        assert_eq!(said, "/reset_prefix_cache refused (HTTP 409): requests hold blocks");
        let said = reset_words(
            ResetKind::Processor,
            200,
            r#"{"freed_bytes": 1024, "freed_entries": 3}"#,
        );
        assert!(
            said.starts_with("/reset_mm_cache") && said.contains("3 preprocessed images"),
            "{said}"
        );
    }
}
