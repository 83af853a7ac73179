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

use serde::Serialize;

/// A memory figure exactly as the log printed it, with its exact byte value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Printed {
    /// The magnitude in bytes: `round(mantissa × unit_bytes / 10^decimals)`.
    pub bytes: u64,
    /// Whether the printed number had a minus sign (vLLM can print negative profiling increases
    /// or a negative available KV memory); `bytes` is then the magnitude.
    pub negative: bool,
    /// The number as printed, e.g. `"44.30"` or `"21540531712"` (thousands separators kept).
    pub text: String,
    /// How many decimals were printed (`2` for `"44.30"`).
    pub decimals: u32,
    /// Bytes per printed unit: 2^30 for GB/GiB/G, 2^20 for MB/MiB/M, 1 for a bare number.
    pub unit_bytes: u64,
}

impl Printed {
    /// Parses a printed number and its unit (see [`parse_size_to_bytes`] for the accepted
    /// forms); a leading `-` is accepted and recorded in [`Printed::negative`].
    pub fn parse(number: &str, unit: &str) -> Option<Printed> {
        let text = number.trim();
        let dec = parse_decimal(text)?;
        let unit_bytes = unit_bytes(unit)?;
        let bytes = scale_round(dec.mantissa, unit_bytes, dec.decimals)?;
        Some(Printed {
            bytes,
            negative: dec.negative,
            text: text.to_string(),
            decimals: dec.decimals,
            unit_bytes,
        })
    }

    /// The value in bytes with its sign.
    pub fn signed_bytes(&self) -> i128 {
        if self.negative {
            -i128::from(self.bytes)
        } else {
            i128::from(self.bytes)
        }
    }

    /// The printed value in units of 2^30 bytes, for display only (not exact).
    pub fn gib(&self) -> f64 {
        self.signed_bytes() as f64 / (1u64 << 30) as f64
    }

    /// The closed range `(lo, hi)` of byte counts (magnitudes) whose value lies within half a unit
    /// of the last printed digit of this figure, i.e. every byte count that a printer rounding to
    /// `decimals` places could have shown as [`Printed::text`]. Both ends are included because
    /// which way an exact tie rounds depends on the printer. For a bare byte count the range is
    /// `(bytes, bytes)`. Ends are clamped to `0..=u64::MAX`; if the text no longer parses (the
    /// fields were edited by hand) the range is `(bytes, bytes)`.
    pub fn interval(&self) -> (u64, u64) {
        self.try_interval().unwrap_or((self.bytes, self.bytes))
    }

    /// Whether `bytes` (a magnitude) is inside [`Printed::interval`].
    pub fn contains(&self, bytes: u64) -> bool {
        let (lo, hi) = self.interval();
        lo <= bytes && bytes <= hi
    }

    fn try_interval(&self) -> Option<(u64, u64)> {
        let dec = parse_decimal(&self.text)?;
        let unit = u128::from(self.unit_bytes);
        let den = 10u128.checked_pow(dec.decimals)?.checked_mul(2)?;
        let twice = dec.mantissa.checked_mul(2)?;
        let lo_num = twice.saturating_sub(1).checked_mul(unit)?;
        let hi_num = twice.checked_add(1)?.checked_mul(unit)?;
        let lo = lo_num / den + u128::from(lo_num % den != 0);
        let hi = hi_num / den;
        let clamp = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
        Some((clamp(lo), clamp(hi)))
    }
}

/// Converts a printed size to bytes exactly.
///
/// `number` is a non-negative decimal: ASCII digits, optionally with thousands separators in
/// the integer part (`"645,120"`; groups of exactly three digits after the first), optionally
/// followed by `.` and at least one digit. `unit` is one of (case-insensitive) `""`, `B`, `byte`,
/// `bytes` (1), `K`/`KB`/`KiB` (2^10), `M`/`MB`/`MiB` (2^20), `G`/`GB`/`GiB` (2^30),
/// `T`/`TB`/`TiB` (2^40): vLLM's "GB" is 2^30 bytes. The result is
/// `round(mantissa × unit / 10^decimals)` (halves round up) computed in `u128`; `None` for a
/// malformed number, an unknown unit, a negative number or a result that does not fit `u64`.
pub fn parse_size_to_bytes(number: &str, unit: &str) -> Option<u64> {
    let dec = parse_decimal(number.trim())?;
    if dec.negative {
        return None;
    }
    scale_round(dec.mantissa, unit_bytes(unit)?, dec.decimals)
}

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

