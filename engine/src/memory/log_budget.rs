//! From a parsed vLLM start-up log to the full budget: the settings its header names, the figures
//! it printed put into the planner, checks of the log against itself, and what-if answers
//! ("what would make this `max_model_len` fit?").

use super::planner::{finish_kv, plan, MmLimits, Plan, PlanError, PlanRequest, Source};
use super::vllm_log::{ParsedLog, Printed, ProfilingFormat};
use crate::arch::config::DType;

use super::GIB;

/// Settings named by the log's header (the recorded `vllm serve` command and device note).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeaderSettings {
    /// The model as served (e.g. `Qwen/Qwen3-VL-32B-Instruct`).
    pub model: Option<String>,
    /// A device preset matching the header's device note (`cpu` for `kvlens serve`).
    pub device: Option<String>,
    /// The device's total memory when the command names it (`kvlens serve --cpu-memory-gib`).
    pub total_memory_gib: Option<f64>,
    /// `--tensor-parallel-size`.
    pub tensor_parallel_size: Option<usize>,
    /// `--max-model-len`.
    pub max_model_len: Option<usize>,
    /// `--gpu-memory-utilization` (or the printed util).
    pub gpu_memory_utilization: Option<f64>,
    /// `--max-num-batched-tokens`.
    pub max_num_batched_tokens: Option<usize>,
    /// `--max-num-seqs`.
    pub max_num_seqs: Option<usize>,
    /// `--block-size`.
    pub block_size: Option<usize>,
    /// `--kv-cache-dtype` (raw).
    pub kv_cache_dtype: Option<String>,
    /// `--limit-mm-per-prompt` (raw).
    pub limit_mm_per_prompt: Option<String>,
}

/// Reads the settings a log's header names.
pub fn header_settings(log: &ParsedLog) -> HeaderSettings {
    let mut s = HeaderSettings::default();
    let hint = log.device_hint.as_deref().unwrap_or_default().to_ascii_lowercase();
    s.device = if hint.contains("910b") || hint.contains("ascend") {
        Some("ascend-910b-64g".into())
    } else {
        ["h100", "h200", "a100", "l40s", "4090"]
            .iter()
            .find(|k| hint.contains(*k))
            .and_then(|k| super::device::device_presets().into_iter().find(|d| d.name.contains(k)))
            .map(|d| d.name)
    };
    let as_usize = |v: Option<u64>| v.and_then(|n| usize::try_from(n).ok());
    if let Some(c) = &log.command {
        s.model = c.model.clone();
        s.tensor_parallel_size = as_usize(c.tensor_parallel_size());
        s.max_model_len = as_usize(c.max_model_len());
        s.max_num_batched_tokens = as_usize(c.max_num_batched_tokens());
        s.max_num_seqs = as_usize(c.max_num_seqs());
        s.block_size = as_usize(c.block_size());
        s.gpu_memory_utilization = c.gpu_memory_utilization();
        s.kv_cache_dtype = c.kv_cache_dtype().map(str::to_string);
        s.limit_mm_per_prompt = c.limit_mm_per_prompt().map(str::to_string);
        if c.raw.starts_with("kvlens serve") {
            s.device = Some("cpu".into());
            s.total_memory_gib = c.flag("cpu-memory-gib").and_then(|v| v.parse().ok());
        }
    }
    if s.gpu_memory_utilization.is_none() {
        s.gpu_memory_utilization = log.gpu_memory_utilization;
    }
    s
}

/// One self-consistency check of the log.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Check {
    /// What is checked, as a formula.
    pub formula: String,
    /// The figures and the outcome in words.
    pub detail: String,
    /// Whether the log agrees with itself (within its printed precision).
    pub ok: bool,
}

/// One what-if answer for a target `max_model_len`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WhatIf {
    /// The flag changed on its own.
    pub knob: String,
    /// The smallest change that makes the target fit, or None when this knob alone cannot.
    pub change: Option<String>,
    /// How it was computed and what it leaves.
    pub detail: String,
}

