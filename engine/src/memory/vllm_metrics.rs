//! A vLLM (or vllm-ascend) server's Prometheus `/metrics` text read into the figures the
//! playground's server mode shows: KV-cache usage and size, requests running and waiting, prefix-
//! and multimodal-cache lookups, preemptions. vLLM exposes no more of its memory than these; per-
//! block state and encoder-cache occupancy are not among them.
//!
//! Each figure is summed over the series that carry it (one per engine, `engine="0"`, `"1"`, … with
//! data parallelism); the KV-cache usage, a fraction, is their mean, as vLLM's own aggregated log
//! line takes it. `num_gpu_blocks` and `block_size` are labels of the `vllm:cache_config_info`
//! gauge. The names deprecated in vLLM 0.9 (`vllm:gpu_cache_usage_perc`,
//! `vllm:gpu_prefix_cache_{queries,hits}_total`) are read where the current ones are absent.

/// The figures of one scrape; `None` where the text does not carry them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VllmMetrics {
    /// The `model_name` label values, in order of appearance.
    pub model_names: Vec<String>,
    /// Engines (data-parallel ranks) told apart by their `engine` label; 1 where the figures carry
    /// no such label, 0 where there are no figures at all.
    pub engines: usize,
    /// `vllm:kv_cache_usage_perc`: the share of KV blocks held by requests, 0 to 1.
    pub kv_cache_usage: Option<f64>,
    /// `num_gpu_blocks` of `vllm:cache_config_info`, summed over engines.
    pub num_gpu_blocks: Option<u64>,
    /// `block_size` of `vllm:cache_config_info`: tokens per KV block.
    pub block_size: Option<u64>,
    /// `gpu_memory_utilization` of `vllm:cache_config_info`.
    pub gpu_memory_utilization: Option<f64>,
    /// The lowest `vllm:kv_cache_usage_perc` seen when one is negative (vllm-ascend issue 10048);
    /// negative values are left out of [`Self::kv_cache_usage`].
    pub negative_usage: Option<f64>,
    /// `vllm:model_weights_memory_bytes`, summed over engines.
    pub model_weights_bytes: Option<u64>,
    /// `vllm:num_requests_running`.
    pub num_requests_running: Option<u64>,
    /// `vllm:num_requests_waiting`.
    pub num_requests_waiting: Option<u64>,
    /// `vllm:prefix_cache_queries_total`, in tokens.
    pub prefix_cache_queries: Option<u64>,
    /// `vllm:prefix_cache_hits_total`, in tokens.
    pub prefix_cache_hits: Option<u64>,
    /// `vllm:mm_cache_queries_total`, in items: lookups in the front end's processor cache.
    pub mm_cache_queries: Option<u64>,
    /// `vllm:mm_cache_hits_total`, in items.
    pub mm_cache_hits: Option<u64>,
    /// `vllm:num_preemptions_total`.
    pub num_preemptions: Option<u64>,
}

/// One sample line of the text exposition format.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// The metric name as written (counters end in `_total`).
    pub name: &'a str,
    /// Label names and unescaped values, in the order written.
    pub labels: Vec<(&'a str, String)>,
    /// The value (`NaN` and `±Inf` included).
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }
}

/// Whether `s` is a metric or label name (`[a-zA-Z_:][a-zA-Z0-9_:]*`; labels have no `:`, which
/// does not matter for reading).
fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// The labels after a `{`, up to and without the closing `}`; returns them and the text after it.
fn parse_labels(mut s: &str) -> Option<(Vec<(&str, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (name, rest) = s.split_once('=')?;
        let name = name.trim();
        if !is_name(name) {
            return None;
        }
        let rest = rest.trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next()? {
                (_, '\\') => value.push(match chars.next()?.1 {
                    'n' => '\n',
                    other => other,
                }),
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.push((name, value));
        s = rest[end + 1..].trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return None;
        }
    }
}

/// Parses one line; `None` for comments, blank lines and anything that is not a sample.
pub fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.starts_with('#') {
        return None;
    }
    let end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..end];
    if !is_name(name) {
        return None;
    }
    let (labels, rest) = match line[end..].strip_prefix('{') {
        Some(inner) => parse_labels(inner)?,
        None => (Vec::new(), &line[end..]),
    };
    // The value, then an optional timestamp.
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample { name, labels, value })
}

