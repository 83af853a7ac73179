//! Parser for vLLM / vllm-ascend start-up logs.
//!
//! [`parse_vllm_log`] reads the text of a start-up log (or any fragment of one) and pulls out the
//! figures the memory planner needs to reconstruct the start-up budget: weights, the multimodal
//! encoder budget, the profiling results in both the old vllm-ascend (< v0.15, "Available memory:
//! …, total memory: …") and the new (`memory_profiling`, "Initial free memory …") formats, the KV
//! cache size and the "KV cache is needed" error. It does no I/O, never panics and takes `&str`.
//!
//! Phrases are searched for anywhere in a line, so log prefixes such as
//! `INFO 10-22 12:00:01 [gpu_worker.py:123] `, `(EngineCore_DP0 pid=123) ` or `[rank0]:` are
//! skipped without being parsed. A line whose phrase matches but whose numbers do not parse (or
//! overflow `u64` bytes) is ignored and listed in [`ParsedLog::malformed_lines`].
//!
//! Units: vLLM prints "GB" but divides by 2^30, so in every vLLM line "GB", "GiB" and "G" mean
//! 2^30 bytes, "MB"/"MiB"/"M" 2^20, "KB"/"KiB"/"K" 2^10, "TB"/"TiB"/"T" 2^40; a number with no
//! unit is a byte count. Conversions are exact ([`parse_size_to_bytes`]): the decimal text is
//! turned into `round(mantissa × unit / 10^decimals)` with integer arithmetic, and every printed
//! figure keeps its text and precision ([`Printed`]) so that callers can check consistency
//! windows ([`Printed::interval`]).
//!
//! The parts: `numbers` reads printed numbers and sizes exactly, `figures` the memory and
//! profiling lines, `header` the command line and notes a log starts with; this module reads the
//! log line by line and hands each line to them.

mod figures;
mod header;
mod numbers;

pub use header::CommandLine;
pub use numbers::{parse_size_to_bytes, Printed};

use figures::{apply_fact, classify, Outcome};
use header::push_header;
use serde::Serialize;

/// Which start-up profiling code printed the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProfilingFormat {
    /// vllm-ascend < v0.15: "Available memory: A, total memory: T", "torch_peak after profiling",
    /// "non_torch_memory after profiling"; `available = total × util − peak`.
    Old,
    /// Upstream `memory_profiling` (vLLM, vllm-ascend ≥ v0.15): "Initial free memory …",
    /// "Free memory after profiling …", "Total non KV cache memory …".
    New,
}

/// What a recognised line said.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LineKind {
    /// A header: a line containing `vllm serve `, or a line starting with `#` that matches no
    /// other phrase (the command line and free-text notes).
    Header,
    /// "Loading weights took X seconds".
    WeightsLoadTime,
    /// "Loading model weights took X GB" (vllm-ascend).
    ModelWeights,
    /// "Model loading took X GiB [memory] and Y seconds" (vLLM).
    ModelLoading,
    /// "Encoder cache will be initialized with a budget of N tokens, and profiled with K image
    /// items of the maximum feature size."
    EncoderBudget,
    /// Old vllm-ascend: "torch_peak after profiling is X G".
    OldTorchPeak,
    /// Old vllm-ascend: "non_torch_memory after profiling is X G".
    OldNonTorch,
    /// Old vllm-ascend: "results of real profiling" (the following figures are the real ones).
    OldRealProfiling,
    /// Old vllm-ascend: "Available memory: A, total memory: T".
    OldAvailableTotal,
    /// Old vllm-ascend: "Available memory: A GiB, requested memory: R GiB".
    OldAvailableRequested,
    /// New: "Initial free memory: X GiB; Requested memory: U (util), R GiB".
    InitialFree,
    /// New: "Free memory after profiling: X GiB (total), Y GiB (within requested)".
    FreeAfterProfiling,
    /// New: "[Memory profiling takes T seconds.] Total non KV cache memory: X GiB; torch peak
    /// memory increase: A GiB; non-torch forward increase memory: B GiB; weights memory: C GiB."
    ProfilingResult,
    /// "Available KV cache memory: X GiB".
    AvailableKv,
    /// "GPU KV cache size: N tokens".
    KvCacheSize,
    /// "Maximum concurrency for M tokens per request: X.XXx".
    MaxConcurrency,
    /// "Graph capturing finished in T secs, took X GiB".
    GraphCapture,
    /// "# GPU blocks: N" / "# NPU blocks: N" (V0-style engines).
    GpuBlocks,
    /// "init engine (profile, create kv cache, warmup model) took T seconds".
    EngineInit,
    /// "To serve at least one request with the models's max seq len (L), (X GiB KV cache is
    /// needed, which is larger than the available KV cache memory (Y GiB). [Based on the
    /// available memory, the estimated maximum model length is W.]"
    KvCacheTooSmallError,
    /// "No available memory for the cache blocks."
    NoAvailableMemoryError,
    /// "Free memory on device [dev] (F/T GiB) on startup is less than desired GPU memory
    /// utilization (U, R GiB)."
    StartupFreeMemoryError,
}