/// Where the device total of the request handed to [`rebuild`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceTotal {
    /// The device preset's: a log that prints its requested memory and utilisation but no total
    /// replaces it by `requested / utilisation`.
    Preset,
    /// Stated (`--total-memory-gib`, or `--cpu-memory-gib` in a kvlens log's command): kept unless
    /// the log prints a total, and checked against the log's requested memory.
    Given,
}

/// The budget rebuilt from a log.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LogBudget {
    /// Which vllm-ascend profiling formula printed the log.
    pub format: Option<ProfilingFormat>,
    /// The budget with figures read from the log marked [`Source::FromLog`] and those inferred
    /// from them [`Source::Derived`].
    pub plan: Plan,
    /// Self-consistency checks.
    pub checks: Vec<Check>,
    /// What was inferred rather than read, in words.
    pub notes: Vec<String>,
}

impl LogBudget {
    /// The formula the log's figures follow, in words.
    pub fn formula(&self) -> &'static str {
        match self.format {
            Some(ProfilingFormat::Old) => {
                "old vllm-ascend profiling (< v0.15): available = total × util − (torch peak incl. weights + non-torch)"
            }
            Some(ProfilingFormat::New) => {
                "memory_profiling (vLLM, vllm-ascend ≥ v0.15): available = total × util − (weights + torch peak increase + non-torch increase)"
            }
            None => "no profiling lines: the planner estimates what the log does not say",
        }
    }
}

/// A closed interval of byte counts, for sums and differences of printed (rounded) figures.
#[derive(Debug, Clone, Copy)]
struct Span(i128, i128);

impl Span {
    fn of(p: &Printed) -> Span {
        let (lo, hi) = p.interval();
        if p.negative {
            Span(-i128::from(hi), -i128::from(lo))
        } else {
            Span(i128::from(lo), i128::from(hi))
        }
    }
    fn exact(v: i128) -> Span {
        Span(v, v)
    }
    fn add(self, o: Span) -> Span {
        Span(self.0 + o.0, self.1 + o.1)
    }
    fn sub(self, o: Span) -> Span {
        Span(self.0 - o.1, self.1 - o.0)
    }
    fn overlaps(self, o: Span) -> bool {
        self.0 <= o.1 && o.0 <= self.1
    }
    fn mid_gib(self) -> f64 {
        (self.0 + self.1) as f64 / 2.0 / GIB
    }
}

fn check(checks: &mut Vec<Check>, formula: &str, ok: bool, detail: String) {
    checks.push(Check {
        formula: formula.to_string(),
        detail,
        ok,
    });
}

/// The non-KV memory a plan's available KV memory implies: requested − available.
fn implied_non_kv(p: &Plan) -> i128 {
    i128::from(p.requested_bytes) - i128::from(p.available_kv_bytes)
}

/// The smallest of the available-memory figures (vLLM keeps the minimum over ranks).
fn log_available(log: &ParsedLog) -> Option<&Printed> {
    [
        &log.available_kv,
        &log.old_available,
        &log.old_available_with_requested,
        &log.error_available,
    ]
    .into_iter()
    .flatten()
    .filter(|p| !p.negative)
    .min_by_key(|p| p.bytes)
}