/// The `vllm serve …` command recorded in a log header.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CommandLine {
    /// The command text from `vllm serve` (or `…api_server`) up to where the command ends.
    pub raw: String,
    /// The model: the positional argument after `serve`, else the value of `--model`.
    pub model: Option<String>,
    /// The flags in order, without leading dashes and as spelled (`tensor-parallel-size`,
    /// `max_model_len`, `tp`), with their value (`None` for a boolean flag).
    pub flags: Vec<(String, Option<String>)>,
    /// Positional arguments other than the model.
    pub positional: Vec<String>,
}

impl CommandLine {
    /// The value of the last occurrence of flag `name` (with or without leading dashes;
    /// `_` and `-` are interchangeable; `tp`, `pp`, `dp` are aliases of the parallel sizes).
    /// `None` if the flag is absent or its last occurrence has no value (see
    /// [`CommandLine::has_flag`]).
    pub fn flag(&self, name: &str) -> Option<&str> {
        let want = canonical_flag(name);
        self.flags
            .iter()
            .rev()
            .find(|(n, _)| canonical_flag(n) == want)
            .and_then(|(_, v)| v.as_deref())
    }

    /// Whether flag `name` occurs at all (with or without a value); names as in
    /// [`CommandLine::flag`].
    pub fn has_flag(&self, name: &str) -> bool {
        let want = canonical_flag(name);
        self.flags.iter().any(|(n, _)| canonical_flag(n) == want)
    }

    /// `--tensor-parallel-size` / `-tp`.
    pub fn tensor_parallel_size(&self) -> Option<u64> {
        parse_human_int(self.flag("tensor-parallel-size")?)
    }

    /// `--max-model-len` (accepts vLLM's human-readable forms `64k` = 64,000, `64K` = 65,536).
    pub fn max_model_len(&self) -> Option<u64> {
        parse_human_int(self.flag("max-model-len")?)
    }

    /// `--max-num-seqs`.
    pub fn max_num_seqs(&self) -> Option<u64> {
        parse_human_int(self.flag("max-num-seqs")?)
    }

    /// `--max-num-batched-tokens` (human-readable forms accepted).
    pub fn max_num_batched_tokens(&self) -> Option<u64> {
        parse_human_int(self.flag("max-num-batched-tokens")?)
    }

    /// `--gpu-memory-utilization`.
    pub fn gpu_memory_utilization(&self) -> Option<f64> {
        parse_f64(self.flag("gpu-memory-utilization")?)
    }

    /// `--block-size`.
    pub fn block_size(&self) -> Option<u64> {
        parse_human_int(self.flag("block-size")?)
    }

    /// `--kv-cache-dtype` (raw string, e.g. `auto`, `fp8`).
    pub fn kv_cache_dtype(&self) -> Option<&str> {
        self.flag("kv-cache-dtype")
    }

    /// `--limit-mm-per-prompt` (raw string, e.g. `{"image": 2, "video": 0}`).
    pub fn limit_mm_per_prompt(&self) -> Option<&str> {
        self.flag("limit-mm-per-prompt")
    }
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
                    apply_fact(&mut log, fact);
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

// ---------------------------------------------------------------------------------------------
// Numbers

/// An exact decimal: `(-1)^negative × mantissa / 10^decimals`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    mantissa: u128,
    decimals: u32,
}

/// Parses a whole string as a decimal (optional sign, digits with optional strict thousands
/// separators, optional fraction). `None` on anything else or on `u128` overflow.
fn parse_decimal(s: &str) -> Option<Decimal> {
    let (negative, body) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (int_part, frac_part) = match body.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (body, None),
    };
    if int_part.is_empty() {
        return None;
    }
    let mut mantissa: u128 = 0;
    let push = |c: u8, m: &mut u128| -> Option<()> {
        *m = m.checked_mul(10)?.checked_add(u128::from(c - b'0'))?;
        Some(())
    };
    for (i, group) in int_part.split(',').enumerate() {
        let ok_len = if i == 0 {
            (1..=3).contains(&group.len()) || !int_part.contains(',')
        } else {
            group.len() == 3
        };
        if !ok_len || group.is_empty() || !group.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        for c in group.bytes() {
            push(c, &mut mantissa)?;
        }
    }
    let mut decimals = 0u32;
    if let Some(frac) = frac_part {
        if frac.is_empty() || !frac.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        for c in frac.bytes() {
            push(c, &mut mantissa)?;
            decimals = decimals.checked_add(1)?;
        }
    }
    Some(Decimal {
        negative,
        mantissa,
        decimals,
    })
}

