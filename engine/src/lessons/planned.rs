//! The lessons' full-size steps: each step's figures computed by the planner from its inputs (a
//! `/planner` query string), at the sizes of the incidents in ../shared/docs/vllm-memory.md
//! (Qwen3-VL-8B/32B on Ascend 910B, TP 2).

use super::{Figure, LessonError, Step};
use crate::memory::log_budget::HeaderSettings;
use crate::memory::plan_inputs::{bundled_model, PlanInputs};
use crate::memory::planner::{plan, thousands, Plan, Source};

/// A step as written: what to look at, and the planner inputs that produce its figures.
#[derive(Debug)]
pub(super) struct StepSpec {
    pub say: &'static str,
    pub query: &'static str,
    pub figures: &'static [Fig],
}

/// Which planner figure a step shows.
#[derive(Debug, Clone, Copy)]
pub(super) enum Fig {
    Weights,
    ActivationPeak,
    NonTorch,
    NonKv,
    Total,
    Requested,
    AvailableKv,
    KvTokens,
    NeededKv,
    Fits,
    EstimatedMaxLen,
    MaxTokensPerImage,
    EncoderBudget,
    EncoderItems,
    EncoderCache,
    BlockSize,
    KvPerToken,
    StatePerRequest,
    Concurrency,
}

fn gib(bytes: f64) -> String {
    format!("{:.2} GiB", bytes / (1u64 << 30) as f64)
}

impl Fig {
    fn of(self, p: &Plan) -> Figure {
        let planner = |what: &str| format!("the planner: {what}");
        let kind = |s: Source| match s {
            Source::Estimated => "estimated from the config",
            Source::Given => "given (measured on the real deployment)",
            Source::Derived => "derived by vLLM's formulas",
            Source::FromLog => "read from a vLLM log",
        };
        let (name, value, source) = match self {
            Fig::Weights => (
                "weights per rank",
                gib(p.weights_bytes as f64),
                planner(kind(p.weights_source)),
            ),
            Fig::ActivationPeak => (
                "activation peak (torch peak increase)",
                gib(p.activation_peak_bytes as f64),
                planner(kind(p.activation_peak_source)),
            ),
            Fig::NonTorch => (
                "non-torch memory",
                gib(p.non_torch_bytes as f64),
                planner(kind(p.non_torch_source)),
            ),
            Fig::NonKv => (
                "total non-KV memory",
                gib(p.non_kv_bytes as f64),
                planner("weights + activation peak + non-torch"),
            ),
            Fig::Total => ("device memory", gib(p.total_bytes as f64), planner("the device preset")),
            Fig::Requested => (
                "requested (total × --gpu-memory-utilization)",
                gib(p.requested_bytes as f64),
                planner(&format!("× {}", p.gpu_memory_utilization)),
            ),
            Fig::AvailableKv => (
                "available KV cache memory",
                gib(p.available_kv_bytes as f64),
                planner(kind(p.available_kv_source)),
            ),
            Fig::KvTokens => (
                "GPU KV cache size",
                format!("{} tokens", thousands(p.kv_cache_tokens)),
                planner("blocks × block size"),
            ),
            Fig::NeededKv => (
                "KV one request of --max-model-len needs",
                gib(p.needed_kv_bytes as f64),
                planner(&format!("{} tokens", thousands(p.max_model_len as u64))),
            ),
            Fig::Fits => (
                "one request of --max-model-len fits",
                if p.fits { "yes" } else { "no" }.into(),
                planner("needed ≤ available"),
            ),
            Fig::EstimatedMaxLen => (
                "estimated maximum model length",
                p.estimated_max_model_len
                    .map_or_else(|| "—".into(), |n| thousands(n as u64)),
                planner("vLLM's binary search over what fits"),
            ),
            Fig::MaxTokensPerImage => (
                "tokens of the largest image",
                thousands(p.max_tokens_per_image as u64),
                planner("the processor's max_pixels"),
            ),
            Fig::EncoderBudget => (
                "encoder cache budget",
                format!("{} tokens", thousands(p.encoder_budget_tokens as u64)),
                planner("max(--max-num-batched-tokens, largest item)"),
            ),
            Fig::EncoderItems => (
                "images in the profile run",
                p.encoder_profile_items.to_string(),
                planner("budget ÷ largest item"),
            ),
            Fig::EncoderCache => (
                "encoder cache when full",
                gib(p.encoder_cache_bytes as f64),
                planner("budget × output width × dtype"),
            ),
            Fig::BlockSize => (
                "KV block size",
                format!("{} tokens", p.block_size),
                planner(match p.hybrid {
                    Some(_) => "raised until one block's page holds a state",
                    None => "--block-size",
                }),
            ),
            Fig::KvPerToken => (
                "KV per token",
                format!("{} B", thousands(p.kv_bytes_per_token)),
                planner("full-attention layers × 2 × KV heads × head width × dtype"),
            ),
            Fig::StatePerRequest => {
                let state = p.hybrid.as_ref().map_or(0, |h| h.state_layers as u64 * h.state_bytes());
                (
                    "state per request",
                    format!("{:.1} MiB", state as f64 / (1u64 << 20) as f64),
                    planner("Gated DeltaNet layers × (conv window + recurrent state)"),
                )
            }
            Fig::Concurrency => (
                "requests of --max-model-len at once",
                format!("{:.2}x", p.max_concurrency),
                planner("blocks ÷ blocks per request"),
            ),
        };
        Figure {
            name: name.into(),
            value,
            source,
            raw: None,
            area: String::new(),
        }
    }
}