/// One line that matched a known phrase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RecognisedLine {
    /// 1-based line number (lines are separated by `\n`).
    pub line: usize,
    /// What the line said.
    pub kind: LineKind,
    /// The line text without its line ending (for a line made of several `\r`-separated
    /// segments, the segment that matched).
    pub text: String,
}

/// Everything recognised in a start-up log. Memory figures are [`Printed`] values (exact bytes
/// plus the printed text); when a figure is printed more than once (several ranks, several
/// profiling passes) the last one wins.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ParsedLog {
    /// The command line from the header, if any.
    pub command: Option<CommandLine>,
    /// A device hint from the header, e.g. `"Ascend 910B x2"`.
    pub device_hint: Option<String>,
    /// Free-text notes that follow the command in the header (comma- or parenthesis-separated).
    pub header_notes: Vec<String>,

    /// Weights: "Loading model weights took X GB" or "Model loading took X GiB …".
    pub weights: Option<Printed>,
    /// "Loading weights took X seconds".
    pub weights_load_seconds: Option<f64>,
    /// The seconds in "Model loading took X GiB and Y seconds".
    pub model_loading_seconds: Option<f64>,

    /// Encoder budget in tokens ("initialized with a budget of N tokens").
    pub encoder_budget_tokens: Option<u64>,
    /// Number of dummy items the encoder was profiled with.
    pub encoder_profile_items: Option<u64>,
    /// Modality of the profiling items (`"image"`, `"video"`).
    pub encoder_profile_modality: Option<String>,

    /// Old format: "torch_peak after profiling is X G".
    pub old_torch_peak: Option<Printed>,
    /// Old format: the last "non_torch_memory after profiling is X G".
    pub old_non_torch: Option<Printed>,
    /// Old format: every "non_torch_memory after profiling" figure in order.
    pub old_non_torch_all: Vec<Printed>,
    /// Old format: A in "Available memory: A, total memory: T".
    pub old_available: Option<Printed>,
    /// Old format: A in "Available memory: A GiB, requested memory: R GiB".
    pub old_available_with_requested: Option<Printed>,

    /// Total device memory: T in "Available memory: A, total memory: T" or in the start-up
    /// free-memory error.
    pub total: Option<Printed>,
    /// Requested memory (`total × util`): "requested memory: R GiB" (old),
    /// "Requested memory: U (util), R GiB" (new) or the start-up free-memory error.
    pub requested: Option<Printed>,
    /// `--gpu-memory-utilization` as printed in "Requested memory: U (util)" or the start-up error.
    pub gpu_memory_utilization: Option<f64>,

    /// New format: "Initial free memory: X GiB" (also the F in the start-up free-memory error).
    pub initial_free: Option<Printed>,
    /// New format: X in "Free memory after profiling: X GiB (total), …".
    pub free_after_profiling: Option<Printed>,
    /// New format: Y in "…, Y GiB (within requested)".
    pub free_after_profiling_within_requested: Option<Printed>,
    /// New format: T in "Memory profiling takes T seconds".
    pub profiling_seconds: Option<f64>,
    /// New format: "Total non KV cache memory: X GiB".
    pub non_kv: Option<Printed>,
    /// New format: "torch peak memory increase: A GiB".
    pub torch_peak_increase: Option<Printed>,
    /// New format: "non-torch forward increase memory: B GiB".
    pub non_torch_increase: Option<Printed>,
    /// New format: "weights memory: C GiB" (inside the profiling result line).
    pub profiled_weights: Option<Printed>,

    /// "Available KV cache memory: X GiB".
    pub available_kv: Option<Printed>,
    /// "GPU KV cache size: N tokens".
    pub kv_cache_tokens: Option<u64>,
    /// M in "Maximum concurrency for M tokens per request: X.XXx".
    pub max_concurrency_model_len: Option<u64>,
    /// X in "Maximum concurrency for M tokens per request: X.XXx".
    pub max_concurrency: Option<f64>,
    /// X in "Graph capturing finished in T secs, took X GiB".
    pub graph_capture: Option<Printed>,
    /// T in "Graph capturing finished in T secs".
    pub graph_capture_seconds: Option<f64>,
    /// N in "# GPU blocks: N" / "# NPU blocks: N" (V0-style engines).
    pub num_gpu_blocks: Option<u64>,
    /// "init engine (profile, create kv cache, warmup model) took T seconds".
    pub engine_init_seconds: Option<f64>,

    /// The error's "max seq len (L)".
    pub error_max_model_len: Option<u64>,
    /// The error's "(X GiB KV cache is needed".
    pub error_needed: Option<Printed>,
    /// The error's "available KV cache memory (Y GiB)".
    pub error_available: Option<Printed>,
    /// The error's "estimated maximum model length is W" (absent when vLLM omits the sentence).
    pub error_estimated_max_model_len: Option<u64>,
    /// "No available memory for the cache blocks" was seen.
    pub error_no_available_memory: bool,
    /// "Free memory on device … on startup is less than desired GPU memory utilization" was seen.
    pub error_startup_free_memory: bool,

    /// Every recognised line, in order (a line holding several `\r`-separated segments can
    /// appear more than once).
    pub recognised: Vec<RecognisedLine>,
    /// 1-based numbers of lines whose phrase matched but whose values did not parse.
    pub malformed_lines: Vec<usize>,
    /// Number of non-blank lines that matched nothing.
    pub ignored_lines: usize,
}