/// `round(mantissa × unit / 10^decimals)` (halves up) as `u64`, `None` on overflow.
fn scale_round(mantissa: u128, unit: u64, decimals: u32) -> Option<u64> {
    let num = mantissa.checked_mul(u128::from(unit))?;
    let den = 10u128.checked_pow(decimals)?;
    let q = num / den;
    let r = num % den;
    let q = if r >= den - r { q.checked_add(1)? } else { q };
    u64::try_from(q).ok()
}

/// Bytes per unit; `None` for an unknown unit.
fn unit_bytes(unit: &str) -> Option<u64> {
    let u = unit.trim();
    let is = |names: &[&str]| names.iter().any(|n| u.eq_ignore_ascii_case(n));
    if u.is_empty() || is(&["b", "byte", "bytes"]) {
        Some(1)
    } else if is(&["k", "kb", "kib"]) {
        Some(1 << 10)
    } else if is(&["m", "mb", "mib"]) {
        Some(1 << 20)
    } else if is(&["g", "gb", "gib"]) {
        Some(1 << 30)
    } else if is(&["t", "tb", "tib"]) {
        Some(1 << 40)
    } else {
        None
    }
}

/// Splits a leading number off `s` (leading whitespace skipped): optional `-`, digits, thousands
/// groups `,ddd` (only after a first group of at most three digits and only when exactly three
/// digits follow), optional `.digits`. Returns `(number, rest)`.
fn split_number(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    let b = s.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    let mut i = usize::from(b.first() == Some(&b'-'));
    let start = i;
    while digit(i) {
        i += 1;
    }
    if i == start {
        return None;
    }
    if i - start <= 3 {
        while b.get(i) == Some(&b',') && digit(i + 1) && digit(i + 2) && digit(i + 3) && !digit(i + 4) {
            i += 4;
        }
    }
    if b.get(i) == Some(&b'.') && digit(i + 1) {
        i += 1;
        while digit(i) {
            i += 1;
        }
    }
    // Every index above sits on an ASCII byte, so these are char boundaries.
    Some((s.get(..i)?, s.get(i..)?))
}

/// Splits a size unit off `s` (leading whitespace skipped) if the next word is one; otherwise
/// returns `("", s)`.
fn split_unit(s: &str) -> (&str, &str) {
    let t = s.trim_start();
    let end = t
        .char_indices()
        .find(|(_, c)| !c.is_ascii_alphabetic())
        .map_or(t.len(), |(i, _)| i);
    let (word, rest) = t.split_at(end);
    if !word.is_empty() && unit_bytes(word).is_some() {
        (word, rest)
    } else {
        ("", s)
    }
}

/// A number followed by a size unit (the unit must be present).
fn split_size(s: &str) -> Option<(Printed, &str)> {
    let (num, rest) = split_number(s)?;
    let (unit, rest) = split_unit(rest);
    if unit.is_empty() {
        return None;
    }
    Some((Printed::parse(num, unit)?, rest))
}

/// A number optionally followed by a size unit (a bare number is a byte count).
fn split_size_or_bytes(s: &str) -> Option<(Printed, &str)> {
    let (num, rest) = split_number(s)?;
    let (unit, rest) = split_unit(rest);
    Some((Printed::parse(num, unit)?, rest))
}

/// A non-negative integer (thousands separators allowed) that fits `u64`.
fn split_count(s: &str) -> Option<(u64, &str)> {
    let (num, rest) = split_number(s)?;
    let dec = parse_decimal(num)?;
    if dec.negative || dec.decimals != 0 {
        return None;
    }
    Some((u64::try_from(dec.mantissa).ok()?, rest))
}

/// A finite float.
fn split_f64(s: &str) -> Option<(f64, &str)> {
    let (num, rest) = split_number(s)?;
    Some((parse_f64(num)?, rest))
}

fn parse_f64(s: &str) -> Option<f64> {
    let v: f64 = s.trim().replace(',', "").parse().ok()?;
    v.is_finite().then_some(v)
}

/// vLLM's human-readable integers: `1k` = 1,000, `1K` = 1,024, `25.6k` = 25,600 (also m/M, g/G).
fn parse_human_int(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult): (&str, u64) = match s.as_bytes().last() {
        Some(b'k') => (&s[..s.len() - 1], 1_000),
        Some(b'm') => (&s[..s.len() - 1], 1_000_000),
        Some(b'g') => (&s[..s.len() - 1], 1_000_000_000),
        Some(b'K') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let dec = parse_decimal(num)?;
    if dec.negative {
        return None;
    }
    let v = dec.mantissa.checked_mul(u128::from(mult))? / 10u128.checked_pow(dec.decimals)?;
    u64::try_from(v).ok()
}

