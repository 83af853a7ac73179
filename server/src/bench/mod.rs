//! `kvlens bench serve`: `vllm bench serve` for any OpenAI-compatible chat server (kvlens, vLLM, …):
//! the same arrival process, per-request timing, aggregates, result block and result JSON
//! (vLLM's <https://github.com/vllm-project/vllm/blob/main/vllm/benchmarks/serve.py> and
//! <https://github.com/vllm-project/vllm/blob/main/vllm/benchmarks/lib/endpoint_request_func.py>),
//! plus the image tokens of the input, a `synthetic-vision` dataset, and — against kvlens — a
//! memory timeline from `/v1/memory` that can be plotted.

mod arrival;
mod bandwidth;
mod client;
mod dataset;
#[cfg(feature = "wgpu")]
mod kernels;
mod metrics;
mod plot;
mod serve;
mod soak;
mod synth;
mod timeline;
mod tokens;

use crate::usage;
use anyhow::{bail, Context, Result};
use dataset::{DatasetName, DatasetSpec};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `kvlens bench …`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, clap::Subcommand)]
enum BenchCommand {
    /// Benchmark a running OpenAI-compatible server as `vllm bench serve` does (streaming chat
    /// completions, Poisson/gamma arrivals), with a memory timeline when the server is kvlens.
    Serve(Box<ServeBenchArgs>),
    /// Redraw the memory timeline of a result saved by `bench serve --save-result`.
    Plot(PlotArgs),
    /// Soak a kvlens server: many streaming clients for a fixed time (text and images, hang-ups,
    /// bad input), then check that nothing leaked and memory came back.
    Soak(soak::SoakArgs),
    /// The wgpu backend's matmul kernels against the CPU backend at Qwen3-VL-2B's shapes: decode
    /// GEMV in GB/s and prefill GEMM in GFLOP/s, with f32 and f16 weights (no server involved).
    #[cfg(feature = "wgpu")]
    Kernels(kernels::KernelsArgs),
    /// The host's memory read bandwidth (all cores, a buffer far above the caches): the roofline
    /// of a decode step that reads every weight once.
    Bandwidth(bandwidth::BandwidthArgs),
}

/// Flags of `kvlens bench plot`.
#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// The result JSON.
    result: PathBuf,
    /// The figure to write (.svg or .png).
    #[arg(long)]
    plot: PathBuf,
}

/// Flags of `kvlens bench serve`, spelled as vLLM's.
#[derive(Debug, clap::Args)]
pub struct ServeBenchArgs {
    /// Server URL (http://HOST:PORT); overrides --host and --port.
    #[arg(long)]
    base_url: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long, default_value = "/v1/chat/completions")]
    endpoint: String,
    /// The only request format: streaming chat completions.
    #[arg(long, default_value = "openai-chat", value_parser = ["openai-chat"])]
    backend: String,
    /// Model name sent in the requests [default: the first of the server's /v1/models].
    #[arg(long)]
    model: Option<String>,
    /// Checkpoint directory with tokenizer.json and the chat template, to count prompt tokens as
    /// vLLM does [default: --model when it is a directory, else the server's /tokenize].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "synthetic-vision")]
    dataset_name: DatasetName,
    /// JSON-lines file for `--dataset-name jsonl`.
    #[arg(long)]
    dataset_path: Option<PathBuf>,
    #[arg(long, default_value_t = 1000)]
    num_prompts: usize,
    /// Requests per second ("inf" sends all at once).
    #[arg(long, default_value_t = f64::INFINITY)]
    request_rate: f64,
    /// Gamma shape of the gaps between arrivals: 1 is a Poisson process, below 1 burstier.
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Most requests in flight at once (later arrivals wait).
    #[arg(long)]
    max_concurrency: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output tokens of every request [default: the dataset's, else 128].
    #[arg(long, visible_aliases = ["hf-output-len", "random-output-len"])]
    output_len: Option<usize>,
    /// Prompt tokens of `--dataset-name random`.
    #[arg(long, default_value_t = 1024)]
    random_input_len: usize,
    /// Share of synthetic-vision requests that reuse an earlier request's image.
    #[arg(long, default_value_t = 0.2)]
    image_reuse_ratio: f64,
    /// Ask the server to ignore end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Metrics with percentiles in the result: ttft, tpot, itl, e2el.
    #[arg(long, default_value = "ttft,tpot,itl")]
    percentile_metrics: String,
    /// Percentiles to report, e.g. 50,90,99.
    #[arg(long, default_value = "99")]
    metric_percentiles: String,
    /// Service-level objectives in ms (KEY:VALUE with KEY ttft, tpot or e2el): adds the goodput.
    #[arg(long, num_args = 1..)]
    goodput: Vec<String>,
    /// Send the first request until it succeeds, for at most this long, before the run (0 skips).
    #[arg(long, default_value_t = 600)]
    ready_check_timeout_sec: u64,
    /// Milliseconds between readings of the server's /v1/memory.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    memory_interval_ms: u64,
    /// Write the result JSON (vLLM's keys, plus the memory timeline).
    #[arg(long)]
    save_result: bool,
    /// Directory for the result JSON.
    #[arg(long)]
    result_dir: Option<PathBuf>,
    /// Result JSON file name [default: openai-chat-{rate}qps[-concurrency{c}]-{model}-{date}.json].
    #[arg(long)]
    result_filename: Option<String>,
    /// Keep sampling /v1/memory this many seconds after the last request (to see what stays allocated).
    #[arg(long, default_value_t = 0.0)]
    after_run_s: f64,
    /// With --after-run-s: POST /reset_encoder_cache halfway through it (the timeline shows what it frees).
    #[arg(long, requires = "after_run_s")]
    reset_encoder_cache_after_run: bool,
    /// Plot the memory timeline (.svg or .png).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    disable_tqdm: bool,
}