/// Runs the full-size steps: each step's figures computed from its inputs now.
pub(super) fn run(steps: &[StepSpec]) -> Result<Vec<Step>, LessonError> {
    steps
        .iter()
        .map(|s| {
            let (inputs, errors) = PlanInputs::from_query(s.query);
            if let Some(e) = errors.into_iter().next() {
                return Err(e.into());
            }
            let p = plan(&inputs.request(&HeaderSettings::default(), bundled_model)?)?;
            Ok(Step {
                say: s.say.into(),
                query: Some(s.query.into()),
                figures: s.figures.iter().map(|f| f.of(&p)).collect(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::lesson;
    use super::*;

    fn value(steps: &[Step], step: usize, name: &str) -> String {
        steps[step]
            .figures
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("{name} in step {step}: {:?}", steps[step]))
            .value
            .clone()
    }

    #[test]
    fn the_seeds_figures_exactly() {
        let s = lesson("kv-cache-too-small").unwrap().run_planned().unwrap();
        assert_eq!(value(&s, 0, "KV one request of --max-model-len needs"), "32.00 GiB");
        assert!(s[0].say.contains("32 GiB") && s[0].say.contains("20.06 GiB"));
        assert_eq!(value(&s, 0, "available KV cache memory"), "20.06 GiB");
        // Step 2 starts with the length step 1 computed.
        let estimated = value(&s, 0, "estimated maximum model length").replace(',', "");
        assert!(
            s[1].query
                .as_deref()
                .unwrap()
                .ends_with(&format!("max_model_len={estimated}")),
            "{:?}",
            s[1].query
        );
        assert_eq!(value(&s, 0, "one request of --max-model-len fits"), "no");
        assert_eq!(value(&s, 0, "estimated maximum model length"), "164,224");
        assert_eq!(value(&s, 1, "one request of --max-model-len fits"), "yes");

        let s = lesson("startup-budget").unwrap().run_planned().unwrap();
        assert_eq!(value(&s, 0, "total non-KV memory"), "13.61 GiB");
        assert_eq!(
            value(&s, 0, "requested (total × --gpu-memory-utilization)"),
            "57.91 GiB"
        );
        assert_eq!(value(&s, 0, "available KV cache memory"), "44.30 GiB");
        assert_eq!(value(&s, 0, "GPU KV cache size"), "645,120 tokens");
        // The flag moves only the KV line.
        assert_eq!(value(&s, 1, "total non-KV memory"), "13.61 GiB");
        assert_ne!(value(&s, 1, "available KV cache memory"), "44.30 GiB");

        let s = lesson("encoder-budget").unwrap().run_planned().unwrap();
        assert_eq!(value(&s, 0, "tokens of the largest image"), "16,384");
        assert!(s[0].say.contains("16,384 tokens") && s[0].say.contains("holds: 2"));
        assert_eq!(value(&s, 1, "encoder cache budget"), "16,384 tokens");
        assert_eq!(value(&s, 0, "encoder cache budget"), "32,768 tokens");
        assert_eq!(value(&s, 0, "images in the profile run"), "2");
        assert_eq!(value(&s, 1, "images in the profile run"), "1");
        assert_eq!(value(&s, 2, "encoder cache budget"), "0 tokens");
        // Fewer profiled images: a smaller activation peak, more KV cache.
        let gib = |v: String| v.trim_end_matches(" GiB").parse::<f64>().unwrap();
        for (more, fewer) in [(0, 1), (1, 2)] {
            assert!(
                gib(value(&s, fewer, "activation peak (torch peak increase)"))
                    < gib(value(&s, more, "activation peak (torch peak increase)"))
            );
            assert!(
                gib(value(&s, fewer, "available KV cache memory")) > gib(value(&s, more, "available KV cache memory"))
            );
        }
        assert_eq!(value(&s, 2, "images in the profile run"), "0");
    }

    #[test]
    fn the_hybrid_lesson_quotes_its_figures() {
        let s = lesson("hybrid-state").unwrap().run_planned().unwrap();
        assert_eq!(value(&s, 0, "KV per token"), "114,688 B");
        assert_eq!(value(&s, 0, "KV one request of --max-model-len needs"), "3.50 GiB");
        assert_eq!(value(&s, 1, "KV per token"), "12,288 B");
        assert_eq!(value(&s, 1, "state per request"), "18.6 MiB");
        assert_eq!(value(&s, 1, "KV block size"), "544 tokens");
        assert_eq!(value(&s, 1, "KV one request of --max-model-len needs"), "0.40 GiB");
        for (step, quotes) in [
            (0, &["114,688 bytes", "3.5 GiB"][..]),
            (1, &["12,288 bytes", "18.6 MiB", "544 tokens", "0.40 GiB"][..]),
        ] {
            for q in quotes {
                assert!(s[step].say.contains(q), "step {step} quotes {q}: {}", s[step].say);
            }
        }
        // Short requests: the states, not the tokens, decide how many fit.
        let short: f64 = value(&s, 2, "requests of --max-model-len at once")
            .trim_end_matches('x')
            .parse()
            .unwrap();
        let long: f64 = value(&s, 1, "requests of --max-model-len at once")
            .trim_end_matches('x')
            .parse()
            .unwrap();
        assert!(
            short < long * 10.0,
            "{short} vs {long}: 16 times shorter requests, far fewer than 16 times as many"
        );
        assert!(s[2].say.contains(&value(&s, 2, "requests of --max-model-len at once")));
    }

    #[test]
    fn an_unknown_lesson_names_the_lessons() {
        let e = lesson("nope").unwrap_err().to_string();
        assert!(e.contains("startup-budget"), "{e}");
    }
}