/// Puts the log's figures into the request and computes the plan; then checks the log against
/// itself. `req` carries the model and settings (from flags, the header, or defaults); `total`
/// says whether its device total is a preset's, which a log's own figures may replace.
pub fn rebuild(log: &ParsedLog, mut req: PlanRequest, total: DeviceTotal) -> Result<LogBudget, PlanError> {
    let format = log.profiling_format();
    if let Some(u) = log.gpu_memory_utilization {
        req.gpu_memory_utilization = u;
    }
    let mut notes = Vec::new();
    let total_source = if let Some(t) = &log.total {
        req.device = req.device.with_total_bytes(t.bytes);
        Some(Source::FromLog)
    } else if total == DeviceTotal::Given {
        Some(Source::Given)
    } else if let Some((requested, util)) = inferable_total(log) {
        let inferred = (requested.bytes as f64 / util).round() as u64;
        notes.push(format!(
            "The log prints no total memory: total = requested / gpu_memory_utilization = {} GiB / {util} = {:.2} GiB \
             (the {} preset says {:.2} GiB)",
            requested.text,
            inferred as f64 / GIB,
            req.device.name,
            req.device.total_bytes as f64 / GIB
        ));
        req.device = req.device.with_total_bytes(inferred);
        req.gpu_memory_utilization = util;
        Some(Source::Derived)
    } else {
        None
    };
    req.weights_bytes = log
        .profiled_weights
        .as_ref()
        .or(log.weights.as_ref())
        .map(|p| p.bytes)
        .or(req.weights_bytes);
    if let Some(n) = log.non_torch_increase.as_ref().or(log.old_non_torch.as_ref()) {
        req.non_torch_bytes = Some(n.signed_bytes().max(0) as u64);
    }
    if let Some(pk) = &log.torch_peak_increase {
        req.activation_peak_bytes = Some(pk.signed_bytes().max(0) as u64);
    } else if let (Some(pk), Some(w)) = (&log.old_torch_peak, req.weights_bytes) {
        // The old formula's peak includes the weights.
        req.activation_peak_bytes = Some(pk.bytes.saturating_sub(w));
    }
    let available = log_available(log);
    req.kv_cache_memory_bytes = available.map(|p| p.bytes).or(req.kv_cache_memory_bytes);
    let mut p = plan(&req)?;
    p.total_source = total_source;
    match (total_source, &log.requested) {
        (Some(Source::FromLog), _) => {
            p.requested_bytes = (p.total_bytes as f64 * p.gpu_memory_utilization).ceil() as u64;
        }
        (Some(Source::Derived), Some(requested)) => {
            p.requested_bytes = requested.bytes;
            p.requested_source = Source::FromLog;
        }
        _ => {}
    }
    if available.is_some() {
        p.available_kv_source = Source::FromLog;
        if req.activation_peak_bytes.is_none() && p.requested_bytes > 0 {
            // Old logs print only the result: whatever is not weights or non-torch was the peak.
            let peak = implied_non_kv(&p) - i128::from(p.weights_bytes) - i128::from(p.non_torch_bytes);
            p.activation_peak_bytes = u64::try_from(peak.max(0)).unwrap_or(u64::MAX);
            p.activation_peak_source = Source::Derived;
        }
    }
    p.sum_non_kv();
    if log.profiled_weights.is_some() || log.weights.is_some() {
        p.weights_source = Source::FromLog;
    }
    if log.torch_peak_increase.is_some() || log.old_torch_peak.is_some() {
        p.activation_peak_source = Source::FromLog;
    }
    if log.non_torch_increase.is_some() || log.old_non_torch.is_some() {
        p.non_torch_source = Source::FromLog;
    }
    finish_kv(&mut p);
    let checks = self_checks(log, &p);
    Ok(LogBudget {
        format,
        plan: p,
        checks,
        notes,
    })
}

/// The requested memory and the utilisation of a log that gives both (the utilisation printed or
/// in its command), from which its device total follows.
fn inferable_total(log: &ParsedLog) -> Option<(&Printed, f64)> {
    let util = log
        .gpu_memory_utilization
        .or_else(|| log.command.as_ref()?.gpu_memory_utilization())
        .filter(|u| *u > 0.0 && *u <= 1.0)?;
    Some((log.requested.as_ref()?, util))
}