// ---------------------------------------------------------------------------------------------
// Lines

/// Text after the first occurrence of `phrase`.
fn after<'a>(s: &'a str, phrase: &str) -> Option<&'a str> {
    s.find(phrase).and_then(|i| s.get(i + phrase.len()..))
}

enum Outcome {
    Nothing,
    Malformed,
    Fact(Box<Fact>),
}

#[derive(Debug)]
enum Fact {
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
    fn kind(&self) -> LineKind {
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
fn classify(seg: &str) -> Outcome {
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

fn apply_fact(log: &mut ParsedLog, fact: Box<Fact>) {
    match *fact {
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

// ---------------------------------------------------------------------------------------------
// Header / command line

fn push_header(log: &mut ParsedLog, line_no: usize, line: &str) {
    apply_header(log, line);
    log.recognised.push(RecognisedLine {
        line: line_no,
        kind: LineKind::Header,
        text: line.to_string(),
    });
}

/// Where the command's arguments start: after `vllm serve`, the OpenAI api_server module or
/// `kvlens serve` (whose start-up log follows vLLM's).
fn command_start(body: &str) -> Option<(usize, usize)> {
    for anchor in ["vllm serve", "vllm.entrypoints.openai.api_server", "kvlens serve"] {
        let mut from = 0;
        while let Some(pos) = body.get(from..).and_then(|s| s.find(anchor)) {
            let start = from + pos;
            let end = start + anchor.len();
            let next = body.get(end..).and_then(|s| s.chars().next());
            if next.is_none_or(char::is_whitespace) {
                return Some((start, end));
            }
            from = end;
        }
    }
    None
}

fn apply_header(log: &mut ParsedLog, line: &str) {
    let body = line.trim_start().trim_start_matches('#').trim();
    let notes_text;
    if let Some((start, args_start)) = command_start(body) {
        let (tokens, end) = tokenize_command(body.get(args_start..).unwrap_or(""));
        let cmd_end = args_start + end;
        let raw = body.get(start..cmd_end).unwrap_or("").trim().to_string();
        notes_text = body.get(cmd_end..).unwrap_or("");
        if log.command.is_none() {
            log.command = Some(build_command(raw, tokens));
        }
    } else {
        notes_text = body;
    }
    let notes = split_notes(notes_text);
    if log.device_hint.is_none() {
        log.device_hint = notes.iter().find(|n| looks_like_device(n)).cloned();
    }
    log.header_notes.extend(notes);
}

/// Shell-like tokenizer. Stops (returning the byte offset where the command ends) at an unquoted
/// `,` that ends a token and is followed by whitespace or the end, or at an unquoted `(` that
/// starts a token. Quotes `'…'` / `"…"` and `{…}` / `[…]` groups keep their spaces and commas.
fn tokenize_command(s: &str) -> (Vec<String>, usize) {
    let mut tokens = Vec::new();
    let mut chars = s.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, first)) = chars.peek() else {
            return (tokens, s.len());
        };
        if first == '(' || first == ',' {
            return (tokens, start);
        }
        let mut tok = String::new();
        let mut depth = 0usize;
        let mut stop_at = None;
        while let Some(&(i, c)) = chars.peek() {
            match c {
                '\'' | '"' => {
                    chars.next();
                    for (_, q) in chars.by_ref() {
                        if q == c {
                            break;
                        }
                        tok.push(q);
                    }
                    continue;
                }
                '\\' => {
                    chars.next();
                    if let Some((_, e)) = chars.next() {
                        if !e.is_whitespace() {
                            tok.push(e);
                        }
                    }
                    continue;
                }
                '{' | '[' => depth += 1,
                '}' | ']' => depth = depth.saturating_sub(1),
                ',' if depth == 0 => {
                    let after_comma = s.get(i + 1..).and_then(|r| r.chars().next());
                    if after_comma.is_none_or(char::is_whitespace) {
                        stop_at = Some(i);
                        break;
                    }
                }
                c if c.is_whitespace() && depth == 0 => break,
                _ => {}
            }
            tok.push(c);
            chars.next();
        }
        if !tok.is_empty() {
            tokens.push(tok);
        }
        if let Some(i) = stop_at {
            return (tokens, i);
        }
    }
}

fn build_command(raw: String, tokens: Vec<String>) -> CommandLine {
    let mut cmd = CommandLine {
        raw,
        ..CommandLine::default()
    };
    let mut positional_model = None;
    let mut iter = tokens.into_iter().peekable();
    while let Some(tok) = iter.next() {
        let name_part = if let Some(n) = tok.strip_prefix("--") {
            n
        } else if is_flag_token(&tok) {
            &tok[1..]
        } else {
            if positional_model.is_none() && cmd.positional.is_empty() {
                positional_model = Some(tok);
            } else {
                cmd.positional.push(tok);
            }
            continue;
        };
        if name_part.is_empty() {
            continue; // a bare `--`
        }
        let (name, value) = match name_part.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(v.to_string())),
            None => {
                let name = name_part.to_string();
                let boolean = is_boolean_flag(&name);
                let value = iter.next_if(|next| {
                    !is_flag_token(next)
                        && (!boolean || next.eq_ignore_ascii_case("true") || next.eq_ignore_ascii_case("false"))
                });
                (name, value)
            }
        };
        cmd.flags.push((name, value));
    }
    cmd.model = positional_model.or_else(|| cmd.flag("model").map(str::to_string));
    cmd
}