/// A count from a sample value: finite and not negative, else nothing.
fn count(value: f64) -> Option<u64> {
    (value.is_finite() && value >= 0.0).then(|| value.round() as u64)
}

/// The families read, each under its current name and its deprecated one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Usage,
    Running,
    Waiting,
    PrefixQueries,
    PrefixHits,
    MmQueries,
    MmHits,
    Preemptions,
    Weights,
}

const FAMILIES: usize = 9;

impl Family {
    /// The family of a sample name, and whether that name is the deprecated one.
    fn of(name: &str) -> Option<(Family, bool)> {
        Some(match name {
            "vllm:kv_cache_usage_perc" => (Family::Usage, false),
            "vllm:gpu_cache_usage_perc" => (Family::Usage, true),
            "vllm:num_requests_running" => (Family::Running, false),
            "vllm:num_requests_waiting" => (Family::Waiting, false),
            "vllm:prefix_cache_queries_total" => (Family::PrefixQueries, false),
            "vllm:gpu_prefix_cache_queries_total" => (Family::PrefixQueries, true),
            "vllm:prefix_cache_hits_total" => (Family::PrefixHits, false),
            "vllm:gpu_prefix_cache_hits_total" => (Family::PrefixHits, true),
            "vllm:mm_cache_queries_total" => (Family::MmQueries, false),
            "vllm:mm_cache_hits_total" => (Family::MmHits, false),
            "vllm:num_preemptions_total" => (Family::Preemptions, false),
            "vllm:model_weights_memory_bytes" => (Family::Weights, false),
            _ => return None,
        })
    }
}

/// Sum and number of the finite, non-negative values seen for one name.
#[derive(Debug, Clone, Copy, Default)]
struct Sum {
    total: f64,
    n: usize,
}

impl Sum {
    fn add(&mut self, value: f64) -> bool {
        let ok = value.is_finite() && value >= 0.0;
        if ok {
            self.total += value;
            self.n += 1;
        }
        ok
    }

    fn get(self) -> Option<f64> {
        (self.n > 0).then_some(self.total)
    }

    fn mean(self) -> Option<f64> {
        self.get().map(|t| t / self.n as f64)
    }
}

impl VllmMetrics {
    /// Reads a scrape. Lines it cannot read are skipped; it never fails.
    pub fn parse(text: &str) -> Self {
        // [family][deprecated name?]
        let mut sums = [[Sum::default(); 2]; FAMILIES];
        let mut blocks = Sum::default();
        let mut block_size = None;
        let mut gpu_memory_utilization = None;
        let mut negative_usage: Option<f64> = None;
        let mut engines: Vec<String> = Vec::new();
        let mut unlabelled = false;
        let mut model_names: Vec<String> = Vec::new();
        for sample in text.lines().filter_map(parse_sample) {
            let counted = if sample.name == "vllm:cache_config_info" {
                let label = |n| sample.label(n).and_then(|v| v.trim().parse::<u64>().ok());
                block_size = block_size.or(label("block_size"));
                gpu_memory_utilization = gpu_memory_utilization.or(sample
                    .label("gpu_memory_utilization")
                    .and_then(|v| v.trim().parse::<f64>().ok()));
                label("num_gpu_blocks").is_some_and(|b| blocks.add(b as f64))
            } else if let Some((family, deprecated)) = Family::of(sample.name) {
                if family == Family::Usage && sample.value < 0.0 {
                    negative_usage = Some(negative_usage.map_or(sample.value, |n| n.min(sample.value)));
                }
                sums[family as usize][usize::from(deprecated)].add(sample.value)
            } else {
                false
            };
            if !counted {
                continue;
            }
            match sample.label("engine") {
                Some(e) if !engines.iter().any(|x| x == e) => engines.push(e.to_string()),
                Some(_) => {}
                None => unlabelled = true,
            }
            if let Some(m) = sample.label("model_name") {
                if !model_names.iter().any(|x| x == m) {
                    model_names.push(m.to_string());
                }
            }
        }
        let pick = |f: Family| {
            let [current, deprecated] = sums[f as usize];
            if current.n > 0 {
                current
            } else {
                deprecated
            }
        };
        let counted = |f: Family| pick(f).get().and_then(count);
        VllmMetrics {
            model_names,
            engines: engines.len().max(usize::from(unlabelled)),
            kv_cache_usage: pick(Family::Usage).mean(),
            num_gpu_blocks: blocks.get().and_then(count),
            block_size,
            gpu_memory_utilization,
            negative_usage,
            model_weights_bytes: counted(Family::Weights),
            num_requests_running: counted(Family::Running),
            num_requests_waiting: counted(Family::Waiting),
            prefix_cache_queries: counted(Family::PrefixQueries),
            prefix_cache_hits: counted(Family::PrefixHits),
            mm_cache_queries: counted(Family::MmQueries),
            mm_cache_hits: counted(Family::MmHits),
            num_preemptions: counted(Family::Preemptions),
        }
    }