fn self_checks(log: &ParsedLog, p: &Plan) -> Vec<Check> {
    let mut out = Vec::new();
    let util = p.gpu_memory_utilization;
    // An inferred total is requested / util: checking one against the other would prove nothing.
    if let Some(req) = log
        .requested
        .as_ref()
        .filter(|_| p.total_source != Some(Source::Derived))
    {
        let computed = (p.total_bytes as f64 * util).ceil() as u64;
        let mut detail = format!(
            "{:.2} GiB × {util} = {:.2} GiB; the log printed {} GiB",
            p.total_bytes as f64 / GIB,
            computed as f64 / GIB,
            req.text
        );
        if let Some(free) = &log.initial_free {
            detail.push_str(&format!(
                " (initial free {} GiB × {util} would be {:.2} GiB: requested is total × util, not free × util)",
                free.text,
                free.bytes as f64 * util / GIB
            ));
        }
        check(
            &mut out,
            "requested = total × gpu_memory_utilization",
            req.contains(computed),
            detail,
        );
    }
    if let (Some(non_kv), Some(w), Some(pk), Some(nt)) = (
        &log.non_kv,
        &log.profiled_weights,
        &log.torch_peak_increase,
        &log.non_torch_increase,
    ) {
        let sum = Span::of(w).add(Span::of(pk)).add(Span::of(nt));
        check(
            &mut out,
            "non_kv = weights + torch peak increase + non-torch increase",
            sum.overlaps(Span::of(non_kv)),
            format!(
                "{} + {} + {} = {:.2} GiB; the log printed {} GiB",
                w.text,
                pk.text,
                nt.text,
                sum.mid_gib(),
                non_kv.text
            ),
        );
    }
    if let (Some(w1), Some(w2)) = (&log.weights, &log.profiled_weights) {
        check(
            &mut out,
            "weights loaded = weights in the profiling result",
            Span::of(w1).overlaps(Span::of(w2)),
            format!("{} GiB at load, {} GiB in the profiling result", w1.text, w2.text),
        );
    }
    if let (Some(avail), Some(non_kv), Some(req)) = (&log.available_kv, &log.non_kv, &log.requested) {
        let diff = Span::of(req).sub(Span::of(non_kv));
        check(
            &mut out,
            "available KV = requested − non_kv (new formula)",
            diff.overlaps(Span::of(avail)),
            format!(
                "{} − {} = {:.2} GiB; the log printed {} GiB",
                req.text,
                non_kv.text,
                diff.mid_gib(),
                avail.text
            ),
        );
    }
    old_formula_checks(log, p, &mut out);
    kv_size_checks(log, p, &mut out);
    if let (Some(budget), Some(items)) = (log.encoder_budget_tokens, log.encoder_profile_items) {
        let ok = budget == p.encoder_budget_tokens as u64 && items == p.encoder_profile_items as u64;
        check(
            &mut out,
            "encoder budget = max(max_num_batched_tokens, max tokens per item); items = min(budget // item, max_num_seqs × per-prompt)",
            ok,
            format!(
                "with max_num_batched_tokens {} and {} tokens per item: {} tokens, {} items; the log printed {budget} tokens, {items} items",
                p.max_num_batched_tokens, p.max_tokens_per_image, p.encoder_budget_tokens, p.encoder_profile_items
            ),
        );
    }
    out
}

fn old_formula_checks(log: &ParsedLog, p: &Plan, out: &mut Vec<Check>) {
    let (Some(peak), Some(nt)) = (&log.old_torch_peak, &log.old_non_torch) else {
        return;
    };
    let requested = Span::exact((p.total_bytes as f64 * p.gpu_memory_utilization).ceil() as i128);
    let expected = requested.sub(Span::of(peak)).sub(Span::of(nt));
    for avail in [&log.old_available, &log.old_available_with_requested]
        .into_iter()
        .flatten()
    {
        let ok = expected.overlaps(Span::of(avail));
        let delta = Span::of(avail).mid_gib() - expected.mid_gib();
        check(
            out,
            "available = total × util − (torch peak incl. weights + non-torch) (old formula)",
            ok,
            format!(
                "{:.2} − {} − {} = {:.2} GiB; the log printed {} GiB{}",
                p.total_bytes as f64 / GIB * p.gpu_memory_utilization,
                peak.text,
                nt.text,
                expected.mid_gib(),
                avail.text,
                if ok {
                    String::new()
                } else {
                    format!(
                        " ({delta:+.2} GiB: it implies {:.2} GiB of non-torch memory when available was computed, \
                         so non-torch grew after it was printed, or the lines come from different ranks)",
                        Span::of(nt).mid_gib() - delta
                    )
                }
            ),
        );
    }
}