impl ParsedLog {
    /// Which profiling code printed the log: [`ProfilingFormat::New`] if any `memory_profiling`
    /// line (initial free / free after profiling / total non KV) was recognised, else
    /// [`ProfilingFormat::Old`] if any old vllm-ascend line was, else `None`.
    pub fn profiling_format(&self) -> Option<ProfilingFormat> {
        let has = |f: fn(LineKind) -> bool| self.recognised.iter().any(|r| f(r.kind));
        if has(|k| {
            matches!(
                k,
                LineKind::InitialFree | LineKind::FreeAfterProfiling | LineKind::ProfilingResult
            )
        }) {
            Some(ProfilingFormat::New)
        } else if has(|k| {
            matches!(
                k,
                LineKind::OldAvailableTotal
                    | LineKind::OldAvailableRequested
                    | LineKind::OldTorchPeak
                    | LineKind::OldNonTorch
                    | LineKind::OldRealProfiling
            )
        }) {
            Some(ProfilingFormat::Old)
        } else {
            None
        }
    }

    /// The recognised lines of one kind.
    pub fn lines_of(&self, kind: LineKind) -> impl Iterator<Item = &RecognisedLine> + '_ {
        self.recognised.iter().filter(move |r| r.kind == kind)
    }
}

/// Parses a vLLM / vllm-ascend start-up log. Never panics; unknown lines are skipped.
pub fn parse_vllm_log(text: &str) -> ParsedLog {
    let mut log = ParsedLog::default();
    for (idx, raw) in text.split('\n').enumerate() {
        let line_no = idx + 1;
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        if line.contains("vllm serve ") || line.contains("kvlens serve ") {
            push_header(&mut log, line_no, line);
            continue;
        }
        let mut matched = false;
        for seg in line.split('\r') {
            match classify(seg) {
                Outcome::Nothing => {}
                Outcome::Malformed => {
                    matched = true;
                    if log.malformed_lines.last() != Some(&line_no) {
                        log.malformed_lines.push(line_no);
                    }
                }
                Outcome::Fact(fact) => {
                    matched = true;
                    let kind = fact.kind();
                    apply_fact(&mut log, *fact);
                    log.recognised.push(RecognisedLine {
                        line: line_no,
                        kind,
                        text: seg.to_string(),
                    });
                }
            }
        }
        if !matched && line.trim_start().starts_with('#') {
            push_header(&mut log, line_no, line);
            continue;
        }
        if !matched && !line.trim().is_empty() {
            log.ignored_lines += 1;
        }
    }
    log
}
