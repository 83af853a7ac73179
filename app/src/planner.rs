//! The planner page: a model, a device and vLLM's flags (from the form or from the link's query
//! string, which the page keeps up to date so that every configuration is a shareable link) and what
//! `kvlens plan` prints for them: the verdict, the breakdown and vLLM's log lines. A pasted vLLM or
//! vllm-ascend log is explained as `kvlens plan --from-log` explains it. The engine's own planner
//! computes everything, in wasm.

use kvlens_engine::arch::config::BUNDLED_CONFIGS;
use kvlens_engine::arch::weight_format::WeightFormat;
use kvlens_engine::memory::device::device_presets;
use kvlens_engine::memory::log_budget::{HeaderSettings, LogBudget, WhatIf};
use kvlens_engine::memory::plan_inputs::{bundled_model, PlanInputs, DEFAULT_DEVICE, DEFAULT_MODEL};
use kvlens_engine::memory::vllm_log::{parse_vllm_log, RecognisedLine};
use kvlens_engine::memory::{plan, Plan, Source};
use leptos::prelude::*;

/// Text and number fields: (query key, vLLM's flag, what an empty field means).
const FIELDS: &[(&str, &str, &str)] = &[
    ("tp", "--tensor-parallel-size", "1"),
    ("gpu_memory_utilization", "--gpu-memory-utilization", "0.9"),
    ("kv_cache_memory_gib", "--kv-cache-memory-gib", "total × util − non-KV"),
    ("max_model_len", "--max-model-len", "the model's"),
    (
        "max_num_batched_tokens",
        "--max-num-batched-tokens",
        "vLLM's for the device",
    ),
    ("max_num_seqs", "--max-num-seqs", "vLLM's for the device"),
    ("block_size", "--block-size", "16, 128 on Ascend"),
    ("limit_mm_per_prompt", "--limit-mm-per-prompt", "image=999,video=999"),
    (
        "mm_processor_kwargs",
        "--mm-processor-kwargs",
        "the checkpoint's max_pixels",
    ),
    ("mm_processor_cache_gb", "--mm-processor-cache-gb", "4"),
    ("total_memory_gib", "--total-memory-gib", "the device's"),
    ("weights_gib", "--weights-gib (measured)", "estimated"),
    ("activation_peak_gib", "--activation-peak-gib (measured)", "estimated"),
    ("non_torch_gib", "--non-torch-gib (measured)", "the device's"),
];

/// `--dtype` choices.
const DTYPES: &[&str] = &["auto", "bfloat16", "float16", "float32"];
/// `--quantization` choices: the weight formats the engine quantizes to on load.
fn quantizations() -> Vec<(String, String)> {
    WeightFormat::ALL
        .iter()
        .map(|f| (f.name().to_string(), f.name().to_string()))
        .collect()
}
/// `--kv-cache-dtype` choices.
const KV_DTYPES: &[&str] = &["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"];

/// A pasted start-up log explained: what was recognised, the budget it rebuilds, the what-ifs.
#[derive(Debug, Clone, PartialEq)]
struct LogReport {
    recognised: Vec<RecognisedLine>,
    ignored_lines: usize,
    budget: LogBudget,
    what_if: Option<Vec<WhatIf>>,
}

/// What `kvlens plan` (or, with a log, `kvlens plan --from-log`) computes for the page's inputs.
fn compute(inputs: &PlanInputs, log: &str, target: Option<usize>) -> Result<(Plan, Option<LogReport>), String> {
    if log.trim().is_empty() {
        let req = inputs
            .request(&HeaderSettings::default(), bundled_model)
            .map_err(|e| e.to_string())?;
        return Ok((plan(&req).map_err(|e| e.to_string())?, None));
    }
    let parsed = parse_vllm_log(log);
    let (budget, what_if) = inputs
        .explain_log(&parsed, target, bundled_model)
        .map_err(|e| e.to_string())?;
    let report = LogReport {
        recognised: parsed.recognised,
        ignored_lines: parsed.ignored_lines,
        budget,
        what_if,
    };
    Ok((report.budget.plan.clone(), Some(report)))
}

/// Sets one input from the form; a value the input cannot take is reported, not applied.
fn set_input(inputs: RwSignal<PlanInputs>, error: RwSignal<Option<String>>, key: &str, value: &str) {
    let mut next = inputs.get_untracked();
    match next.set(key, value) {
        Ok(()) => {
            inputs.set(next);
            error.set(None);
        }
        Err(e) => error.set(Some(e.to_string())),
    }
}