fn kv_size_checks(log: &ParsedLog, p: &Plan, out: &mut Vec<Check>) {
    let per_block = (p.page_size_bytes * p.num_layers as u64) as i128;
    let bs = p.block_size as u64;
    if let (Some(tokens), Some(avail)) = (log.kv_cache_tokens, log_available(log)) {
        let s = Span::of(avail);
        let (lo, hi) = (
            (s.0.max(0) / per_block) as u64 * bs,
            (s.1.max(0) / per_block) as u64 * bs,
        );
        check(
            out,
            "KV tokens = (available // page // layers) × block size",
            (lo..=hi).contains(&tokens),
            format!(
                "{} GiB // {} B // {} layers = {} blocks × {bs} = {} tokens; the log printed {tokens}",
                avail.text, p.page_size_bytes, p.num_layers, p.num_gpu_blocks, p.kv_cache_tokens
            ),
        );
    }
    if let (Some(x), Some(len)) = (log.max_concurrency, log.max_concurrency_model_len) {
        // The log's own block count when it printed one: the GiB figure is rounded to 0.01.
        let blocks = log.kv_cache_tokens.map_or(p.num_gpu_blocks, |t| t / bs);
        let computed = blocks as f64 / len.div_ceil(bs) as f64;
        check(
            out,
            "max concurrency = blocks / cdiv(max_model_len, block)",
            (computed - x).abs() < 0.006,
            format!(
                "{blocks} / {} = {computed:.2}x; the log printed {x:.2}x",
                len.div_ceil(bs)
            ),
        );
    }
    if let (Some(len), Some(needed)) = (log.error_max_model_len, &log.error_needed) {
        let computed = (p.num_layers as u64)
            .saturating_mul(len.div_ceil(bs))
            .saturating_mul(p.page_size_bytes);
        check(
            out,
            "KV needed = layers × cdiv(max_model_len, block) × page",
            needed.contains(computed),
            format!(
                "{} × {} × {} B = {:.2} GiB; the log printed {} GiB",
                p.num_layers,
                len.div_ceil(bs),
                p.page_size_bytes,
                computed as f64 / GIB,
                needed.text
            ),
        );
    }
    if let (Some(w), Some(avail)) = (log.error_estimated_max_model_len, &log.error_available) {
        let s = Span::of(avail);
        let at = |b: i128| (b.max(0) / per_block) as u64 * bs;
        check(
            out,
            "estimated max model len = floor(available / (layers × page)) × block",
            (at(s.0)..=at(s.1)).contains(&w),
            format!(
                "floor({} GiB / {} B) × {bs} = {}; the log printed {w}",
                avail.text,
                per_block,
                at(s.0)
            ),
        );
    }
}