/// Runs `kvlens bench …`.
pub fn run(args: &BenchArgs) -> Result<()> {
    match &args.command {
        BenchCommand::Serve(a) => bench_serve(a),
        BenchCommand::Plot(a) => replot(a),
        BenchCommand::Soak(a) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(soak::run(a)),
        #[cfg(feature = "wgpu")]
        BenchCommand::Kernels(a) => kernels::run(a),
        BenchCommand::Bandwidth(a) => bandwidth::run(a),
    }
}

fn replot(a: &PlotArgs) -> Result<()> {
    let text =
        std::fs::read_to_string(&a.result).map_err(|e| usage(format!("cannot read {}: {e}", a.result.display())))?;
    let result: Value = serde_json::from_str(&text).map_err(|e| usage(format!("{}: {e}", a.result.display())))?;
    let timeline: timeline::Timeline = result
        .get("timeline")
        .cloned()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| usage(format!("{}: timeline: {e}", a.result.display())))?
        .ok_or_else(|| usage(format!("{} has no timeline", a.result.display())))?;
    draw_timeline(&timeline, &a.plot)
}

fn draw_timeline(timeline: &timeline::Timeline, path: &Path) -> Result<()> {
    if timeline.samples.is_empty() {
        println!("No memory samples: {} not drawn", path.display());
    } else {
        plot::draw(&timeline.samples, &timeline.events, path)?;
        println!("Memory timeline drawn to {}", path.display());
    }
    Ok(())
}

