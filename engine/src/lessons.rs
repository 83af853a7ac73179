//! Lessons in memory profiling: the incidents that cost vLLM users days, replayed step by step,
//! each step's figures computed when it runs (the planner here), never recorded. A lesson is data
//! (each step's sentence and its planner inputs as a `/planner` query string) plus the engine calls
//! that produce its figures, so `kvlens lesson` and the playground show the same thing. The
//! sentences quote the seeds' numbers; the tests check each quote against the computed figure.
//!
//! The full-size steps reproduce the figures in ../shared/docs/vllm-memory.md (Qwen3-VL-8B/32B on
//! Ascend 910B, TP 2).

use serde::Serialize;

use crate::memory::log_budget::HeaderSettings;
use crate::memory::plan_inputs::{bundled_model, PlanInputs};
use crate::memory::planner::{plan, thousands, Plan, PlanError, Source};

/// One lesson: its URL name, its title and the incident it replays.
#[derive(Debug)]
pub struct Lesson {
    /// The name in `/lessons/NAME` and `kvlens lesson NAME`.
    pub name: &'static str,
    /// Its title.
    pub title: &'static str,
    /// The incident, in one sentence.
    pub incident: &'static str,
    steps: &'static [StepSpec],
}

/// A step as written: what to look at, and the planner inputs that produce its figures.
#[derive(Debug)]
struct StepSpec {
    say: &'static str,
    query: &'static str,
    figures: &'static [Fig],
}

/// Which planner figure a step shows.
#[derive(Debug, Clone, Copy)]
enum Fig {
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
}

/// One figure of a step, with where it comes from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Figure {
    /// What it is.
    pub name: &'static str,
    /// Its value, formatted.
    pub value: String,
    /// Where the number comes from (the planner, with the figure's own source).
    pub source: String,
}

/// A step as run: its sentence, its inputs and its figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    /// What to look at and why.
    pub say: &'static str,
    /// The planner inputs, as `/planner?QUERY` takes them.
    pub query: &'static str,
    /// The figures, computed now.
    pub figures: Vec<Figure>,
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
        };
        Figure { name, value, source }
    }
}

/// Every lesson, in teaching order.
pub const LESSONS: &[Lesson] = &[
    Lesson {
        name: "kv-cache-too-small",
        title: "\"KV cache needed is larger than the available KV cache memory\"",
        incident: "Qwen3-VL-32B on two Ascend 910B with --max-model-len 262144 refuses to start: one request of that length needs more KV than the cards have left.",
        steps: &[
            StepSpec {
                say: "vLLM starts only if one request of --max-model-len fits in the KV cache. At 262,144 tokens Qwen3-VL-32B needs 32 GiB of keys and values per rank; after weights and activations each card has 20.06 GiB left. So vLLM refuses, and names the longest length that fits.",
                query: "model=Qwen3-VL-32B-Instruct&device=ascend-910b-64g&tp=2&kv_cache_memory_gib=20.06&max_model_len=262144",
                figures: &[Fig::NeededKv, Fig::AvailableKv, Fig::Fits, Fig::EstimatedMaxLen],
            },
            StepSpec {
                say: "Start it with the length vLLM named: the same 20.06 GiB now holds one full-length request. The memory did not change; only what one request may ask for did.",
                query: "model=Qwen3-VL-32B-Instruct&device=ascend-910b-64g&tp=2&kv_cache_memory_gib=20.06&max_model_len=164224",
                figures: &[Fig::NeededKv, Fig::AvailableKv, Fig::Fits],
            },
        ],
    },
    Lesson {
        name: "startup-budget",
        title: "Where the start-up budget goes",
        incident: "Qwen3-VL-8B on two Ascend 910B at --gpu-memory-utilization 0.95: which memory is the KV cache's, and what the flag moves.",
        steps: &[
            StepSpec {
                say: "At start-up vLLM loads the weights, runs one profile step at the largest batch, and measures: weights, the torch peak increase of that step, and memory outside torch. Their sum is the non-KV memory; the KV cache gets what is left of total × --gpu-memory-utilization.",
                query: "model=Qwen3-VL-8B-Instruct&device=ascend-910b-64g&tp=2&gpu_memory_utilization=0.95&weights_gib=9.19&activation_peak_gib=3.86&non_torch_gib=0.56",
                figures: &[
                    Fig::Weights,
                    Fig::ActivationPeak,
                    Fig::NonTorch,
                    Fig::NonKv,
                    Fig::Total,
                    Fig::Requested,
                    Fig::AvailableKv,
                    Fig::KvTokens,
                ],
            },
            StepSpec {
                say: "Lower --gpu-memory-utilization to 0.90: the non-KV lines stay where they were, and the whole difference comes out of the KV cache. The flag sizes the KV cache, nothing else.",
                query: "model=Qwen3-VL-8B-Instruct&device=ascend-910b-64g&tp=2&gpu_memory_utilization=0.9&weights_gib=9.19&activation_peak_gib=3.86&non_torch_gib=0.56",
                figures: &[Fig::NonKv, Fig::Requested, Fig::AvailableKv, Fig::KvTokens],
            },
        ],
    },
    Lesson {
        name: "encoder-budget",
        title: "The encoder budget and the profile run",
        incident: "Qwen3-VL-8B logs \"Encoder cache will be initialized with a budget of 32768 tokens, and profiled with 2 image items of the maximum feature size\": where those numbers come from.",
        steps: &[
            StepSpec {
                say: "The largest image the processor accepts (4096×4096 for Qwen3-VL) becomes 16,384 tokens. The encoder cache holds at least one such image and at least one step's tokens: max(32,768, 16,384) = 32,768. The profile run encodes as many of the largest images as that budget holds: 2. Their activations are part of the torch peak the KV cache is sized after.",
                query: "model=Qwen3-VL-8B-Instruct&device=h100-80g&max_num_batched_tokens=32768",
                figures: &[Fig::MaxTokensPerImage, Fig::EncoderBudget, Fig::EncoderItems, Fig::EncoderCache],
            },
            StepSpec {
                say: "With --max-num-batched-tokens 8192 the budget falls to one largest image (16,384 tokens) and the profile run encodes one: a smaller activation peak, more KV cache, and images that must wait for the encoder more often.",
                query: "model=Qwen3-VL-8B-Instruct&device=h100-80g&max_num_batched_tokens=8192",
                figures: &[Fig::MaxTokensPerImage, Fig::EncoderBudget, Fig::EncoderItems, Fig::EncoderCache],
            },
        ],
    },
];