/// Answers "what makes `target` tokens fit?" for each knob changed on its own.
pub fn what_if(budget: &LogBudget, req: &PlanRequest, target: usize) -> Vec<WhatIf> {
    let p = &budget.plan;
    let bs = p.block_size as u64;
    let needed = |page: u64, layers: usize| {
        (layers as u64)
            .saturating_mul((target as u64).div_ceil(bs))
            .saturating_mul(page)
    };
    let need = needed(p.page_size_bytes, p.num_layers);
    let avail = p.available_kv_bytes.max(0) as u64;
    let mut out = Vec::new();
    if need <= avail {
        out.push(WhatIf {
            knob: "none".into(),
            change: Some("already fits".into()),
            detail: format!(
                "{:.2} GiB needed, {:.2} GiB available",
                need as f64 / GIB,
                avail as f64 / GIB
            ),
        });
        return out;
    }
    // Utilization: requested must grow by what is missing.
    let non_kv = implied_non_kv(p);
    let util = (need as f64 + non_kv as f64) / p.total_bytes as f64;
    let util_up = (util * 100.0).ceil() / 100.0;
    out.push(WhatIf {
        knob: "gpu-memory-utilization".into(),
        change: (util_up <= 1.0).then(|| format!("--gpu-memory-utilization {util_up:.2}")),
        detail: format!(
            "({:.2} GiB KV + {:.2} GiB non-KV) / {:.2} GiB total = {util:.4}{}",
            need as f64 / GIB,
            non_kv as f64 / GIB,
            p.total_bytes as f64 / GIB,
            if util_up > 1.0 {
                ": above 1, so utilization alone cannot make it fit"
            } else {
                ""
            }
        ),
    });
    out.push(tp_what_if(p, req, target));
    out.push(mnbt_what_if(p, req, target));
    // fp8 KV halves the page (from 2-byte dtypes).
    let fp8_page = p.page_size_bytes / p.kv_cache_dtype.size_bytes() * DType::Fp8.size_bytes();
    let fp8_need = needed(fp8_page, p.num_layers);
    out.push(WhatIf {
        knob: "kv-cache-dtype".into(),
        change: (fp8_need <= avail && p.kv_cache_dtype != DType::Fp8).then(|| "--kv-cache-dtype fp8".into()),
        detail: format!(
            "{:.2} GiB needed with fp8 KV, {:.2} GiB available",
            fp8_need as f64 / GIB,
            avail as f64 / GIB
        ),
    });
    out.push(video_what_if(p, req, target));
    out
}

/// Re-plans with a changed request, keeping the log's measured figures but moving them by what
/// the planner's estimates say the change moves.
fn replan(p: &Plan, req: &PlanRequest, change: impl Fn(&mut PlanRequest)) -> Option<Plan> {
    let mut base = req.clone();
    base.weights_bytes = None;
    base.activation_peak_bytes = None;
    base.kv_cache_memory_bytes = None;
    let before = plan(&base).ok()?;
    let mut changed = base.clone();
    change(&mut changed);
    let after = plan(&changed).ok()?;
    // Weights scale with the split; activations and the rest move by the estimated difference.
    let weights = (p.weights_bytes as f64 * after.weights_bytes as f64 / before.weights_bytes.max(1) as f64) as u64;
    let peak = i128::from(p.activation_peak_bytes) + i128::from(after.activation_peak_bytes)
        - i128::from(before.activation_peak_bytes);
    let peak = u64::try_from(peak.max(0)).unwrap_or(u64::MAX);
    change(&mut base);
    base.device = base.device.with_total_bytes(p.total_bytes);
    base.gpu_memory_utilization = p.gpu_memory_utilization;
    base.weights_bytes = Some(weights);
    base.activation_peak_bytes = Some(peak);
    base.non_torch_bytes = Some(p.non_torch_bytes);
    plan(&base).ok()
}

/// The first candidate value of a knob whose plan fits `target`, with that plan.
fn first_that_fits(
    p: &Plan,
    req: &PlanRequest,
    target: usize,
    candidates: impl IntoIterator<Item = usize>,
    apply: impl Fn(&mut PlanRequest, usize),
) -> Option<(usize, Plan)> {
    candidates.into_iter().find_map(|c| {
        let q = replan(p, req, |r| {
            apply(r, c);
            r.max_model_len = Some(target);
        })?;
        q.fits.then_some((c, q))
    })
}