fn bench_serve(a: &ServeBenchArgs) -> Result<()> {
    if a.num_prompts == 0 {
        return Err(usage("--num-prompts must be at least 1"));
    }
    let selected = metrics::parse_metrics(&a.percentile_metrics).map_err(|e| usage(format!("{e:#}")))?;
    let percentiles = metrics::parse_percentiles(&a.metric_percentiles).map_err(|e| usage(format!("{e:#}")))?;
    let slos = metrics::parse_goodput(&a.goodput).map_err(|e| usage(format!("{e:#}")))?;
    let delays = arrival::schedule(
        a.num_prompts,
        a.request_rate,
        a.burstiness,
        &mut StdRng::seed_from_u64(a.seed),
    )
    .map_err(|e| usage(format!("{e:#}")))?;
    let http = client::Http::new(
        &a.base_url
            .clone()
            .unwrap_or_else(|| format!("http://{}:{}", a.host, a.port)),
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let model = runtime.block_on(async {
        match &a.model {
            Some(m) => http.get("/v1/models").await.map(|_| m.clone()),
            None => {
                println!("Model not specified, fetching first model from server...");
                http.first_model().await
            }
        }
    })?;
    let local = a
        .tokenizer
        .clone()
        .or_else(|| Path::new(&model).is_dir().then(|| PathBuf::from(&model)));
    let (counter, tokenizer_id) = match local {
        Some(dir) => (
            tokens::Counter::Local(Box::new(tokens::TextCounter::load(&dir)?)),
            dir.display().to_string(),
        ),
        None => match runtime.block_on(tokens::ServerCounter::connect(&http, &model, runtime.handle().clone())) {
            Ok(server) => {
                println!(
                    "Counting prompt tokens with the server's /tokenize (no --tokenizer, and model {model:?} is not a directory)"
                );
                (tokens::Counter::Server(Box::new(server)), http.url("/tokenize"))
            }
            Err(e) => {
                return Err(usage(format!(
                    "--tokenizer DIR is needed: model {model:?} is not a directory and {e:#}, and prompt tokens are \
                     counted with the model's tokenizer and chat template as vLLM does"
                )))
            }
        },
    };
    let spec = DatasetSpec {
        name: a.dataset_name,
        path: a.dataset_path.clone(),
        num_prompts: a.num_prompts,
        output_len: a.output_len,
        random_input_len: a.random_input_len,
        image_reuse_ratio: a.image_reuse_ratio,
    };
    let requests = dataset::build(&spec, &counter, &mut StdRng::seed_from_u64(a.seed))?;
    let traffic = serve::Traffic {
        endpoint: a.endpoint.clone(),
        model: model.clone(),
        ignore_eos: a.ignore_eos,
        request_rate: a.request_rate,
        burstiness: a.burstiness,
        max_concurrency: a.max_concurrency,
        ready_check: Duration::from_secs(a.ready_check_timeout_sec),
        memory_interval: Duration::from_millis(a.memory_interval_ms),
        progress: !a.disable_tqdm,
        after_run: Duration::try_from_secs_f64(a.after_run_s).map_err(|_| {
            usage(format!(
                "--after-run-s must be a non-negative number, got {}",
                a.after_run_s
            ))
        })?,
        after_run_post: a
            .reset_encoder_cache_after_run
            .then(|| "/reset_encoder_cache".to_string()),
    };
    let outcome = runtime.block_on(serve::benchmark(&http, &requests, &delays, &traffic))?;

    // Used only for outputs without a usage count; a failure to count says so once.
    let warned = std::sync::atomic::AtomicBool::new(false);
    let count = |text: &str| {
        counter.count(text).unwrap_or_else(|e| {
            if !warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!("cannot count output tokens ({e:#}): counted as 0");
            }
            0
        })
    };
    let m = metrics::calculate(
        &requests,
        &outcome.outputs,
        outcome.duration,
        &percentiles,
        slos.as_ref(),
        &count,
    );
    let info = metrics::RunInfo {
        max_concurrency: a.max_concurrency,
        request_rate: a.request_rate,
        goodput: slos.is_some(),
        selected,
    };
    let (block, aggregates) = metrics::report(&m, outcome.duration, &info);
    print!("{block}");
    let timeline = &outcome.timeline;
    if let Some(note) = &timeline.note {
        println!("{note}");
    }
    if a.save_result {
        let mut result = header(a, &model, &tokenizer_id);
        result.extend(aggregates);
        result.extend(metrics::per_request(&requests, &outcome.outputs, &m));
        result.insert("timeline".into(), serde_json::to_value(timeline)?);
        let path = result_path(a, &model, &result);
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        std::fs::write(&path, Value::Object(result).to_string())
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("Results saved to {}", path.display());
    }
    if let Some(path) = &a.plot {
        draw_timeline(timeline, path)?;
    }
    if m.completed == 0 {
        let first = outcome
            .outputs
            .iter()
            .map(|o| o.error.as_str())
            .next()
            .unwrap_or_default();
        bail!("all {} requests failed; the first: {first}", outcome.outputs.len());
    }
    Ok(())
}

/// The setup keys vLLM writes before the results.
fn header(a: &ServeBenchArgs, model: &str, tokenizer_id: &str) -> Map<String, Value> {
    let mut h = Map::new();
    h.insert("date".into(), json!(utc_stamp(now_secs())));
    h.insert("endpoint_type".into(), json!(a.backend));
    h.insert("label".into(), Value::Null);
    h.insert("model_id".into(), json!(model));
    h.insert("tokenizer_id".into(), json!(tokenizer_id));
    h.insert("num_prompts".into(), json!(a.num_prompts));
    let rate = if a.request_rate.is_finite() {
        json!(a.request_rate)
    } else {
        json!("inf")
    };
    h.insert("request_rate".into(), rate);
    h.insert("burstiness".into(), json!(a.burstiness));
    h.insert("max_concurrency".into(), json!(a.max_concurrency));
    h
}

/// `--result-dir/--result-filename`, or vLLM's default name.
fn result_path(a: &ServeBenchArgs, model: &str, result: &Map<String, Value>) -> PathBuf {
    let name = a.result_filename.clone().unwrap_or_else(|| {
        let concurrency = a
            .max_concurrency
            .map(|c| format!("-concurrency{c}"))
            .unwrap_or_default();
        let base_model = model.trim_end_matches('/').rsplit('/').next().unwrap_or(model);
        let date = result["date"].as_str().unwrap_or_default();
        format!(
            "{}-{:?}qps{concurrency}-{base_model}-{date}.json",
            a.backend, a.request_rate
        )
    });
    match &a.result_dir {
        Some(dir) => dir.join(name),
        None => PathBuf::from(name),
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `%Y%m%d-%H%M%S` of a Unix time, in UTC (days to civil date after H. Hinnant).
fn utc_stamp(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps() {
        assert_eq!(utc_stamp(0), "19700101-000000");
        assert_eq!(utc_stamp(951_782_400 + 3_661), "20000229-010101");
        assert_eq!(utc_stamp(1_735_689_599), "20241231-235959");
    }
}
