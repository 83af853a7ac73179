//! The planner's inputs as vLLM's flags spell them, and their one conversion into a
//! [`PlanRequest`]: `kvlens plan` and `kvlens serve` read them as command-line flags (feature
//! `cli`), the playground's planner page as a query string (`?model=…&tp=2&max_model_len=…`).

use super::device::{device_preset, device_preset_names, gib_to_bytes};
use super::log_budget::{header_settings, rebuild, what_if, DeviceTotal, HeaderSettings, LogBudget, WhatIf};
use super::planner::{MmLimits, PlanError, PlanRequest, DEFAULT_MM_PROCESSOR_CACHE_GB};
use super::vllm_log::ParsedLog;
use crate::arch::config::{bundled_config, DType, ImageLimits, ModelConfig, ProcessorKwargs};
use crate::arch::weight_format::WeightFormat;

/// The model planned when neither a flag nor a log names one.
pub const DEFAULT_MODEL: &str = "Qwen3-VL-8B-Instruct";
/// The device planned for when neither a flag nor a log names one.
pub const DEFAULT_DEVICE: &str = "h100-80g";

/// Engine flags that size the KV cache, the scheduler and the multimodal budgets.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct VllmFlags {
    /// Longest prompt plus output [default: the model's max_position_embeddings].
    #[cfg_attr(feature = "cli", arg(long))]
    pub max_model_len: Option<usize>,
    /// Share of the device memory the engine may use [default: 0.9].
    #[cfg_attr(feature = "cli", arg(long))]
    pub gpu_memory_utilization: Option<f64>,
    /// Most tokens per engine step [default: vLLM's for the device].
    #[cfg_attr(feature = "cli", arg(long))]
    pub max_num_batched_tokens: Option<usize>,
    /// Most requests running at once [default: vLLM's for the device].
    #[cfg_attr(feature = "cli", arg(long))]
    pub max_num_seqs: Option<usize>,
    /// Tokens per KV block [default: 16, or 128 on Ascend].
    #[cfg_attr(feature = "cli", arg(long))]
    pub block_size: Option<usize>,
    /// Items per prompt: `image=N,video=M` or JSON such as '{"image": 4, "video": 0}'.
    #[cfg_attr(feature = "cli", arg(long))]
    pub limit_mm_per_prompt: Option<String>,
    /// Image processor overrides as JSON, e.g. '{"max_pixels": 1003520}' (min_pixels and
    /// max_pixels are read): the largest image, which the profile and the encoder budget assume.
    #[cfg_attr(feature = "cli", arg(long))]
    pub mm_processor_kwargs: Option<String>,
    /// Host memory of the preprocessed-image cache in GiB (0 turns it off).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = DEFAULT_MM_PROCESSOR_CACHE_GB, value_parser = non_negative))]
    pub mm_processor_cache_gb: f64,
    /// Weights dtype: auto (the checkpoint's), bfloat16, float16, float32; `kvlens serve` computes
    /// in float32 on the CPU.
    #[cfg_attr(feature = "cli", arg(long, default_value = "auto"))]
    pub dtype: String,
    /// KV cache dtype: auto (the compute dtype), bfloat16, float16, float32, fp8, fp8_e4m3,
    /// fp8_e5m2.
    #[cfg_attr(feature = "cli", arg(long, default_value = "auto"))]
    pub kv_cache_dtype: String,
    /// Weight matrices quantized on load: q8_0 or q4_0 (GGML's block formats); none keeps the
    /// dtype.
    #[cfg_attr(feature = "cli", arg(long, short = 'q', default_value = "none"))]
    pub quantization: String,
}

impl Default for VllmFlags {
    fn default() -> Self {
        VllmFlags {
            max_model_len: None,
            gpu_memory_utilization: None,
            max_num_batched_tokens: None,
            max_num_seqs: None,
            block_size: None,
            limit_mm_per_prompt: None,
            mm_processor_kwargs: None,
            mm_processor_cache_gb: DEFAULT_MM_PROCESSOR_CACHE_GB,
            dtype: "auto".into(),
            kv_cache_dtype: "auto".into(),
            quantization: "none".into(),
        }
    }
}