/// Why a lesson could not run.
#[derive(Debug, thiserror::Error)]
pub enum LessonError {
    /// No lesson by that name.
    #[error("no lesson {0:?}; the lessons are: {1}")]
    Unknown(String, String),
    /// A step's planner inputs were refused.
    #[error("{0}")]
    Plan(#[from] PlanError),
}

/// The lesson called `name`.
pub fn lesson(name: &str) -> Result<&'static Lesson, LessonError> {
    LESSONS.iter().find(|l| l.name == name).ok_or_else(|| {
        LessonError::Unknown(
            name.into(),
            LESSONS.iter().map(|l| l.name).collect::<Vec<_>>().join(", "),
        )
    })
}

impl Lesson {
    /// Runs every step: each step's figures computed from its inputs now.
    pub fn run(&self) -> Result<Vec<Step>, LessonError> {
        self.steps
            .iter()
            .map(|s| {
                let (inputs, errors) = PlanInputs::from_query(s.query);
                if let Some(e) = errors.into_iter().next() {
                    return Err(e.into());
                }
                let p = plan(&inputs.request(&HeaderSettings::default(), bundled_model)?)?;
                Ok(Step {
                    say: s.say,
                    query: s.query,
                    figures: s.figures.iter().map(|f| f.of(&p)).collect(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
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
        let s = lesson("kv-cache-too-small").unwrap().run().unwrap();
        assert_eq!(value(&s, 0, "KV one request of --max-model-len needs"), "32.00 GiB");
        assert!(s[0].say.contains("32 GiB") && s[0].say.contains("20.06 GiB"));
        assert_eq!(value(&s, 0, "available KV cache memory"), "20.06 GiB");
        // Step 2 starts with the length step 1 computed.
        let estimated = value(&s, 0, "estimated maximum model length").replace(',', "");
        assert!(
            s[1].query.ends_with(&format!("max_model_len={estimated}")),
            "{}",
            s[1].query
        );
        assert_eq!(value(&s, 0, "one request of --max-model-len fits"), "no");
        assert_eq!(value(&s, 0, "estimated maximum model length"), "164,224");
        assert_eq!(value(&s, 1, "one request of --max-model-len fits"), "yes");

        let s = lesson("startup-budget").unwrap().run().unwrap();
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

        let s = lesson("encoder-budget").unwrap().run().unwrap();
        assert_eq!(value(&s, 0, "tokens of the largest image"), "16,384");
        assert!(s[0].say.contains("16,384 tokens") && s[0].say.contains("holds: 2"));
        assert_eq!(value(&s, 1, "encoder cache budget"), "16,384 tokens");
        assert_eq!(value(&s, 0, "encoder cache budget"), "32,768 tokens");
        assert_eq!(value(&s, 0, "images in the profile run"), "2");
        assert_eq!(value(&s, 1, "images in the profile run"), "1");
    }

    #[test]
    fn an_unknown_lesson_names_the_lessons() {
        let e = lesson("nope").unwrap_err().to_string();
        assert!(e.contains("startup-budget"), "{e}");
    }
}
