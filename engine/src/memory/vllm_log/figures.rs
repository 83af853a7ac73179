//! The memory lines of a start-up log: weights, encoder budget, profiling results (old and new
//! formats), KV cache size and the start-up errors, each turned into a fact on [`ParsedLog`].

use super::numbers::{
    parse_f64, split_count, split_f64, split_number, split_size, split_size_or_bytes, split_unit, Printed,
};
use super::{LineKind, ParsedLog};

/// Text after the first occurrence of `phrase`.
fn after<'a>(s: &'a str, phrase: &str) -> Option<&'a str> {
    s.find(phrase).and_then(|i| s.get(i + phrase.len()..))
}

pub(super) enum Outcome {
    Nothing,
    Malformed,
    Fact(Box<Fact>),
}

#[derive(Debug)]
pub(super) enum Fact {
    Weights(Printed),
    ModelLoading {
        weights: Printed,
        seconds: Option<f64>,
    },
    WeightsLoadTime(f64),
    EncoderBudget {
        tokens: u64,
        items: Option<u64>,
        modality: Option<String>,
    },
    OldTorchPeak(Printed),
    OldNonTorch(Printed),
    OldRealProfiling,
    OldAvailableTotal {
        available: Printed,
        total: Printed,
    },
    OldAvailableRequested {
        available: Printed,
        requested: Printed,
    },
    InitialFree {
        free: Printed,
        util: Option<f64>,
        requested: Option<Printed>,
    },
    FreeAfterProfiling {
        total: Printed,
        within_requested: Option<Printed>,
    },
    ProfilingResult {
        seconds: Option<f64>,
        non_kv: Printed,
        torch_peak: Option<Printed>,
        non_torch: Option<Printed>,
        weights: Option<Printed>,
    },
    AvailableKv(Printed),
    KvCacheSize(u64),
    MaxConcurrency {
        model_len: u64,
        concurrency: f64,
    },
    GraphCapture {
        seconds: Option<f64>,
        memory: Printed,
    },
    EngineInit(f64),
    GpuBlocks(u64),
    KvTooSmall {
        max_model_len: u64,
        needed: Printed,
        available: Printed,
        estimated: Option<u64>,
    },
    NoAvailableMemory,
    StartupFree {
        free: Printed,
        total: Printed,
        util: f64,
        requested: Printed,
    },
}

impl Fact {
    pub(super) fn kind(&self) -> LineKind {
        match self {
            Fact::Weights(_) => LineKind::ModelWeights,
            Fact::ModelLoading { .. } => LineKind::ModelLoading,
            Fact::WeightsLoadTime(_) => LineKind::WeightsLoadTime,
            Fact::EncoderBudget { .. } => LineKind::EncoderBudget,
            Fact::OldTorchPeak(_) => LineKind::OldTorchPeak,
            Fact::OldNonTorch(_) => LineKind::OldNonTorch,
            Fact::OldRealProfiling => LineKind::OldRealProfiling,
            Fact::OldAvailableTotal { .. } => LineKind::OldAvailableTotal,
            Fact::OldAvailableRequested { .. } => LineKind::OldAvailableRequested,
            Fact::InitialFree { .. } => LineKind::InitialFree,
            Fact::FreeAfterProfiling { .. } => LineKind::FreeAfterProfiling,
            Fact::ProfilingResult { .. } => LineKind::ProfilingResult,
            Fact::AvailableKv(_) => LineKind::AvailableKv,
            Fact::KvCacheSize(_) => LineKind::KvCacheSize,
            Fact::MaxConcurrency { .. } => LineKind::MaxConcurrency,
            Fact::GraphCapture { .. } => LineKind::GraphCapture,
            Fact::EngineInit(_) => LineKind::EngineInit,
            Fact::GpuBlocks(_) => LineKind::GpuBlocks,
            Fact::KvTooSmall { .. } => LineKind::KvCacheTooSmallError,
            Fact::NoAvailableMemory => LineKind::NoAvailableMemoryError,
            Fact::StartupFree { .. } => LineKind::StartupFreeMemoryError,
        }
    }
}