/// `-x…` or `--x…` where the character after the dashes is not a digit or `.` (so `-1` is a value).
fn is_flag_token(tok: &str) -> bool {
    let Some(rest) = tok.strip_prefix('-') else {
        return false;
    };
    let rest = rest.strip_prefix('-').unwrap_or(rest);
    rest.chars().next().is_some_and(|c| !c.is_ascii_digit() && c != '.')
}

/// Flags that take no value (a following `true`/`false` is still accepted).
fn is_boolean_flag(name: &str) -> bool {
    let n = canonical_flag(name);
    const KNOWN: &[&str] = &[
        "enforce-eager",
        "trust-remote-code",
        "skip-tokenizer-init",
        "disable-sliding-window",
        "disable-cascade-attn",
        "disable-async-output-proc",
        "disable-mm-preprocessor-cache",
        "async-scheduling",
        "headless",
        "help",
        "version",
    ];
    KNOWN.contains(&n.as_str()) || n.starts_with("enable-") || n.starts_with("disable-") || n.starts_with("no-")
}

/// Flag name without dashes, `_` → `-`, short aliases expanded.
fn canonical_flag(name: &str) -> String {
    let n = name.trim_start_matches('-').replace('_', "-");
    match n.as_str() {
        "tp" => "tensor-parallel-size".to_string(),
        "pp" => "pipeline-parallel-size".to_string(),
        "dp" => "data-parallel-size".to_string(),
        _ => n,
    }
}

/// Splits header notes at top-level `,` and at parentheses.
fn split_notes(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut depth = 0usize;
    let flush = |cur: &mut String, out: &mut Vec<String>| {
        let t = cur.trim().trim_matches(',').trim();
        if !t.is_empty() {
            out.push(t.to_string());
        }
        cur.clear();
    };
    for c in s.chars() {
        match c {
            '(' => {
                if depth == 0 {
                    flush(&mut cur, &mut out);
                } else {
                    cur.push(c);
                }
                depth += 1;
            }
            ')' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    flush(&mut cur, &mut out);
                } else {
                    cur.push(c);
                }
            }
            ',' if depth == 0 => flush(&mut cur, &mut out),
            _ => cur.push(c),
        }
    }
    flush(&mut cur, &mut out);
    out
}