/// A `<select>` bound to one input: (value, label) options, the first one usually the default.
fn select(
    key: &'static str,
    label: &'static str,
    options: Vec<(String, String)>,
    inputs: RwSignal<PlanInputs>,
    error: RwSignal<Option<String>>,
) -> impl IntoView {
    let options = options
        .into_iter()
        .map(|(value, text)| {
            let v = value.clone();
            let selected = move || inputs.with(|i| i.get(key).unwrap_or_default()) == v;
            view! { <option value=value prop:selected=selected>{text}</option> }
        })
        .collect_view();
    view! {
        <label>{label}
            <select name=key on:change=move |ev| set_input(inputs, error, key, &event_target_value(&ev))>{options}</select>
        </label>
    }
}

/// A text field bound to one input.
fn field(
    (key, label, default): (&'static str, &'static str, &'static str),
    inputs: RwSignal<PlanInputs>,
    error: RwSignal<Option<String>>,
) -> impl IntoView {
    view! {
        <label>{label}
            <input type="text" name=key placeholder=default
                prop:value=move || inputs.with(|i| i.get(key)).unwrap_or_default()
                on:change=move |ev| set_input(inputs, error, key, &event_target_value(&ev)) />
        </label>
    }
}

/// The page's address with the inputs as its query string.
fn shareable_link(query: &str) -> String {
    let location = window().location();
    let origin = location.origin().unwrap_or_default();
    let path = location.pathname().unwrap_or_default();
    if query.is_empty() {
        format!("{origin}{path}")
    } else {
        format!("{origin}{path}?{query}")
    }
}

/// The planner page.
#[component]
pub fn PlannerPage() -> impl IntoView {
    let (initial, link_errors) = PlanInputs::from_query(&window().location().search().unwrap_or_default());
    let inputs = RwSignal::new(initial);
    let form_error = RwSignal::new(None::<String>);
    let log = RwSignal::new(String::new());
    let target = RwSignal::new(None::<usize>);
    let link = Memo::new(move |_| shareable_link(&inputs.with(PlanInputs::to_query)));
    Effect::new(move |_| {
        let url = link.get();
        if let Ok(history) = window().history() {
            // Best effort: a browser that refuses only leaves the address bar as it was.
            let _ = history.replace_state_with_url(&leptos::wasm_bindgen::JsValue::NULL, "", Some(&url));
        }
    });
    let result = Memo::new(move |_| compute(&inputs.get(), &log.get(), target.get()));

    let models = std::iter::once((String::new(), format!("{DEFAULT_MODEL} (default, or the log's)")))
        .chain(BUNDLED_CONFIGS.iter().map(|(n, _)| (n.to_string(), n.to_string())))
        .collect();
    let devices = std::iter::once((String::new(), format!("{DEFAULT_DEVICE} (default, or the log's)")))
        .chain(
            device_presets()
                .into_iter()
                .map(|d| (d.name.clone(), format!("{}: {}", d.name, d.description))),
        )
        .collect();
    let dtypes = |names: &[&str]| names.iter().map(|n| (n.to_string(), n.to_string())).collect();
    let on_target = move |ev| {
        let text = event_target_value(&ev);
        match text.trim() {
            "" => target.set(None),
            t => match t.parse() {
                Ok(n) => {
                    target.set(Some(n));
                    form_error.set(None);
                }
                Err(_) => form_error.set(Some(format!("target max model len: {t:?} is not a whole number"))),
            },
        }
    };
    view! {
        <main class="planner">
            <h1>"kvlens planner"</h1>
            <p>"vLLM's start-up memory budget for a Qwen-VL model, computed in your browser by the same engine code as "<code>"kvlens plan"</code>"."</p>
            <div class="controls">
                {select("model", "model", models, inputs, form_error)}
                {select("device", "device", devices, inputs, form_error)}
                {FIELDS.iter().map(|f| field(*f, inputs, form_error)).collect_view()}
                {select("dtype", "--dtype", dtypes(DTYPES), inputs, form_error)}
                {select("kv_cache_dtype", "--kv-cache-dtype", dtypes(KV_DTYPES), inputs, form_error)}
                {select("quantization", "--quantization", quantizations(), inputs, form_error)}
            </div>
            {move || form_error.get().map(|e| view! { <p class="error" data-testid="planner-form-error">{e}</p> })}
            <p class="planner-link">"Link to this configuration: "
                <a data-testid="planner-link" href=move || link.get()>{move || link.get()}</a>
            </p>
            <label class="paste">"Paste a vLLM or vllm-ascend start-up log to explain it, as "<code>"kvlens plan --from-log"</code>" does (the fields above override its command line)"
                <textarea rows="5" data-testid="planner-log" placeholder="Loading model weights took 9.19 GB …"
                    on:input=move |ev| log.set(event_target_value(&ev))></textarea>
            </label>
            <label class="paste">"target max model len (with a log: the smallest change of each knob that makes it fit)"
                <input type="text" name="target_max_model_len" on:change=on_target />
            </label>
            <section class="planner-result" data-testid="planner-result">
                {link_errors.into_iter().map(|e| view! { <p class="error">"In the link: "{e.to_string()}" (left at its default)"</p> }).collect_view()}
                {move || match result.get() {
                    Err(e) => view! { <p class="error">{e}</p> }.into_any(),
                    Ok((p, report)) => view! { <PlanView p=p /> {report.map(|r| view! { <LogView r=r /> })} }.into_any(),
                }}
            </section>
        </main>
    }
}

/// A bar segment's style: its share of the whole bar and its colour.
fn segment(bytes: u64, whole: u64, colour: &str) -> String {
    format!(
        "width: {:.2}%; background: {colour}",
        100.0 * bytes as f64 / whole.max(1) as f64
    )
}

/// The verdict, the memory bar, the breakdown and vLLM's log lines of one plan.
#[component]
fn PlanView(p: Plan) -> impl IntoView {
    let kv = p.available_kv_bytes.max(0) as u64;
    let parts = [
        ("weights", p.weights_bytes, "#4c6ef5"),
        ("activation peak", p.activation_peak_bytes, "#f59f00"),
        ("non-torch", p.non_torch_bytes, "#868e96"),
        ("KV cache", kv, "#37b24d"),
    ];
    let used: u64 = parts.iter().map(|(_, b, _)| b).sum();
    // A fixed KV size may ask for more than the device has: the bar then spans the sum.
    let whole = p.total_bytes.max(used);
    let bar = parts
        .into_iter()
        .map(|(name, bytes, colour)| view! { <div style=segment(bytes, whole, colour) title=name></div> })
        .collect_view();
    let legend = parts
        .into_iter()
        .map(|(name, _, colour)| view! { <span><i style=format!("background: {colour}")></i>{name}</span> })
        .collect_view();
    let rows = p
        .table()
        .into_iter()
        .map(|(label, value, source)| {
            view! { <tr><td>{label}</td><td class="value">{value}</td><td class="source">{Source::label(source)}</td></tr> }
        })
        .collect_view();
    view! {
        <p class="planner-summary">{p.summary()}</p>
        <p class="planner-verdict" class:fits=p.fits data-testid="planner-verdict">{p.verdict()}</p>
        <div class="bar" title="weights | activation peak | non-torch | KV cache | rest of the device">{bar}</div>
        <p class="planner-legend">{legend}<span><i></i>"rest of the device"</span></p>
        <table>{rows}</table>
        <h2>"What vLLM logs"</h2>
        <pre class="log">{p.vllm_log_lines().join("\n")}</pre>
    }
}

/// What `kvlens plan --from-log` says about a pasted log besides the plan.
#[component]
fn LogView(r: LogReport) -> impl IntoView {
    let b = &r.budget;
    let lines = r
        .recognised
        .iter()
        .map(|l| view! { <li><code>{format!("line {:>3}  {:?}", l.line, l.kind)}</code></li> })
        .collect_view();
    let notes = b.notes.iter().map(|n| view! { <li>{n.clone()}</li> }).collect_view();
    let checks = b
        .checks
        .iter()
        .map(|c| {
            let mark = if c.ok { "ok" } else { "MISMATCH" };
            view! { <li class:mismatch=!c.ok>"["{mark}"] "{c.formula.clone()}<br />{c.detail.clone()}</li> }
        })
        .collect_view();
    let what_if = r.what_if.clone().map(|answers| {
        let rows = answers
            .into_iter()
            .map(|w| {
                let change = w.change.unwrap_or_else(|| "cannot on its own".into());
                view! { <tr><td>{w.knob}</td><td>{change}</td><td class="source">{w.detail}</td></tr> }
            })
            .collect_view();
        view! { <h3>"To fit the target, changing one knob at a time"</h3><table>{rows}</table> }
    });
    view! {
        <h2>"The pasted log"</h2>
        <p>{format!("Recognised {} lines ({} ignored).", r.recognised.len(), r.ignored_lines)}</p>
        <ul class="checks">{lines}</ul>
        <p>"Formula: "{b.formula()}</p>
        <ul class="checks">{notes}</ul>
        <h3>"Checks of the log against itself"</h3>
        <ul class="checks">{checks}</ul>
        {what_if}
    }
}