/// Tries every known phrase on one line segment.
pub(super) fn classify(seg: &str) -> Outcome {
    type Parser = fn(&str, &str) -> Option<Fact>;
    // (phrase, parser(text after the phrase, whole segment)); the first phrase found wins.
    const TABLE: &[(&str, Parser)] = &[
        ("To serve at least one request with the model", parse_kv_too_small),
        ("No available memory for the cache blocks", |_, _| {
            Some(Fact::NoAvailableMemory)
        }),
        ("Free memory on device", parse_startup_free),
        ("Loading model weights took", |rest, _| {
            Some(Fact::Weights(split_size(rest)?.0))
        }),
        ("Model loading took", parse_model_loading),
        ("Loading weights took", |rest, _| {
            let (secs, rest) = split_f64(rest)?;
            rest.trim_start()
                .starts_with("s")
                .then_some(Fact::WeightsLoadTime(secs))
        }),
        (
            "Encoder cache will be initialized with a budget of",
            parse_encoder_budget,
        ),
        ("torch_peak after profiling is", |rest, _| {
            Some(Fact::OldTorchPeak(split_size(rest)?.0))
        }),
        ("non_torch_memory after profiling is", |rest, _| {
            Some(Fact::OldNonTorch(split_size(rest)?.0))
        }),
        ("results of real profiling", |_, _| Some(Fact::OldRealProfiling)),
        ("Available memory:", parse_old_available),
        ("Initial free memory:", parse_initial_free),
        ("Free memory after profiling:", |rest, _| {
            let (total, rest) = split_size(rest)?;
            let within_requested = after(rest, ",").and_then(split_size).map(|(p, _)| p);
            Some(Fact::FreeAfterProfiling {
                total,
                within_requested,
            })
        }),
        ("Total non KV cache memory:", parse_profiling_result),
        ("Available KV cache memory:", |rest, _| {
            Some(Fact::AvailableKv(split_size(rest)?.0))
        }),
        ("KV cache size:", |rest, _| {
            let (n, rest) = split_count(rest)?;
            rest.trim_start().starts_with("token").then_some(Fact::KvCacheSize(n))
        }),
        ("Maximum concurrency for", |rest, _| {
            let (model_len, rest) = split_count(rest)?;
            let (concurrency, _) = split_f64(after(rest, "per request:")?)?;
            Some(Fact::MaxConcurrency { model_len, concurrency })
        }),
        ("Graph capturing finished in", |rest, _| {
            let seconds = split_f64(rest).map(|(s, _)| s);
            let (memory, _) = split_size(after(rest, "took")?)?;
            Some(Fact::GraphCapture { seconds, memory })
        }),
        ("GPU blocks:", |rest, _| Some(Fact::GpuBlocks(split_count(rest)?.0))),
        ("NPU blocks:", |rest, _| Some(Fact::GpuBlocks(split_count(rest)?.0))),
        (
            "init engine (profile, create kv cache, warmup model) took",
            |rest, _| Some(Fact::EngineInit(split_f64(rest)?.0)),
        ),
    ];
    for (phrase, parser) in TABLE {
        if let Some(rest) = after(seg, phrase) {
            return match parser(rest, seg) {
                Some(fact) => Outcome::Fact(Box::new(fact)),
                None => Outcome::Malformed,
            };
        }
    }
    Outcome::Nothing
}

fn parse_kv_too_small(rest: &str, _seg: &str) -> Option<Fact> {
    let (max_model_len, rest) = split_count(after(rest, "max seq len (")?)?;
    let (needed, rest) = split_size(after(rest, "(")?)?;
    let (available, rest) = split_size(after(rest, "available KV cache memory (")?)?;
    let estimated = after(rest, "estimated maximum model length is")
        .and_then(split_count)
        .map(|(w, _)| w);
    Some(Fact::KvTooSmall {
        max_model_len,
        needed,
        available,
        estimated,
    })
}

fn parse_startup_free(rest: &str, _seg: &str) -> Option<Fact> {
    let (free_num, rest) = split_number(after(rest, "(")?)?;
    let (total_num, rest) = split_number(rest.trim_start().strip_prefix('/')?)?;
    let (unit, rest) = split_unit(rest);
    let free = Printed::parse(free_num, unit)?;
    let total = Printed::parse(total_num, unit)?;
    let (util, rest) = split_f64(after(rest, "utilization (")?)?;
    let (requested, _) = split_size(after(rest, ",")?)?;
    Some(Fact::StartupFree {
        free,
        total,
        util,
        requested,
    })
}

fn parse_model_loading(rest: &str, _seg: &str) -> Option<Fact> {
    let (weights, rest) = split_size(rest)?;
    let seconds = after(rest, "and").and_then(split_f64).map(|(s, _)| s);
    Some(Fact::ModelLoading { weights, seconds })
}

fn parse_encoder_budget(rest: &str, _seg: &str) -> Option<Fact> {
    let (tokens, rest) = split_count(rest)?;
    let (items, modality) = match after(rest, "profiled with").and_then(split_count) {
        Some((items, rest)) => {
            let word: String = rest
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            (Some(items), (!word.is_empty()).then_some(word))
        }
        None => (None, None),
    };
    Some(Fact::EncoderBudget {
        tokens,
        items,
        modality,
    })
}

