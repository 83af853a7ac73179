//! The aggregates of `vllm bench serve` (`calculate_metrics`) and its result block and JSON keys,
//! plus the image tokens of the input, which vLLM does not count.

use super::client::RequestOutput;
use super::dataset::BenchRequest;
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::fmt::Write;

/// A latency metric that `--percentile-metrics` can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Time to first token.
    Ttft,
    /// Time per output token, the first token excluded.
    Tpot,
    /// Inter-token latency: the gaps between streamed chunks.
    Itl,
    /// End-to-end latency.
    E2el,
}

impl Metric {
    /// In vLLM's print order.
    const ALL: [Metric; 4] = [Metric::Ttft, Metric::Tpot, Metric::Itl, Metric::E2el];

    /// The attribute name (`ttft`), used in flags and JSON keys.
    fn key(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft",
            Metric::Tpot => "tpot",
            Metric::Itl => "itl",
            Metric::E2el => "e2el",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Metric::Ttft => "TTFT",
            Metric::Tpot => "TPOT",
            Metric::Itl => "ITL",
            Metric::E2el => "E2EL",
        }
    }

    fn header(self) -> &'static str {
        match self {
            Metric::Ttft => "Time to First Token",
            Metric::Tpot => "Time per Output Token (excl. 1st token)",
            Metric::Itl => "Inter-token Latency",
            Metric::E2el => "End-to-end Latency",
        }
    }

    fn parse(name: &str) -> Result<Metric> {
        Metric::ALL
            .into_iter()
            .find(|m| m.key() == name)
            .with_context(|| format!("unknown metric {name:?}: expected one of ttft, tpot, itl, e2el"))
    }
}

/// `--percentile-metrics ttft,tpot,itl`.
pub fn parse_metrics(list: &str) -> Result<Vec<Metric>> {
    list.split(',').map(|m| Metric::parse(m.trim())).collect()
}

/// `--metric-percentiles 50,90,99`.
pub fn parse_percentiles(list: &str) -> Result<Vec<f64>> {
    list.split(',')
        .map(|p| {
            let v: f64 = p.trim().parse().with_context(|| format!("bad percentile {p:?}"))?;
            if !(0.0..=100.0).contains(&v) {
                bail!("percentile {v} is outside 0..100");
            }
            Ok(v)
        })
        .collect()
}

/// Service-level objectives of `--goodput`, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slos {
    /// Most TTFT a good request may have.
    pub ttft: Option<f64>,
    /// Most TPOT.
    pub tpot: Option<f64>,
    /// Most E2EL.
    pub e2el: Option<f64>,
}

/// `--goodput ttft:300 tpot:50 e2el:2000`; `None` when the flag is absent.
pub fn parse_goodput(items: &[String]) -> Result<Option<Slos>> {
    if items.is_empty() {
        return Ok(None);
    }
    let mut slos = Slos::default();
    for item in items {
        let (name, value) = item
            .split_once(':')
            .with_context(|| format!("--goodput takes KEY:VALUE pairs in ms, got {item:?}"))?;
        let value: f64 = value
            .parse()
            .ok()
            .filter(|v: &f64| *v >= 0.0)
            .with_context(|| format!("--goodput {item}: the objective must be a non-negative number of ms"))?;
        let slot = match name {
            "ttft" => &mut slos.ttft,
            "tpot" => &mut slos.tpot,
            "e2el" => &mut slos.e2el,
            _ => bail!("--goodput {item}: the objective's name must be one of ttft, tpot, e2el"),
        };
        *slot = Some(value);
    }
    Ok(Some(slos))
}

/// numpy's default `percentile` (linear interpolation between closest ranks); 0 for no values, as
/// vLLM's `np.percentile(xs or 0, p)`.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Mean, median, population standard deviation and the requested percentiles of one metric, in ms.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub median: f64,
    /// Standard deviation (numpy's, ddof 0).
    pub std: f64,
    /// `(p, value)` per `--metric-percentiles`.
    pub percentiles: Vec<(f64, f64)>,
}