fn looks_like_device(note: &str) -> bool {
    const WORDS: &[&str] = &[
        "Ascend", "910B", "910C", "NVIDIA", "H100", "H200", "H800", "H20", "A100", "A800", "L40", "L20", "RTX",
        "MI300", "MI250", "GPU", "NPU",
    ];
    WORDS.iter().any(|w| note.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u128 = 1 << 30;

    #[test]
    fn decimal_forms() {
        let d = parse_decimal("44.30").unwrap();
        assert_eq!((d.negative, d.mantissa, d.decimals), (false, 4430, 2));
        let d = parse_decimal("645,120").unwrap();
        assert_eq!((d.mantissa, d.decimals), (645_120, 0));
        let d = parse_decimal("1,234,567.5").unwrap();
        assert_eq!((d.mantissa, d.decimals), (12_345_675, 1));
        assert!(parse_decimal("-0.56").unwrap().negative);
        for bad in [
            "", ".5", "5.", "1,2", "1234,567", "1,2345", "1.2.3", "abc", "1e9", "--1", ",123",
        ] {
            assert!(parse_decimal(bad).is_none(), "{bad:?}");
        }
        // u128 overflow is rejected, not a panic.
        assert!(parse_decimal(&"9".repeat(60)).is_none());
    }

    #[test]
    fn sizes_are_exact() {
        assert_eq!(parse_size_to_bytes("44.30", "GiB"), Some(47_566_762_803));
        assert_eq!(parse_size_to_bytes("44.30", "GB"), parse_size_to_bytes("44.30", "G"));
        assert_eq!(parse_size_to_bytes("9", "MiB"), Some(9 << 20));
        assert_eq!(parse_size_to_bytes("21540531712", ""), Some(21_540_531_712));
        assert_eq!(parse_size_to_bytes("0.5", "B"), Some(1)); // halves round up
        assert_eq!(parse_size_to_bytes("0.4", "bytes"), Some(0));
        assert_eq!(parse_size_to_bytes("-1", "GiB"), None);
        assert_eq!(parse_size_to_bytes("1", "parsecs"), None);
        assert_eq!(parse_size_to_bytes("17179869184", "GiB"), None); // 2^64 bytes
        assert_eq!(parse_size_to_bytes("17179869183.999999999", "GiB"), Some(u64::MAX));
        let exact = (9_1948u128 * GIB + 5_000) / 10_000;
        assert_eq!(parse_size_to_bytes("9.1948", "GB"), Some(exact as u64));
    }

    #[test]
    fn split_number_stops_at_separators() {
        assert_eq!(split_number("21540531712, total"), Some(("21540531712", ", total")));
        assert_eq!(split_number(" 645,120 tokens"), Some(("645,120", " tokens")));
        assert_eq!(split_number("2.46x"), Some(("2.46", "x")));
        assert_eq!(split_number("1,2"), Some(("1", ",2")));
        assert_eq!(split_number("12,345,6789"), Some(("12,345", ",6789")));
        assert_eq!(split_number("5. Next"), Some(("5", ". Next")));
        assert_eq!(split_number("-0.01 GiB"), Some(("-0.01", " GiB")));
        assert_eq!(split_number("x1"), None);
        assert_eq!(split_number("-"), None);
    }

    #[test]
    fn printed_interval() {
        let p = Printed::parse("44.30", "GiB").unwrap();
        let (lo, hi) = p.interval();
        // 44.295 GiB = 47,561,394,094.08 B; 44.305 GiB = 47,572,131,512.32 B
        assert_eq!((lo, hi), (47_561_394_095, 47_572_131_512));
        assert!(p.contains(5_040 * (9 << 20)));
        assert!(!p.contains(5_041 * (9 << 20)));
        let b = Printed::parse("21540531712", "").unwrap();
        assert_eq!(b.interval(), (21_540_531_712, 21_540_531_712));
        let z = Printed::parse("0.00", "GiB").unwrap();
        assert_eq!(z.interval().0, 0);
        let n = Printed::parse("-0.56", "GiB").unwrap();
        assert!(n.negative);
        assert_eq!(n.signed_bytes(), -i128::from(n.bytes));
    }

    #[test]
    fn human_ints() {
        assert_eq!(parse_human_int("65536"), Some(65_536));
        assert_eq!(parse_human_int("64k"), Some(64_000));
        assert_eq!(parse_human_int("64K"), Some(65_536));
        assert_eq!(parse_human_int("25.6k"), Some(25_600));
        assert_eq!(parse_human_int("-1"), None);
        assert_eq!(parse_human_int(""), None);
        assert_eq!(parse_human_int("k"), None);
    }

    #[test]
    fn tokenizer_cuts_at_notes() {
        let (t, end) =
            tokenize_command(" Qwen/X --limit-mm-per-prompt '{\"image\": 2, \"video\": 0}' --a=1, Ascend 910B");
        assert_eq!(
            t,
            vec![
                "Qwen/X",
                "--limit-mm-per-prompt",
                "{\"image\": 2, \"video\": 0}",
                "--a=1"
            ]
        );
        assert_eq!(
            &" Qwen/X --limit-mm-per-prompt '{\"image\": 2, \"video\": 0}' --a=1, Ascend 910B"[end..],
            ", Ascend 910B"
        );
        let (t, _) = tokenize_command(" m --x 1 (note), other");
        assert_eq!(t, vec!["m", "--x", "1"]);
    }
}