fn parse_old_available(rest: &str, _seg: &str) -> Option<Fact> {
    let (available, rest) = split_size_or_bytes(rest)?;
    if let Some(r) = after(rest, "total memory:") {
        let (total, _) = split_size_or_bytes(r)?;
        Some(Fact::OldAvailableTotal { available, total })
    } else {
        let (requested, _) = split_size_or_bytes(after(rest, "requested memory:")?)?;
        Some(Fact::OldAvailableRequested { available, requested })
    }
}

fn parse_initial_free(rest: &str, _seg: &str) -> Option<Fact> {
    let (free, rest) = split_size(rest)?;
    let (util, requested) = match after(rest, "Requested memory:") {
        Some(r) => {
            let (util, r) = match split_number(r) {
                Some((num, r2)) if r2.trim_start().starts_with("(util)") => (parse_f64(num), r2),
                _ => (None, r),
            };
            let requested = split_size(after(r, ",").unwrap_or(r)).map(|(p, _)| p);
            (util, requested)
        }
        None => (None, None),
    };
    Some(Fact::InitialFree { free, util, requested })
}

fn parse_profiling_result(rest: &str, seg: &str) -> Option<Fact> {
    let (non_kv, rest) = split_size(rest)?;
    let field = |phrase: &str| after(rest, phrase).and_then(split_size).map(|(p, _)| p);
    Some(Fact::ProfilingResult {
        seconds: after(seg, "Memory profiling takes").and_then(split_f64).map(|(s, _)| s),
        non_kv,
        torch_peak: field("torch peak memory increase:"),
        non_torch: field("non-torch forward increase memory:"),
        weights: field("weights memory:"),
    })
}

pub(super) fn apply_fact(log: &mut ParsedLog, fact: Fact) {
    match fact {
        Fact::Weights(p) => log.weights = Some(p),
        Fact::ModelLoading { weights, seconds } => {
            log.weights = Some(weights);
            if seconds.is_some() {
                log.model_loading_seconds = seconds;
            }
        }
        Fact::WeightsLoadTime(s) => log.weights_load_seconds = Some(s),
        Fact::EncoderBudget {
            tokens,
            items,
            modality,
        } => {
            log.encoder_budget_tokens = Some(tokens);
            log.encoder_profile_items = items;
            log.encoder_profile_modality = modality;
        }
        Fact::OldTorchPeak(p) => log.old_torch_peak = Some(p),
        Fact::OldNonTorch(p) => {
            log.old_non_torch_all.push(p.clone());
            log.old_non_torch = Some(p);
        }
        Fact::OldRealProfiling => {}
        Fact::OldAvailableTotal { available, total } => {
            log.old_available = Some(available);
            log.total = Some(total);
        }
        Fact::OldAvailableRequested { available, requested } => {
            log.old_available_with_requested = Some(available);
            log.requested = Some(requested);
        }
        Fact::InitialFree { free, util, requested } => {
            log.initial_free = Some(free);
            if util.is_some() {
                log.gpu_memory_utilization = util;
            }
            if requested.is_some() {
                log.requested = requested;
            }
        }
        Fact::FreeAfterProfiling {
            total,
            within_requested,
        } => {
            log.free_after_profiling = Some(total);
            log.free_after_profiling_within_requested = within_requested;
        }
        Fact::ProfilingResult {
            seconds,
            non_kv,
            torch_peak,
            non_torch,
            weights,
        } => {
            log.profiling_seconds = seconds;
            log.non_kv = Some(non_kv);
            log.torch_peak_increase = torch_peak;
            log.non_torch_increase = non_torch;
            log.profiled_weights = weights;
        }
        Fact::AvailableKv(p) => log.available_kv = Some(p),
        Fact::KvCacheSize(n) => log.kv_cache_tokens = Some(n),
        Fact::MaxConcurrency { model_len, concurrency } => {
            log.max_concurrency_model_len = Some(model_len);
            log.max_concurrency = Some(concurrency);
        }
        Fact::GraphCapture { seconds, memory } => {
            log.graph_capture_seconds = seconds;
            log.graph_capture = Some(memory);
        }
        Fact::EngineInit(s) => log.engine_init_seconds = Some(s),
        Fact::GpuBlocks(n) => log.num_gpu_blocks = Some(n),
        Fact::KvTooSmall {
            max_model_len,
            needed,
            available,
            estimated,
        } => {
            log.error_max_model_len = Some(max_model_len);
            log.error_needed = Some(needed);
            log.error_available = Some(available);
            log.error_estimated_max_model_len = estimated;
        }
        Fact::NoAvailableMemory => log.error_no_available_memory = true,
        Fact::StartupFree {
            free,
            total,
            util,
            requested,
        } => {
            log.error_startup_free_memory = true;
            log.initial_free = Some(free);
            log.total = Some(total);
            log.gpu_memory_utilization = Some(util);
            log.requested = Some(requested);
        }
    }
}