impl Stats {
    fn of_seconds(values: &[f64], percentiles: &[f64]) -> Stats {
        let n = values.len().max(1) as f64;
        let mean = values.iter().sum::<f64>() / n;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        Stats {
            mean: mean * 1000.0,
            median: percentile(values, 50.0) * 1000.0,
            std: var.sqrt() * 1000.0,
            percentiles: percentiles
                .iter()
                .map(|&p| (p, percentile(values, p) * 1000.0))
                .collect(),
        }
    }
}

/// Everything `calculate_metrics` returns, plus the image tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    /// Successful requests.
    pub completed: usize,
    /// Failed requests.
    pub failed: usize,
    /// Text tokens of the successful prompts (the prompt alone: no chat template, no image).
    pub total_input: usize,
    /// Image tokens of the successful prompts with an image, from the server's usage (its prompt
    /// tokens less the templated text's); `None` if it reported none.
    pub total_input_image: Option<usize>,
    /// Generated tokens.
    pub total_output: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Requests within every `--goodput` objective per second.
    pub request_goodput: f64,
    /// Generated tokens per second.
    pub output_throughput: f64,
    /// (Text input + generated) tokens per second.
    pub total_token_throughput: f64,
    /// Most streamed chunks in one 1-second bucket.
    pub max_output_tokens_per_s: f64,
    /// Most requests active in one 1-second bucket.
    pub max_concurrent_requests: usize,
    /// Generated tokens per request (0 for a failed one).
    pub output_lens: Vec<usize>,
    /// Image tokens per request (0 without an image; `None` for a failed one or without usage).
    pub input_image_lens: Vec<Option<usize>>,
    /// Statistics per metric, in [`Metric::ALL`] order.
    stats: [Stats; 4],
}

impl Metrics {
    /// The statistics of one metric.
    pub fn stats(&self, metric: Metric) -> &Stats {
        &self.stats[metric as usize]
    }
}

/// vLLM's `calculate_metrics`. `count_tokens` re-tokenises the text of a request whose server sent
/// no `usage.completion_tokens`.
pub fn calculate(
    requests: &[BenchRequest],
    outputs: &[RequestOutput],
    duration: f64,
    percentiles: &[f64],
    slos: Option<&Slos>,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Metrics {
    let mut output_lens = Vec::with_capacity(outputs.len());
    let mut input_image_lens = Vec::with_capacity(outputs.len());
    let (mut total_input, mut completed, mut good) = (0, 0, 0);
    let (mut ttfts, mut tpots, mut itls, mut e2els) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (req, out) in requests.iter().zip(outputs) {
        if !out.success {
            output_lens.push(0);
            input_image_lens.push(None);
            continue;
        }
        let output_len = out
            .output_tokens
            .filter(|&n| n > 0)
            .unwrap_or_else(|| count_tokens(&out.generated_text));
        output_lens.push(output_len);
        let image_tokens = match req.image {
            Some(_) => out.prompt_tokens.map(|p| p.saturating_sub(req.chat_text_len)),
            None => Some(0),
        };
        input_image_lens.push(image_tokens);
        total_input += req.prompt_len;
        // A request with one token has no TPOT; for goodput it counts as 0.
        let tpot = if output_len > 1 {
            let t = (out.latency - out.ttft) / (output_len - 1) as f64;
            tpots.push(t);
            t
        } else {
            0.0
        };
        itls.extend_from_slice(&out.itl);
        ttfts.push(out.ttft);
        e2els.push(out.latency);
        completed += 1;
        if let Some(s) = slos {
            let within = |slo: Option<f64>, seconds: f64| slo.is_none_or(|ms| seconds <= ms / 1000.0);
            if within(s.ttft, out.ttft) && within(s.tpot, tpot) && within(s.e2el, out.latency) {
                good += 1;
            }
        }
    }
    let (max_output_tokens_per_s, max_concurrent_requests) = peaks(outputs);
    let total_output: usize = output_lens.iter().sum();
    let reported: Vec<usize> = input_image_lens.iter().flatten().copied().collect();
    Metrics {
        completed,
        failed: outputs.len() - completed,
        total_input,
        total_input_image: (!reported.is_empty()).then(|| reported.iter().sum()),
        total_output,
        request_throughput: completed as f64 / duration,
        request_goodput: good as f64 / duration,
        output_throughput: total_output as f64 / duration,
        total_token_throughput: (total_input + total_output) as f64 / duration,
        max_output_tokens_per_s,
        max_concurrent_requests,
        output_lens,
        input_image_lens,
        stats: [&ttfts, &tpots, &itls, &e2els].map(|v| Stats::of_seconds(v, percentiles)),
    }
}

/// Peak output tokens per second and peak concurrent requests over 1-second buckets, with token
/// times rebuilt as `start + ttft + cumulative ITL` (one per streamed chunk), as vLLM does.
fn peaks(outputs: &[RequestOutput]) -> (f64, usize) {
    let ok: Vec<&RequestOutput> = outputs.iter().filter(|o| o.success).collect();
    let Some(min_start) = ok.iter().map(|o| o.start_time).min_by(f64::total_cmp) else {
        return (0.0, 0);
    };
    let max_end = ok.iter().map(|o| o.start_time + o.latency).fold(f64::MIN, f64::max);
    let buckets = (max_end - min_start).ceil() as usize + 1;
    let mut tokens = vec![0usize; buckets];
    let mut active = vec![0usize; buckets];
    for o in ok {
        let mut t = o.start_time + o.ttft;
        for gap in std::iter::once(0.0).chain(o.itl.iter().copied()) {
            t += gap;
            if let Some(b) = tokens.get_mut((t - min_start) as usize) {
                *b += 1;
            }
        }
        let first = (o.start_time - min_start) as usize;
        let last = (o.start_time + o.latency - min_start) as usize;
        active[first..=last.min(buckets - 1)].iter_mut().for_each(|a| *a += 1);
    }
    let max = |v: &[usize]| v.iter().copied().max().unwrap_or(0);
    (max(&tokens) as f64, max(&active))
}

/// How the run was configured, as the result block shows it.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// `--max-concurrency`.
    pub max_concurrency: Option<usize>,
    /// `--request-rate` (infinite by default).
    pub request_rate: f64,
    /// Whether `--goodput` was given.
    pub goodput: bool,
    /// `--percentile-metrics`.
    pub selected: Vec<Metric>,
}