impl VllmFlags {
    /// Sets these flags on a planner request; the settings a log header names (`kvlens plan
    /// --from-log`) fill in the flags not given, the planner's defaults the rest.
    pub fn apply(&self, r: &mut PlanRequest, header: &HeaderSettings) -> Result<(), PlanError> {
        r.max_model_len = self.max_model_len.or(header.max_model_len);
        if let Some(u) = self.gpu_memory_utilization.or(header.gpu_memory_utilization) {
            r.gpu_memory_utilization = u;
        }
        r.max_num_batched_tokens = self.max_num_batched_tokens.or(header.max_num_batched_tokens);
        r.max_num_seqs = self.max_num_seqs.or(header.max_num_seqs);
        r.block_size = self.block_size.or(header.block_size);
        if let Some(l) = self
            .limit_mm_per_prompt
            .as_ref()
            .or(header.limit_mm_per_prompt.as_ref())
        {
            r.limit_mm_per_prompt = MmLimits::parse(l)?;
        }
        if let Some(json) = &self.mm_processor_kwargs {
            r.image_limits = ProcessorKwargs::parse(json)
                .and_then(|k| k.apply(r.image_limits))
                .map_err(|e| PlanError::Invalid(e.to_string()))?;
        }
        r.mm_processor_cache_gb = self.mm_processor_cache_gb;
        let kv_dtype = match (self.kv_cache_dtype.as_str(), &header.kv_cache_dtype) {
            ("auto", Some(h)) => h.as_str(),
            (flag, _) => flag,
        };
        r.kv_cache_dtype = parse_dtype("kv-cache-dtype", kv_dtype)?;
        r.dtype = parse_dtype("dtype", &self.dtype)?;
        r.quantization = self.quantization.parse().map_err(PlanError::Invalid)?;
        Ok(())
    }
}

/// Everything `kvlens plan` takes besides `--from-log`: the model, the device, vLLM's flags and
/// measured figures that replace the planner's estimates.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct PlanInputs {
    /// A bundled model name (e.g. Qwen3-VL-8B-Instruct) or a checkpoint directory with config.json.
    /// [default: the log's model with --from-log, else Qwen3-VL-8B-Instruct]
    #[cfg_attr(feature = "cli", arg(long))]
    pub model: Option<String>,
    /// Device preset: h100-80g, h200-141g, a100-40g, a100-80g, l40s-48g, rtx4090-24g,
    /// ascend-910b-64g, apple-m2-max-32g, webgpu-4g, webgpu-8g, cpu [default: the log's device, else h100-80g].
    #[cfg_attr(feature = "cli", arg(long))]
    pub device: Option<String>,
    /// Override the device's total memory (GiB).
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub total_memory_gib: Option<f64>,
    /// [default: 1]
    #[cfg_attr(feature = "cli", arg(long, short = 't'))]
    pub tensor_parallel_size: Option<usize>,
    /// vLLM's engine flags.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub vllm: VllmFlags,
    /// Fixed KV cache size (GiB), as vLLM's --kv-cache-memory: the utilization rule is skipped.
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub kv_cache_memory_gib: Option<f64>,
    /// Measured weights memory (GiB) instead of the estimate.
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub weights_gib: Option<f64>,
    /// Measured activation peak (GiB) instead of the estimate.
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub activation_peak_gib: Option<f64>,
    /// Measured non-torch memory (GiB) instead of the device default.
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub non_torch_gib: Option<f64>,
}

/// A model to plan for: the name to show, its config and its image processor's limits.
pub type PlanModel = (String, ModelConfig, ImageLimits);

/// A bundled model (`Qwen/` prefix optional) with its shipped image limits.
pub fn bundled_model(name: &str) -> Result<PlanModel, PlanError> {
    let cfg = bundled_config(name).map_err(|e| PlanError::Invalid(e.to_string()))?;
    let limits = ImageLimits::shipped(cfg.family);
    Ok((name.rsplit('/').next().unwrap_or(name).to_string(), cfg, limits))
}

/// The query-string keys of [`PlanInputs`], in the order [`PlanInputs::to_query`] writes them:
/// vLLM's flag names with underscores (`tp` is vLLM's `-tp`, also read as `tensor_parallel_size`).
pub const QUERY_KEYS: &[&str] = &[
    "model",
    "device",
    "tp",
    "total_memory_gib",
    "gpu_memory_utilization",
    "kv_cache_memory_gib",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "block_size",
    "limit_mm_per_prompt",
    "mm_processor_kwargs",
    "mm_processor_cache_gb",
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "weights_gib",
    "activation_peak_gib",
    "non_torch_gib",
];

