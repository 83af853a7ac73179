//! The planner page: pick a model, a device and vLLM's flags, and see the start-up budget and the
//! log lines vLLM would print, computed in the browser by the same engine code the server uses.

use kvlens_engine::config::{bundled_config, BUNDLED_CONFIGS};
use kvlens_engine::memory::device::device_presets;
use kvlens_engine::memory::log_budget::{header_settings, rebuild, DeviceTotal};
use kvlens_engine::memory::vllm_log::parse_vllm_log;
use kvlens_engine::memory::{plan, MmLimits, Plan, PlanRequest};
use leptos::prelude::*;

/// The planner inputs the page exposes.
#[derive(Debug, Clone, PartialEq)]
struct Inputs {
    model: String,
    device: String,
    tp: usize,
    util: f64,
    max_model_len: Option<usize>,
    /// A pasted vLLM start-up log; when present its settings and figures rebuild the budget.
    log: String,
}

/// The plan for the inputs; with a pasted log, the settings its header names win over the form's.
fn compute(i: &Inputs) -> Result<(Plan, Vec<String>), String> {
    let log = parse_vllm_log(&i.log);
    let header = header_settings(&log);
    let model = header.model.clone().unwrap_or_else(|| i.model.clone());
    let cfg = bundled_config(&model).map_err(|e| e.to_string())?;
    let device_name = header.device.clone().unwrap_or_else(|| i.device.clone());
    let device = device_presets()
        .into_iter()
        .find(|d| d.name == device_name)
        .ok_or("unknown device")?;
    let mut r = PlanRequest::new(model.rsplit('/').next().unwrap_or(&model), cfg, device);
    r.tensor_parallel_size = header.tensor_parallel_size.unwrap_or(i.tp);
    r.gpu_memory_utilization = header.gpu_memory_utilization.unwrap_or(i.util);
    r.max_model_len = header.max_model_len.or(i.max_model_len);
    r.max_num_batched_tokens = header.max_num_batched_tokens;
    r.max_num_seqs = header.max_num_seqs;
    r.block_size = header.block_size;
    if let Some(l) = &header.limit_mm_per_prompt {
        r.limit_mm_per_prompt = MmLimits::parse(l).map_err(|e| e.to_string())?;
    }
    if log.recognised.is_empty() {
        return Ok((plan(&r).map_err(|e| e.to_string())?, Vec::new()));
    }
    let budget = rebuild(&log, r, DeviceTotal::Preset).map_err(|e| e.to_string())?;
    let mut notes = vec![format!("{} log lines recognised", log.recognised.len())];
    notes.extend(budget.notes.iter().cloned());
    notes.extend(
        budget
            .checks
            .iter()
            .map(|c| format!("[{}] {}: {}", if c.ok { "ok" } else { "mismatch" }, c.formula, c.detail)),
    );
    Ok((budget.plan, notes))
}

/// A bar segment's style: its share of the device total and its colour.
fn segment(bytes: u64, total: u64, colour: &str) -> String {
    format!(
        "width: {:.2}%; background: {colour}",
        100.0 * bytes as f64 / total.max(1) as f64
    )
}

/// The planner page.
#[component]
pub fn PlannerPage() -> impl IntoView {
    let inputs = RwSignal::new(Inputs {
        model: "Qwen3-VL-8B-Instruct".into(),
        device: "h100-80g".into(),
        tp: 1,
        util: 0.9,
        max_model_len: None,
        log: String::new(),
    });
    let result = Memo::new(move |_| compute(&inputs.get()));
    let models = BUNDLED_CONFIGS
        .iter()
        .map(|(n, _)| view! { <option value=*n>{*n}</option> })
        .collect_view();
    let devices = device_presets()
        .into_iter()
        .map(|d| {
            let label = d.name.clone();
            view! { <option value=d.name>{label}</option> }
        })
        .collect_view();
    view! {
        <main>
            <h1>"kvlens planner"</h1>
            <p>"vLLM's start-up memory budget for a Qwen-VL model, computed in your browser."</p>
            <div class="controls">
                <label>"model"
                    <select prop:value=move || inputs.get().model
                        on:change=move |ev| inputs.update(|i| i.model = event_target_value(&ev))>{models}</select>
                </label>
                <label>"device"
                    <select prop:value=move || inputs.get().device
                        on:change=move |ev| inputs.update(|i| i.device = event_target_value(&ev))>{devices}</select>
                </label>
                <label>"tensor parallel"
                    <input type="number" min="1" prop:value=move || inputs.get().tp.to_string()
                        on:change=move |ev| inputs.update(|i| i.tp = event_target_value(&ev).parse().unwrap_or(1)) />
                </label>
                <label>"gpu memory utilization"
                    <input type="number" step="0.01" min="0.05" max="1" prop:value=move || inputs.get().util.to_string()
                        on:change=move |ev| inputs.update(|i| i.util = event_target_value(&ev).parse().unwrap_or(0.9)) />
                </label>
                <label>"max model len (empty: config)"
                    <input type="number" min="1"
                        on:change=move |ev| inputs.update(|i| i.max_model_len = event_target_value(&ev).parse().ok()) />
                </label>
            </div>
            <label class="paste">"or paste a vLLM start-up log"
                <textarea rows="4" placeholder="Loading model weights took 9.19 GB …"
                    on:input=move |ev| inputs.update(|i| i.log = event_target_value(&ev))></textarea>
            </label>
            {move || match result.get() {
                Err(e) => view! { <p class="error">{e}</p> }.into_any(),
                Ok((p, notes)) => {
                    let total = p.total_bytes;
                    let kv = p.available_kv_bytes.max(0) as u64;
                    let rows = p.table().into_iter().map(|(label, value, source)| {
                        let source = source.map(|s| format!("{s:?}").to_lowercase()).unwrap_or_else(|| "device".into());
                        view! { <tr><td>{label}</td><td class="value">{value}</td><td class="source">{source}</td></tr> }
                    }).collect_view();
                    view! {
                        <div class="bar" title="weights | activation peak | non-torch | KV cache | headroom">
                            <div style=segment(p.weights_bytes, total, "#4c6ef5") title="weights"></div>
                            <div style=segment(p.activation_peak_bytes, total, "#f59f00") title="activation peak"></div>
                            <div style=segment(p.non_torch_bytes, total, "#868e96") title="non-torch"></div>
                            <div style=segment(kv, total, "#37b24d") title="KV cache"></div>
                        </div>
                        <table>{rows}</table>
                        <pre class="log">{p.vllm_log_lines().join("\n")}</pre>
                        <ul class="checks">{notes.into_iter().map(|n| view! { <li>{n}</li> }).collect_view()}</ul>
                    }.into_any()
                }
            }}
        </main>
    }
}