fn row(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{label:<40} {value:<10}");
}

fn row_f(out: &mut String, label: &str, value: f64) {
    let _ = writeln!(out, "{label:<40} {value:<10.2}");
}

/// vLLM's result block (0.12+, with "Failed requests:"; one more line for the image tokens) and
/// the aggregate keys of its result JSON.
pub fn report(m: &Metrics, duration: f64, info: &RunInfo) -> (String, Map<String, Value>) {
    let mut out = String::new();
    let _ = writeln!(out, "{:=^50}", " Serving Benchmark Result ");
    row(&mut out, "Successful requests:", m.completed);
    row(&mut out, "Failed requests:", m.failed);
    if let Some(c) = info.max_concurrency {
        row(&mut out, "Maximum request concurrency:", c);
    }
    if info.request_rate.is_finite() {
        row_f(&mut out, "Request rate configured (RPS):", info.request_rate);
    }
    row_f(&mut out, "Benchmark duration (s):", duration);
    row(&mut out, "Total input tokens:", m.total_input);
    match m.total_input_image {
        Some(n) => row(&mut out, "Total input image tokens:", n),
        None => row(&mut out, "Total input image tokens:", "n/a"),
    }
    row(&mut out, "Total generated tokens:", m.total_output);
    row_f(&mut out, "Request throughput (req/s):", m.request_throughput);
    if info.goodput {
        row_f(&mut out, "Request goodput (req/s):", m.request_goodput);
    }
    row_f(&mut out, "Output token throughput (tok/s):", m.output_throughput);
    row_f(
        &mut out,
        "Peak output token throughput (tok/s):",
        m.max_output_tokens_per_s,
    );
    row_f(&mut out, "Peak concurrent requests:", m.max_concurrent_requests as f64);
    row_f(&mut out, "Total Token throughput (tok/s):", m.total_token_throughput);

    let mut result = Map::new();
    let mut put = |k: &str, v: Value| {
        result.insert(k.to_string(), v);
    };
    put("duration", json!(duration));
    put("completed", json!(m.completed));
    put("failed", json!(m.failed));
    put("total_input_tokens", json!(m.total_input));
    put("total_input_image_tokens", json!(m.total_input_image));
    put("total_output_tokens", json!(m.total_output));
    put("request_throughput", json!(m.request_throughput));
    put(
        "request_goodput",
        if info.goodput {
            json!(m.request_goodput)
        } else {
            Value::Null
        },
    );
    put("output_throughput", json!(m.output_throughput));
    put("total_token_throughput", json!(m.total_token_throughput));
    put("max_output_tokens_per_s", json!(m.max_output_tokens_per_s));
    put("max_concurrent_requests", json!(m.max_concurrent_requests));
    for metric in Metric::ALL.into_iter().filter(|x| info.selected.contains(x)) {
        let (key, name, s) = (metric.key(), metric.name(), m.stats(metric));
        let _ = writeln!(out, "{:-^50}", metric.header());
        row_f(&mut out, &format!("Mean {name} (ms):"), s.mean);
        row_f(&mut out, &format!("Median {name} (ms):"), s.median);
        put(&format!("mean_{key}_ms"), json!(s.mean));
        put(&format!("median_{key}_ms"), json!(s.median));
        put(&format!("std_{key}_ms"), json!(s.std));
        for &(p, value) in &s.percentiles {
            // Python's `str(int(p)) if int(p) == p else str(p)`.
            let word = if p.fract() == 0.0 {
                format!("{}", p as u64)
            } else {
                format!("{p}")
            };
            row_f(&mut out, &format!("P{word} {name} (ms):"), value);
            put(&format!("p{word}_{key}_ms"), json!(value));
        }
    }
    let _ = writeln!(out, "{}", "=".repeat(50));
    (out, result)
}