    /// Whether the text carried any of vLLM's figures (a server that is not vLLM carries none).
    pub fn is_vllm(&self) -> bool {
        self.engines > 0
    }

    /// KV blocks held by requests: `round(usage × num_gpu_blocks)`.
    pub fn blocks_in_use(&self) -> Option<u64> {
        let usage = self.kv_cache_usage?.clamp(0.0, 1.0);
        Some((usage * self.num_gpu_blocks? as f64).round() as u64)
    }

    /// Tokens the KV cache holds when full: `num_gpu_blocks × block_size`.
    pub fn kv_cache_tokens(&self) -> Option<u64> {
        self.num_gpu_blocks?.checked_mul(self.block_size?)
    }

    /// Prefix-cache hits over queries (tokens) so far; `None` before the first query.
    pub fn prefix_cache_hit_rate(&self) -> Option<f64> {
        hit_rate(self.prefix_cache_hits?, self.prefix_cache_queries?)
    }

    /// Multimodal (processor) cache hits over queries (items) so far; `None` before the first.
    pub fn mm_cache_hit_rate(&self) -> Option<f64> {
        hit_rate(self.mm_cache_hits?, self.mm_cache_queries?)
    }
}

fn hit_rate(hits: u64, queries: u64) -> Option<f64> {
    (queries > 0).then(|| hits as f64 / queries as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM 0.11-era scrape of Qwen3-VL-8B-Instruct with two data-parallel engines: prometheus_client's
    /// layout (sorted labels, `_total` and `_created` series, Go-style floats) and the full
    /// `cache_config_info` label set of a real server.
    const FIXTURE: &str = include_str!("../../../tests/e2e/fixtures/vllm_metrics.txt");

    #[test]
    fn reads_the_fixture_summed_over_engines() {
        let m = VllmMetrics::parse(FIXTURE);
        assert_eq!(m.model_names, ["Qwen/Qwen3-VL-8B-Instruct"]);
        assert_eq!(m.engines, 2);
        assert_eq!(m.num_gpu_blocks, Some(2 * 34470));
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.kv_cache_tokens(), Some(2 * 551_520));
        let usage = m.kv_cache_usage.unwrap();
        assert!((usage - (2480.0 + 1411.0) / 2.0 / 34470.0).abs() < 1e-12, "{usage}");
        assert_eq!(m.blocks_in_use(), Some(2480 + 1411));
        assert_eq!(m.num_requests_running, Some(5));
        assert_eq!(m.num_requests_waiting, Some(1), "not the _by_reason series");
        assert_eq!(m.prefix_cache_queries, Some(12_658_431 + 9_871_204));
        assert_eq!(m.prefix_cache_hits, Some(4_837_376 + 3_613_968));
        assert_eq!(m.mm_cache_queries, Some(4113 + 3980));
        assert_eq!(m.mm_cache_hits, Some(1290 + 1201));
        assert_eq!(m.num_preemptions, Some(11), "not the _created timestamps");
        let rate = m.prefix_cache_hit_rate().unwrap();
        assert!((rate - 8_451_344.0 / 22_529_635.0).abs() < 1e-12);
        assert!((m.mm_cache_hit_rate().unwrap() - 2491.0 / 8093.0).abs() < 1e-12);
        assert!(m.is_vllm());
    }

    #[test]
    fn reads_the_deprecated_names_where_the_current_ones_are_absent() {
        // vLLM 0.8 (V0): no `engine` label, `gpu_` names, no mm-cache counters.
        let old = r#"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="False",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="9362",num_gpu_blocks="81767",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 0.25
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 400.0
vllm:gpu_prefix_cache_hits_total{model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 100.0
"#;
        let m = VllmMetrics::parse(old);
        assert_eq!(m.engines, 1);
        assert_eq!(m.kv_cache_usage, Some(0.25));
        assert_eq!(m.blocks_in_use(), Some(20442), "round(0.25 × 81767)");
        assert_eq!(m.prefix_cache_hit_rate(), Some(0.25));
        assert_eq!(m.num_requests_waiting, None);
        assert_eq!(m.mm_cache_queries, None);
        assert_eq!(m.mm_cache_hit_rate(), None);
        // vLLM 0.9–0.10 print both names with the same values: they are not added up.
        let both = "vllm:gpu_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
                    vllm:prefix_cache_queries_total{engine=\"0\"} 10\nvllm:gpu_prefix_cache_queries_total{engine=\"0\"} 10\n";
        let m = VllmMetrics::parse(both);
        assert_eq!((m.kv_cache_usage, m.prefix_cache_queries), (Some(0.5), Some(10)));
    }

    #[test]
    fn samples_with_escapes_timestamps_and_odd_spacing() {
        let s = parse_sample(r#"  m_total{a="x\"y\\z\nw", b = "{,}" ,} 3.5e+02 1712345678000 "#).unwrap();
        assert_eq!(s.name, "m_total");
        assert_eq!(s.label("a"), Some("x\"y\\z\nw"));
        assert_eq!(s.label("b"), Some("{,}"));
        assert_eq!(s.value, 350.0);
        assert_eq!(parse_sample("up 1").map(|s| s.value), Some(1.0));
        assert!(parse_sample("x +Inf").unwrap().value.is_infinite());
        for junk in [
            "",
            "# HELP up x",
            "{a=\"b\"} 1",
            "m{a=\"b} 1",
            "m{a=b} 1",
            "m{} x",
            "9m 1",
            "m{a=\"b\"",
            "m",
        ] {
            assert_eq!(parse_sample(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn text_without_vllm_figures_is_not_vllm() {
        let m = VllmMetrics::parse("<!doctype html><p>not found</p>\n");
        assert!(!m.is_vllm());
        assert_eq!(m, VllmMetrics::default());
        // Unusable values are skipped rather than counted.
        let m = VllmMetrics::parse(
            "vllm:kv_cache_usage_perc NaN\nvllm:num_preemptions_total -3\nvllm:cache_config_info{num_gpu_blocks=\"None\"} 1\n",
        );
        assert!(!m.is_vllm());
        assert_eq!(m.blocks_in_use(), None);
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod proptests {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn any_text_parses_without_panicking(text in "(?s).{0,400}") {
                let m = VllmMetrics::parse(&text);
                let _ = (m.blocks_in_use(), m.kv_cache_tokens(), m.prefix_cache_hit_rate());
            }

            #[test]
            fn cut_and_spliced_fixture_lines_parse_without_panicking(
                cuts in prop::collection::vec((0usize..20_000, 0usize..300, "\\PC{0,8}"), 1..8),
            ) {
                let mut text = super::FIXTURE.to_string();
                for (at, len, insert) in cuts {
                    let start = text.floor_char_boundary(at.min(text.len()));
                    let end = text.floor_char_boundary((start + len).min(text.len()));
                    text.replace_range(start..end, &insert);
                }
                let m = VllmMetrics::parse(&text);
                let _ = (m.blocks_in_use(), m.kv_cache_tokens(), m.mm_cache_hit_rate());
            }

            #[test]
            fn written_labels_read_back(value in "\\PC{0,20}", x in 0u32..1_000_000) {
                let escaped = value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
                let line = format!("vllm:num_preemptions_total{{engine=\"0\",model_name=\"{escaped}\"}} {x}.0");
                let s = parse_sample(&line).unwrap();
                prop_assert_eq!(s.label("model_name"), Some(value.as_str()));
                prop_assert_eq!(VllmMetrics::parse(&line).num_preemptions, Some(u64::from(x)));
            }
        }
    }
}