fn tp_what_if(p: &Plan, req: &PlanRequest, target: usize) -> WhatIf {
    let candidates = [2, 4, 8, 16].into_iter().filter(|&t| t > p.tensor_parallel_size);
    let found = first_that_fits(p, req, target, candidates, |r, tp| r.tensor_parallel_size = tp);
    WhatIf {
        knob: "tensor-parallel-size".into(),
        change: found.as_ref().map(|(tp, _)| format!("--tensor-parallel-size {tp}")),
        detail: match found {
            Some((_, q)) => format!(
                "per rank: weights {:.2} GiB, {:.2} GiB KV available, {:.2} GiB needed ({} KV heads per rank)",
                q.weights_bytes as f64 / GIB,
                q.available_kv_bytes as f64 / GIB,
                q.needed_kv_bytes as f64 / GIB,
                q.kv_heads_per_rank
            ),
            None => "no tensor-parallel degree up to 16 that divides the heads makes it fit".into(),
        },
    }
}

fn mnbt_what_if(p: &Plan, req: &PlanRequest, target: usize) -> WhatIf {
    let halvings = std::iter::successors(Some(p.max_num_batched_tokens / 2), |m| Some(m / 2)).take_while(|&m| m >= 256);
    let found = first_that_fits(p, req, target, halvings, |r, m| r.max_num_batched_tokens = Some(m));
    WhatIf {
        knob: "max-num-batched-tokens".into(),
        change: found.as_ref().map(|(m, _)| format!("--max-num-batched-tokens {m}")),
        detail: match found {
            Some((_, q)) => format!(
                "activation peak {:.2} GiB, encoder budget {} tokens, {:.2} GiB KV available",
                q.activation_peak_bytes as f64 / GIB,
                q.encoder_budget_tokens,
                q.available_kv_bytes as f64 / GIB
            ),
            None => format!(
                "even 256 tokens per step frees too little (from {})",
                p.max_num_batched_tokens
            ),
        },
    }
}

fn video_what_if(p: &Plan, req: &PlanRequest, target: usize) -> WhatIf {
    let no_video = MmLimits {
        video: 0,
        ..req.limit_mm_per_prompt
    };
    match replan(p, req, |r| {
        r.limit_mm_per_prompt = no_video;
        r.max_model_len = Some(target);
    }) {
        Some(q) if q.fits => WhatIf {
            knob: "limit-mm-per-prompt".into(),
            change: Some(format!("--limit-mm-per-prompt image={},video=0", no_video.image)),
            detail: format!(
                "encoder budget {} tokens, {:.2} GiB KV available",
                q.encoder_budget_tokens,
                q.available_kv_bytes as f64 / GIB
            ),
        },
        q => WhatIf {
            knob: "limit-mm-per-prompt".into(),
            change: None,
            detail: match q {
                Some(q) => format!(
                    "video=0 leaves the encoder budget at {} tokens and {:.2} GiB KV available",
                    q.encoder_budget_tokens,
                    q.available_kv_bytes as f64 / GIB
                ),
                None => "the planner cannot evaluate it".into(),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::bundled_config;
    use crate::memory::device_preset;
    use crate::memory::vllm_log::parse_vllm_log;

    /// Found by the vllm_log fuzz target: printed figures near `u64::MAX` overflowed the sums and
    /// differences of byte counts (a panic in debug builds); they now saturate.
    #[test]
    fn huge_printed_figures_do_not_overflow() {
        let log = parse_vllm_log(
            "Loading model weights took 17179869183 GB\n\
             Initial free memory: 17179869183 GiB; Requested memory: 0.90 (util), 17179869183 GiB\n\
             Total non KV cache memory: 17179869183 GiB; torch peak memory increase: 17179869183 GiB; \
             non-torch forward increase memory: 17179869183 GiB; weights memory: 17179869183 GiB.\n\
             Available KV cache memory: 0.01 GiB\n\
             GPU KV cache size: 18446744073709551615 tokens\n",
        );
        let cfg = bundled_config("Qwen3-VL-8B-Instruct").unwrap();
        let req = PlanRequest::new("Qwen3-VL-8B-Instruct", cfg, device_preset("h100-80g").unwrap());
        let budget = rebuild(&log, req.clone(), DeviceTotal::Preset).unwrap();
        assert_eq!(budget.plan.non_kv_bytes, u64::MAX);
        assert!(!what_if(&budget, &req, usize::MAX).is_empty());
    }
}