/// The per-request lists of vLLM's result JSON (`input_lens`, `output_lens`, `ttfts`, `itls`,
/// `generated_texts`, `errors`) and kvlens's own (`e2els`, `input_image_lens`).
pub fn per_request(requests: &[BenchRequest], outputs: &[RequestOutput], m: &Metrics) -> Map<String, Value> {
    let mut result = Map::new();
    let col = |f: &dyn Fn(&RequestOutput) -> Value| Value::Array(outputs.iter().map(f).collect());
    result.insert(
        "input_lens".into(),
        Value::Array(requests.iter().map(|r| json!(r.prompt_len)).collect()),
    );
    result.insert("output_lens".into(), json!(m.output_lens));
    result.insert("input_image_lens".into(), json!(m.input_image_lens));
    result.insert("ttfts".into(), col(&|o| json!(o.ttft)));
    result.insert("itls".into(), col(&|o| json!(o.itl)));
    result.insert("e2els".into(), col(&|o| json!(o.latency)));
    result.insert("generated_texts".into(), col(&|o| json!(o.generated_text)));
    result.insert("errors".into(), col(&|o| json!(o.error)));
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt_len: usize, chat_text_len: usize) -> BenchRequest {
        BenchRequest {
            prompt: String::new(),
            prompt_len,
            chat_text_len,
            output_len: 16,
            image: Some("data:image/png;base64,".into()),
        }
    }

    /// A request that started at `start`, streamed its first chunk after `ttft` and then chunks
    /// after each gap of `itl`, the usage chunk last.
    fn out(start: f64, ttft: f64, itl: &[f64], tokens: Option<usize>) -> RequestOutput {
        RequestOutput {
            success: true,
            start_time: start,
            ttft,
            itl: itl.to_vec(),
            latency: ttft + itl.iter().sum::<f64>(),
            output_tokens: tokens,
            prompt_tokens: Some(100),
            generated_text: "a b c".into(),
            ..RequestOutput::default()
        }
    }

    fn failed() -> RequestOutput {
        RequestOutput {
            error: "Bad Request".into(),
            ..RequestOutput::default()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentiles_as_numpy() {
        let v = [15.0, 20.0, 35.0, 40.0, 50.0];
        // numpy.percentile(v, p) for these p.
        for (p, want) in [
            (0.0, 15.0),
            (40.0, 29.0),
            (50.0, 35.0),
            (90.0, 46.0),
            (99.0, 49.6),
            (100.0, 50.0),
        ] {
            assert!(close(percentile(&v, p), want), "p{p}: {}", percentile(&v, p));
        }
        assert!(close(percentile(&[3.0, 1.0, 2.0, 4.0], 50.0), 2.5));
        assert_eq!(percentile(&[], 99.0), 0.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    #[test]
    fn tpot_excludes_the_first_token_and_itl_keeps_every_gap() {
        // A: ttft 0.1, then chunks after 0.02, 0.03, 0.05 → latency 0.2, 4 tokens → TPOT 0.1/3.
        // B: ttft 0.3, one more chunk after 0.1, but usage says 6 tokens (chunks carry several).
        // C: one token only: no TPOT.
        let outs = [
            out(0.0, 0.1, &[0.02, 0.03, 0.05], Some(4)),
            out(0.5, 0.3, &[0.1], Some(6)),
            out(1.0, 0.2, &[], Some(1)),
        ];
        let reqs = [req(10, 20), req(11, 21), req(12, 22)];
        let m = calculate(&reqs, &outs, 2.0, &[50.0, 99.0], None, &|_| unreachable!());
        assert_eq!((m.completed, m.failed, m.total_input, m.total_output), (3, 0, 33, 11));
        assert_eq!(m.input_image_lens, vec![Some(80), Some(79), Some(78)]);
        assert_eq!(m.total_input_image, Some(237));
        let tpot = m.stats(Metric::Tpot);
        let (a, b) = (0.1 / 3.0 * 1000.0, 0.1 / 5.0 * 1000.0);
        assert!(close(tpot.mean, (a + b) / 2.0), "{tpot:?}");
        let itl = m.stats(Metric::Itl);
        assert!(close(itl.mean, (20.0 + 30.0 + 50.0 + 100.0) / 4.0));
        assert!(close(itl.median, 40.0));
        let ttft = m.stats(Metric::Ttft);
        assert!(close(ttft.mean, 200.0) && close(ttft.median, 200.0));
        assert!(close(ttft.std, (20000.0f64 / 3.0).sqrt()), "{}", ttft.std);
        assert!(close(ttft.percentiles[1].1, 298.0));
        let e2el = m.stats(Metric::E2el);
        assert!(close(e2el.mean, (200.0 + 400.0 + 200.0) / 3.0));
        assert!(close(m.request_throughput, 1.5));
        assert!(close(m.output_throughput, 5.5));
        assert!(close(m.total_token_throughput, 22.0));
    }

    #[test]
    fn failed_requests_count_nothing_and_missing_usage_retokenises() {
        let mut no_usage = out(0.0, 0.1, &[0.1], None);
        no_usage.prompt_tokens = None;
        let outs = [failed(), no_usage];
        let m = calculate(&[req(5, 9), req(7, 9)], &outs, 1.0, &[99.0], None, &|t| {
            t.split_whitespace().count()
        });
        assert_eq!((m.completed, m.failed, m.total_input, m.total_output), (1, 1, 7, 3));
        assert_eq!(m.output_lens, vec![0, 3]);
        assert_eq!(m.total_input_image, None);
        let all_failed = calculate(&[req(5, 9)], &[failed()], 1.0, &[99.0], None, &|_| 0);
        assert_eq!(all_failed.stats(Metric::Ttft).mean, 0.0);
        assert_eq!(all_failed.stats(Metric::Ttft).percentiles, vec![(99.0, 0.0)]);
        assert_eq!(
            (all_failed.max_output_tokens_per_s, all_failed.max_concurrent_requests),
            (0.0, 0)
        );
    }

    #[test]
    fn goodput_counts_requests_within_every_objective() {
        let outs = [
            out(0.0, 0.1, &[0.02, 0.02], Some(3)), // ttft 100 ms, tpot 20 ms, e2el 140 ms
            out(0.0, 0.3, &[0.02], Some(2)),       // ttft 300 ms
            out(0.0, 0.1, &[0.2], Some(2)),        // tpot 200 ms
            out(0.0, 0.1, &[], Some(1)),           // one token: TPOT counts as 0
        ];
        let reqs = [req(1, 1), req(1, 1), req(1, 1), req(1, 1)];
        let slos = parse_goodput(&["ttft:150".into(), "tpot:50".into()]).unwrap().unwrap();
        let m = calculate(&reqs, &outs, 2.0, &[99.0], Some(&slos), &|_| 0);
        assert!(close(m.request_goodput, 1.0), "{}", m.request_goodput);
        let e2el = parse_goodput(&["e2el:139".into()]).unwrap().unwrap();
        let m = calculate(&reqs, &outs, 1.0, &[99.0], Some(&e2el), &|_| 0);
        assert!(
            close(m.request_goodput, 1.0),
            "only the one-token request ends within 139 ms"
        );
        assert!(parse_goodput(&["ttfb:1".into()]).is_err());
        assert!(parse_goodput(&["ttft:-1".into()]).is_err());
        assert!(parse_goodput(&["ttft".into()]).is_err());
        assert_eq!(parse_goodput(&[]).unwrap(), None);
    }

    #[test]
    fn peaks_over_one_second_buckets() {
        // Request 1: 0.0 → first chunk 0.5, then 0.6, 0.7, 1.2; request 2: 0.9 → 1.1, 1.3, 2.5.
        let outs = [
            out(0.0, 0.5, &[0.1, 0.1, 0.5], Some(4)),
            out(0.9, 0.2, &[0.2, 1.2], Some(3)),
        ];
        let m = calculate(&[req(1, 1), req(1, 1)], &outs, 3.0, &[99.0], None, &|_| 0);
        // Bucket 0: 0.5, 0.6, 0.7; bucket 1: 1.2, 1.1, 1.3; bucket 2: 2.5 → peak 3.
        assert_eq!(m.max_output_tokens_per_s, 3.0);
        // Request 1 spans buckets 0–1, request 2 spans 0–2.
        assert_eq!(m.max_concurrent_requests, 2);
    }

    #[test]
    fn result_block_has_vllms_lines() {
        let outs = [out(0.0, 0.1, &[0.02, 0.03], Some(3))];
        let m = calculate(&[req(10, 12)], &outs, 1.0, &[50.0, 99.9], None, &|_| 0);
        let info = RunInfo {
            max_concurrency: Some(4),
            request_rate: 8.0,
            goodput: true,
            selected: parse_metrics("ttft,tpot,itl,e2el").unwrap(),
        };
        let (block, json) = report(&m, 1.0, &info);
        let lines: Vec<&str> = block.lines().collect();
        assert_eq!(lines[0], "============ Serving Benchmark Result ============");
        assert_eq!(lines[1], format!("{:<40} {:<10}", "Successful requests:", 1));
        let line = |label: &str, value: &str| format!("\n{label:<40} {value:<10}\n");
        assert_eq!(
            format!("\n{}\n", lines[4]),
            line("Request rate configured (RPS):", "8.00")
        );
        assert!(block.contains("\n---------------Time to First Token----------------\n"));
        assert!(block.contains("\n-----Time per Output Token (excl. 1st token)------\n"));
        assert!(block.contains("\n---------------Inter-token Latency----------------\n"));
        assert!(block.contains("\n----------------End-to-end Latency----------------\n"));
        assert!(block.contains(&line("Mean TTFT (ms):", "100.00")));
        assert!(block.contains("\nP99.9 E2EL (ms):"));
        assert!(block.contains(&line("Peak concurrent requests:", "1.00")));
        assert!(block.contains(&line("Total input image tokens:", "88")));
        assert_eq!(*lines.last().unwrap(), "=".repeat(50));
        assert!(lines.iter().all(|l| l.len() == 50 || l.len() == 51), "{block}");
        for key in [
            "p50_ttft_ms",
            "p99.9_e2el_ms",
            "std_itl_ms",
            "median_tpot_ms",
            "request_goodput",
        ] {
            assert!(json.contains_key(key), "{key}");
        }
        let plain = RunInfo {
            max_concurrency: None,
            request_rate: f64::INFINITY,
            goodput: false,
            selected: parse_metrics("ttft,tpot,itl").unwrap(),
        };
        let (block, json) = report(&m, 1.0, &plain);
        for absent in [
            "Maximum request concurrency",
            "Request rate configured",
            "goodput",
            "E2EL",
        ] {
            assert!(!block.contains(absent), "{absent}");
        }
        assert_eq!(json["request_goodput"], Value::Null);
        assert!(parse_metrics("ttft,xyz").is_err());
        assert!(parse_percentiles("50,101").is_err());
    }
}