impl PlanInputs {
    /// The planner request for these inputs; settings a log header names fill in unset ones.
    /// `load` turns a model name (or, for `kvlens plan`, a directory) into a [`PlanModel`].
    pub fn request(
        &self,
        header: &HeaderSettings,
        load: impl FnOnce(&str) -> Result<PlanModel, PlanError>,
    ) -> Result<PlanRequest, PlanError> {
        let model = self
            .model
            .as_deref()
            .or(header.model.as_deref())
            .unwrap_or(DEFAULT_MODEL);
        let (name, cfg, limits) = load(model)?;
        let device_name = self
            .device
            .as_deref()
            .or(header.device.as_deref())
            .unwrap_or(DEFAULT_DEVICE);
        let mut device = device_preset(device_name).ok_or_else(|| {
            PlanError::Invalid(format!(
                "unknown device {device_name:?}; known devices: {}",
                device_preset_names()
            ))
        })?;
        if let Some(t) = self.total_memory_gib.or(header.total_memory_gib) {
            device = device.with_total_bytes(gib_to_bytes(t));
        }
        let mut r = PlanRequest::new(name, cfg, device);
        r.image_limits = limits;
        r.tensor_parallel_size = self.tensor_parallel_size.or(header.tensor_parallel_size).unwrap_or(1);
        self.vllm.apply(&mut r, header)?;
        r.kv_cache_memory_bytes = self.kv_cache_memory_gib.map(gib_to_bytes);
        r.weights_bytes = self.weights_gib.map(gib_to_bytes);
        r.activation_peak_bytes = self.activation_peak_gib.map(gib_to_bytes);
        r.non_torch_bytes = self.non_torch_gib.map(gib_to_bytes);
        Ok(r)
    }

    /// `kvlens plan --from-log`: the budget rebuilt from a log (these inputs override its
    /// header) and, with a target length, the smallest change of each knob that makes it fit.
    pub fn explain_log(
        &self,
        log: &ParsedLog,
        target_max_model_len: Option<usize>,
        load: impl FnOnce(&str) -> Result<PlanModel, PlanError>,
    ) -> Result<(LogBudget, Option<Vec<WhatIf>>), PlanError> {
        let header = header_settings(log);
        let req = self.request(&header, load)?;
        let total = if self.total_memory_gib.or(header.total_memory_gib).is_some() {
            DeviceTotal::Given
        } else {
            DeviceTotal::Preset
        };
        let budget = rebuild(log, req.clone(), total)?;
        let answers = target_max_model_len.map(|t| what_if(&budget, &req, t));
        Ok((budget, answers))
    }

    /// Sets one input from its query-string key (see [`QUERY_KEYS`]); an empty value unsets it.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), PlanError> {
        let value = value.trim();
        let bad = |why: String| PlanError::Invalid(format!("{key}: {why}"));
        let text = || (!value.is_empty()).then(|| value.to_string());
        let count = || -> Result<Option<usize>, PlanError> {
            if value.is_empty() {
                return Ok(None);
            }
            value
                .parse()
                .map(Some)
                .map_err(|_| bad(format!("{value:?} is not a whole number")))
        };
        let gib = || -> Result<Option<f64>, PlanError> {
            if value.is_empty() {
                return Ok(None);
            }
            non_negative(value).map(Some).map_err(bad)
        };
        let v = &mut self.vllm;
        match key {
            "model" => self.model = text(),
            "device" => self.device = text(),
            "tp" | "tensor_parallel_size" => self.tensor_parallel_size = count()?,
            "total_memory_gib" => self.total_memory_gib = gib()?,
            "gpu_memory_utilization" => {
                v.gpu_memory_utilization = match value {
                    "" => None,
                    _ => Some(value.parse().map_err(|_| bad(format!("{value:?} is not a number")))?),
                }
            }
            "kv_cache_memory_gib" => self.kv_cache_memory_gib = gib()?,
            "max_model_len" => v.max_model_len = count()?,
            "max_num_batched_tokens" => v.max_num_batched_tokens = count()?,
            "max_num_seqs" => v.max_num_seqs = count()?,
            "block_size" => v.block_size = count()?,
            "limit_mm_per_prompt" => {
                if !value.is_empty() {
                    MmLimits::parse(value)?;
                }
                v.limit_mm_per_prompt = text();
            }
            "mm_processor_kwargs" => {
                if !value.is_empty() {
                    ProcessorKwargs::parse(value).map_err(|e| bad(e.to_string()))?;
                }
                v.mm_processor_kwargs = text();
            }
            "mm_processor_cache_gb" => v.mm_processor_cache_gb = gib()?.unwrap_or(DEFAULT_MM_PROCESSOR_CACHE_GB),
            "dtype" | "kv_cache_dtype" => {
                let value = if value.is_empty() { "auto" } else { value };
                parse_dtype(&key.replace('_', "-"), value)?;
                *if key == "dtype" {
                    &mut v.dtype
                } else {
                    &mut v.kv_cache_dtype
                } = value.to_string();
            }
            "quantization" => {
                let value = if value.is_empty() { "none" } else { value };
                value.parse::<WeightFormat>().map_err(PlanError::Invalid)?;
                v.quantization = value.to_string();
            }
            "weights_gib" => self.weights_gib = gib()?,
            "activation_peak_gib" => self.activation_peak_gib = gib()?,
            "non_torch_gib" => self.non_torch_gib = gib()?,
            _ => {
                return Err(PlanError::Invalid(format!(
                    "unknown setting {key:?}; known settings: {}",
                    QUERY_KEYS.join(", ")
                )))
            }
        }
        Ok(())
    }

    /// One input as its query-string value (None when unset).
    pub fn get(&self, key: &str) -> Option<String> {
        let v = &self.vllm;
        let n = |x: Option<usize>| x.map(|x| x.to_string());
        let f = |x: Option<f64>| x.map(|x| x.to_string());
        match key {
            "model" => self.model.clone(),
            "device" => self.device.clone(),
            "tp" | "tensor_parallel_size" => n(self.tensor_parallel_size),
            "total_memory_gib" => f(self.total_memory_gib),
            "gpu_memory_utilization" => f(v.gpu_memory_utilization),
            "kv_cache_memory_gib" => f(self.kv_cache_memory_gib),
            "max_model_len" => n(v.max_model_len),
            "max_num_batched_tokens" => n(v.max_num_batched_tokens),
            "max_num_seqs" => n(v.max_num_seqs),
            "block_size" => n(v.block_size),
            "limit_mm_per_prompt" => v.limit_mm_per_prompt.clone(),
            "mm_processor_kwargs" => v.mm_processor_kwargs.clone(),
            "mm_processor_cache_gb" => f(Some(v.mm_processor_cache_gb)),
            "dtype" => Some(v.dtype.clone()),
            "kv_cache_dtype" => Some(v.kv_cache_dtype.clone()),
            "quantization" => Some(v.quantization.clone()),
            "weights_gib" => f(self.weights_gib),
            "activation_peak_gib" => f(self.activation_peak_gib),
            "non_torch_gib" => f(self.non_torch_gib),
            _ => None,
        }
    }

    /// Reads a query string (`?` optional, `+` and `%XX` decoded): the inputs its good pairs
    /// name, and an error for each bad pair (whose input keeps its default).
    pub fn from_query(query: &str) -> (Self, Vec<PlanError>) {
        let mut inputs = PlanInputs::default();
        let errors = query
            .trim_start_matches('?')
            .split('&')
            .filter(|p| !p.is_empty())
            .filter_map(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                inputs.set(&percent_decode(key), &percent_decode(value)).err()
            })
            .collect();
        (inputs, errors)
    }

    /// The query string (without `?`) naming every input that differs from its default.
    pub fn to_query(&self) -> String {
        let defaults = PlanInputs::default();
        QUERY_KEYS
            .iter()
            .filter_map(|k| {
                let v = self.get(k)?;
                (Some(&v) != defaults.get(k).as_ref()).then(|| format!("{k}={}", percent_encode(&v)))
            })
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// A size flag's value parser: a finite number of GiB, 0 or more.
pub fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(v) => Err(format!("must be a non-negative size, got {v}")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

/// `--FLAG VALUE` as a dtype: None for `auto` (the checkpoint's), else a known name.
pub fn parse_dtype(flag: &str, value: &str) -> Result<Option<DType>, PlanError> {
    if value.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    DType::parse(value)
        .map(Some)
        .ok_or_else(|| PlanError::Invalid(format!("--{flag}: unknown dtype {value:?}")))
}

/// `application/x-www-form-urlencoded` decoding: `+` is a space, `%XX` a byte; a `%` that starts
/// no escape stays as it is.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |j: usize| b.get(j).and_then(|c| (*c as char).to_digit(16));
        match (b[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
            (b'+', ..) => out.push(b' '),
            (c, ..) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Escapes every byte but RFC 3986's unreserved characters.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|c| match c {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (c as char).to_string(),
            _ => format!("%{c:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::planner::plan;
    use crate::memory::vllm_log::parse_vllm_log;

    const EXAMPLE: &str =
        "model=Qwen3-VL-32B-Instruct&device=ascend-910b-64g&tp=2&kv_cache_memory_gib=20.06&max_model_len=262144";

    /// The inputs of a query string that has no bad pair.
    fn query(q: &str) -> PlanInputs {
        let (inputs, errors) = PlanInputs::from_query(q);
        assert!(errors.is_empty(), "{q}: {errors:?}");
        inputs
    }

    fn plan_of(q: &str) -> crate::memory::Plan {
        plan(&query(q).request(&HeaderSettings::default(), bundled_model).unwrap()).unwrap()
    }

    #[test]
    fn the_example_link_gives_164224_tokens() {
        let p = plan_of(&format!("?{EXAMPLE}"));
        assert_eq!((p.tensor_parallel_size, p.block_size), (2, 128));
        assert_eq!((p.kv_cache_tokens, p.estimated_max_model_len), (164_224, Some(164_224)));
        assert!(!p.fits);
        let rows = p.table();
        let row = |l: &str| rows.iter().find(|r| r.0 == l).map(|r| r.1.clone());
        assert_eq!(row("KV cache tokens").as_deref(), Some("164,224"));
        assert!(
            p.verdict().contains("the estimated maximum model length is 164,224"),
            "{}",
            p.verdict()
        );
        assert!(p.vllm_log_lines().iter().any(|l| l.contains("is 164224.")));
        // The link the page writes back is the example link.
        assert_eq!(query(EXAMPLE).to_query(), EXAMPLE);
    }

    /// vLLM's `--mm-processor-kwargs`: a smaller largest image, fewer tokens per image in the plan.
    #[test]
    fn processor_kwargs_cap_the_largest_image() {
        let full = plan_of("model=Qwen3-VL-8B-Instruct");
        let capped = plan_of("model=Qwen3-VL-8B-Instruct&mm_processor_kwargs=%7B%22max_pixels%22%3A1048576%7D");
        assert_eq!(capped.max_tokens_per_image, 1024, "32×32 pixels a token");
        assert!(full.max_tokens_per_image > 4 * capped.max_tokens_per_image);
        let (_, errors) = PlanInputs::from_query("mm_processor_kwargs=%7B%22max_pixels%22%3A-1%7D");
        assert!(!errors.is_empty(), "a bad value is refused");
    }

    #[test]
    fn every_key_round_trips() {
        let mut all = PlanInputs::default();
        let values = [
            ("model", "Qwen2-VL-7B-Instruct"),
            ("device", "a100-80g"),
            ("tp", "4"),
            ("total_memory_gib", "75.5"),
            ("gpu_memory_utilization", "0.85"),
            ("kv_cache_memory_gib", "12"),
            ("max_model_len", "32768"),
            ("max_num_batched_tokens", "16384"),
            ("max_num_seqs", "64"),
            ("block_size", "32"),
            ("limit_mm_per_prompt", r#"{"image": 4, "video": 0}"#),
            ("mm_processor_kwargs", r#"{"max_pixels": 1003520}"#),
            ("mm_processor_cache_gb", "0"),
            ("dtype", "float16"),
            ("kv_cache_dtype", "fp8"),
            ("quantization", "q4_0"),
            ("weights_gib", "15.2"),
            ("activation_peak_gib", "2.5"),
            ("non_torch_gib", "0.3"),
        ];
        assert_eq!(values.map(|(k, _)| k).as_slice(), QUERY_KEYS);
        for (k, v) in values {
            all.set(k, v).unwrap();
            assert_eq!(all.get(k).as_deref(), Some(v), "{k}");
        }
        let link = all.to_query();
        assert!(
            link.contains("limit_mm_per_prompt=%7B%22image%22%3A%204%2C%20%22video%22%3A%200%7D"),
            "{link}"
        );
        assert_eq!(query(&link), all);
        // Spaces as `+`, vLLM's long spelling of `tp`, empty values unset.
        let p = query("limit_mm_per_prompt=image%3D2,+video%3D0&tensor_parallel_size=2&max_model_len=");
        assert_eq!(p.vllm.limit_mm_per_prompt.as_deref(), Some("image=2, video=0"));
        assert_eq!((p.tensor_parallel_size, p.vllm.max_model_len), (Some(2), None));
        assert_eq!(query("").to_query(), "");
    }

    #[test]
    fn bad_query_values_are_clear_errors() {
        for (q, needle) in [
            ("max_model_len=abc", "max_model_len: \"abc\" is not a whole number"),
            ("tp=-2", "tp: \"-2\" is not a whole number"),
            (
                "kv_cache_memory_gib=-1",
                "kv_cache_memory_gib: must be a non-negative size, got -1",
            ),
            ("weights_gib=lots", "weights_gib: \"lots\" is not a number"),
            (
                "gpu_memory_utilization=most",
                "gpu_memory_utilization: \"most\" is not a number",
            ),
            ("dtype=int3", "--dtype: unknown dtype \"int3\""),
            ("quantization=awq", "--quantization: unknown format \"awq\""),
            ("limit_mm_per_prompt=pictures%3D3", "unknown modality \"pictures\""),
            (
                "max_model_length=8192",
                "unknown setting \"max_model_length\"; known settings: model, device, tp",
            ),
            ("%ZZ=1", "unknown setting \"%ZZ\""),
        ] {
            let (inputs, errors) = PlanInputs::from_query(&format!("tp=2&{q}&max_model_len=4096"));
            assert_eq!(errors.len(), 1, "{q}: {errors:?}");
            let err = errors[0].to_string();
            assert!(err.contains(needle), "{q}: {err}");
            // The good pairs around it still apply.
            assert_eq!(
                (inputs.tensor_parallel_size, inputs.vllm.max_model_len),
                (Some(2), Some(4096))
            );
        }
        // Well-formed values the planner refuses: its own messages.
        for (q, needle) in [
            (
                "model=Qwen9-VL",
                "unknown model \"Qwen9-VL\"; known models: Qwen2-VL-2B-Instruct",
            ),
            ("device=tpu-v5", "unknown device \"tpu-v5\"; known devices: h100-80g"),
        ] {
            let err = query(q)
                .request(&HeaderSettings::default(), bundled_model)
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{q}: {err}");
        }
        let err = plan(
            &query("gpu_memory_utilization=1.5")
                .request(&HeaderSettings::default(), bundled_model)
                .unwrap(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("must be in (0, 1], got 1.5"), "{err}");
    }

    #[test]
    fn a_pasted_log_is_explained_with_the_inputs_over_its_header() {
        let text = include_str!("../../tests/fixtures/vllm-logs/qwen3-vl-32b-tp2-maxlen262144.log");
        let log = parse_vllm_log(text);
        let (budget, answers) = PlanInputs::default()
            .explain_log(&log, Some(262_144), bundled_model)
            .unwrap();
        assert_eq!(budget.plan.model, "Qwen3-VL-32B-Instruct");
        assert_eq!(budget.plan.estimated_max_model_len, Some(164_224));
        assert!(budget.checks.iter().all(|c| c.ok), "{:?}", budget.checks);
        let answers = answers.unwrap();
        let tp = answers.iter().find(|w| w.knob == "tensor-parallel-size").unwrap();
        assert_eq!(tp.change.as_deref(), Some("--tensor-parallel-size 4"));
        // A shorter max_model_len in the inputs wins over the log's command.
        let (budget, _) = query("max_model_len=131072")
            .explain_log(&log, None, bundled_model)
            .unwrap();
        assert!(budget.plan.fits && budget.plan.max_model_len == 131_072);
    }
}
