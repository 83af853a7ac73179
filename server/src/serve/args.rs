//! The flags of `kvlens serve`, spelled as `vllm serve` spells them, and the vLLM flags that do not
//! apply to kvlens: those are dropped from the command line with a warning instead of failing it.

use crate::kv_events::KvEventsConfig;
use crate::startup::EngineArgs;
use crate::UsageError;
use axum::http::{HeaderName, HeaderValue, Method};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, CorsLayer};

/// Flags of `kvlens serve`. A flag given twice keeps its last value, as vLLM's argparse does.
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
#[command(args_override_self = true)]
pub struct ServeArgs {
    /// The checkpoint, as `vllm serve MODEL` takes it (same as --model).
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    pub model_tag: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on; anything but loopback without --api-key draws a warning.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the start-up line names it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* and the reset endpoints.
    #[arg(long, env = "KVLENS_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Hosts whose http:// and https:// image URLs are fetched (none by default: send images as
    /// data URLs); at most 64 MiB within 10 s, up to 3 redirects, each to an allowed host.
    #[arg(long, num_args = 1..)]
    pub allowed_media_domains: Vec<String>,
    /// PEM file of extra root certificates to trust for https image URLs, beside Mozilla's (a
    /// private CA, or a test's self-signed certificate).
    #[arg(long, value_name = "PEM")]
    pub media_ca_file: Option<PathBuf>,
    /// Seconds that requests in flight get to finish after SIGTERM/SIGINT, as in vLLM (new ones are
    /// refused and /health answers 503 meanwhile); 0 aborts them at once. Streams that are cut
    /// end with `finish_reason: "abort"`.
    #[arg(long, default_value_t = 0.0)]
    pub shutdown_timeout: f64,
    /// Seconds a client has to send a request's body; slower bodies get a 408.
    #[arg(long, default_value_t = 60.0)]
    pub body_timeout: f64,
    /// Most HTTP connections open at once; past it each new connection closes the one that has
    /// waited on its client longest (idle, half-sent headers, a stalled body), and waits only when
    /// every one is being served (a log line says so).
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers, and that an idle keep-alive connection
    /// stays open; slower connections are closed.
    #[arg(long, default_value_t = 15.0)]
    pub header_timeout: f64,
    /// Most `/v1/memory/stream` subscribers at once; past it the oldest subscriber is closed.
    #[arg(long, default_value_t = 32)]
    pub max_stream_subscribers: usize,
    /// Host names this server answers to besides the machine's own, a JSON list (`["*"]`: any). A
    /// server on a loopback address answers only `localhost`, `*.localhost` and loopback addresses
    /// unless listed here (DNS rebinding); one on another address answers any host when the list
    /// is empty.
    #[arg(long, value_name = "JSON", default_value = "[]", value_parser = json_list)]
    pub allowed_hosts: JsonList,
    /// Directory with the built playground, served at / (and /planner) when it exists.
    #[arg(long, default_value = "dist")]
    pub playground_dir: PathBuf,
    /// Origins whose pages may read the answers (CORS), a JSON list as vLLM takes it:
    /// `["*"]` (any origin) or e.g. `["http://localhost:8080"]`.
    #[arg(long, value_name = "JSON", default_value = r#"["*"]"#, value_parser = json_list)]
    pub allowed_origins: JsonList,
    /// Methods cross-origin requests may use, a JSON list (`["*"]`: any).
    #[arg(long, value_name = "JSON", default_value = r#"["*"]"#, value_parser = json_list)]
    pub allowed_methods: JsonList,
    /// Headers cross-origin requests may send, a JSON list (`["*"]`: any).
    #[arg(long, value_name = "JSON", default_value = r#"["*"]"#, value_parser = json_list)]
    pub allowed_headers: JsonList,
    /// Let cross-origin requests carry credentials (cookies, `Authorization`).
    #[arg(long)]
    pub allow_credentials: bool,
    /// Publish the KV cache's block events in vLLM's format, vLLM's JSON: e.g.
    /// `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    /// "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}` (ZeroMQ PUB plus a ROUTER that
    /// replays missed batches; msgpack `KVEventBatch`es read by vLLM's own subscribers).
    #[arg(long, value_name = "JSON", value_parser = KvEventsConfig::flag)]
    pub kv_events_config: Option<KvEventsConfig>,
    /// Follow a sample of KV blocks from allocation to eviction and expose vLLM's
    /// `vllm:kv_block_{lifetime,idle_before_evict,reuse_gap}_seconds` histograms.
    #[arg(long)]
    pub kv_cache_metrics: bool,
    /// Share of KV blocks followed with --kv-cache-metrics, in (0, 1] (vLLM's default 0.01).
    #[arg(long, default_value_t = 0.01, value_parser = sample_rate)]
    pub kv_cache_metrics_sample: f64,
}

fn sample_rate(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|r| *r > 0.0 && *r <= 1.0)
        .ok_or_else(|| format!("expected a share in (0, 1], got {text}"))
}

/// A list flag written as JSON, as vLLM parses `--allowed-origins` (`json.loads`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(transparent)]
pub struct JsonList(pub Vec<String>);

impl JsonList {
    /// `"*"` is one of the entries: anything goes.
    fn any(&self) -> bool {
        self.0.iter().any(|s| s == "*")
    }
}

fn json_list(text: &str) -> Result<JsonList, String> {
    serde_json::from_str(text)
        .map(JsonList)
        .map_err(|e| format!("expected a JSON list of strings such as '[\"http://localhost:8080\"]': {e}"))
}

/// How long a browser may keep a preflight answer (Starlette's default, which vLLM uses).
const CORS_MAX_AGE: Duration = Duration::from_secs(600);

impl ServeArgs {
    /// The CORS rules of `--allowed-origins`, `--allowed-methods`, `--allowed-headers` and
    /// `--allow-credentials`, as vLLM's CORSMiddleware applies them: a listed origin is echoed back,
    /// `*` answers any origin (echoing it when credentials are allowed, since browsers refuse `*`
    /// with credentials), a preflight gets the asked-for method and headers where `*` allows them.
    pub fn cors(&self) -> Result<CorsLayer, UsageError> {
        let bad = |flag: &str, value: &str| UsageError(format!("{flag}: {value:?} is not a valid value"));
        let origin = if self.allowed_origins.any() {
            if self.allow_credentials {
                AllowOrigin::mirror_request()
            } else {
                AllowOrigin::any()
            }
        } else {
            let origins = self
                .allowed_origins
                .0
                .iter()
                .map(|o| HeaderValue::from_str(o.trim_end_matches('/')).map_err(|_| bad("--allowed-origins", o)));
            AllowOrigin::list(origins.collect::<Result<Vec<_>, _>>()?)
        };
        let methods = if self.allowed_methods.any() {
            AllowMethods::mirror_request()
        } else {
            let methods = self.allowed_methods.0.iter().map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes()).map_err(|_| bad("--allowed-methods", m))
            });
            AllowMethods::list(methods.collect::<Result<Vec<_>, _>>()?)
        };
        let headers = if self.allowed_headers.any() {
            AllowHeaders::mirror_request()
        } else {
            let headers = self.allowed_headers.0.iter().map(|h| {
                HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).map_err(|_| bad("--allowed-headers", h))
            });
            AllowHeaders::list(headers.collect::<Result<Vec<_>, _>>()?)
        };
        Ok(CorsLayer::new()
            .allow_origin(origin)
            .allow_methods(methods)
            .allow_headers(headers)
            .allow_credentials(self.allow_credentials)
            .max_age(CORS_MAX_AGE))
    }
}

/// vLLM flags that take a value and mean nothing to kvlens (one process, one device, no
/// compilation, no uvicorn); `--tensor-parallel-size` above 1 is passed on to be refused.
const IGNORED_WITH_VALUE: &[&str] = &[
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--distributed-executor-backend",
    "--swap-space",
    "--cpu-offload-gb",
    "--download-dir",
    "--load-format",
    "--revision",
    "--tokenizer-mode",
    "--max-log-len",
    "--compilation-config",
    "-O",
    "--uvicorn-log-level",
    "--root-path",
    "--response-role",
    "--tool-call-parser",
    "--reasoning-parser",
    "--guided-decoding-backend",
    "--max-parallel-loading-workers",
];

/// vLLM switches that mean nothing to kvlens.
const IGNORED_SWITCHES: &[&str] = &[
    "--trust-remote-code",
    "--enforce-eager",
    "--disable-log-requests",
    "--enable-log-requests",
    "--disable-log-stats",
    "--disable-custom-all-reduce",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--disable-frontend-multiprocessing",
    "--enable-auto-tool-choice",
    "--disable-fastapi-docs",
    "--disable-uvicorn-access-log",
    "--enable-prompt-tokens-details",
    "--enable-server-load-tracking",
    "--enable-request-id-headers",
    "--async-scheduling",
];

/// Drops the vLLM flags kvlens ignores from a `kvlens serve` command line (other commands pass
/// through unchanged) and prints one warning per dropped flag.
pub fn strip_ignored_vllm_flags(args: Vec<OsString>) -> Vec<OsString> {
    let (kept, ignored) = split_ignored(args);
    for flag in ignored {
        tracing::warn!("{flag}: a vLLM flag that does not apply to kvlens; ignored");
    }
    kept
}

/// `(kept arguments, ignored flags as written)`.
fn split_ignored(args: Vec<OsString>) -> (Vec<OsString>, Vec<String>) {
    if args.get(1).and_then(|a| a.to_str()) != Some("serve") {
        return (args, Vec::new());
    }
    let mut kept = Vec::with_capacity(args.len());
    let mut ignored = Vec::new();
    let mut rest = args.into_iter();
    while let Some(arg) = rest.next() {
        let Some(text) = arg.to_str().map(str::to_string) else {
            kept.push(arg);
            continue;
        };
        if text == "--" {
            kept.push(arg);
            kept.extend(rest.by_ref());
            break;
        }
        let name = text.split_once('=').map_or(text.as_str(), |(n, _)| n);
        if IGNORED_SWITCHES.contains(&name) {
            ignored.push(text);
        } else if IGNORED_WITH_VALUE.contains(&name) {
            let value = match text.split_once('=') {
                Some((_, v)) => Some(v.to_string()),
                None => rest.next().map(|v| v.to_string_lossy().into_owned()),
            };
            // A degree above 1 is not ignored: `kvlens serve` refuses it, saying why.
            if matches!(name, "--tensor-parallel-size" | "-tp") && value.as_deref().is_some_and(|v| v.trim() != "1") {
                kept.push("--tensor-parallel-size".into());
                kept.extend(value.map(OsString::from));
                continue;
            }
            ignored.push(match value {
                Some(v) if name == text => format!("{text} {v}"),
                _ => text,
            });
        } else {
            kept.push(arg);
        }
    }
    (kept, ignored)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(args: &[&str]) -> (Vec<String>, Vec<String>) {
        let (kept, ignored) = split_ignored(args.iter().map(OsString::from).collect());
        (kept.into_iter().map(|a| a.into_string().unwrap()).collect(), ignored)
    }

    #[test]
    fn drops_vllm_only_flags_with_their_values() {
        let (kept, ignored) = split(&[
            "kvlens",
            "serve",
            "--tensor-parallel-size",
            "1",
            "--trust-remote-code",
            "--max-model-len",
            "2048",
            "--swap-space=4",
            "--enforce-eager",
            "--uvicorn-log-level",
            "warning",
            "--port",
            "0",
        ]);
        assert_eq!(kept, ["kvlens", "serve", "--max-model-len", "2048", "--port", "0"]);
        assert_eq!(
            ignored,
            [
                "--tensor-parallel-size 1",
                "--trust-remote-code",
                "--swap-space=4",
                "--enforce-eager",
                "--uvicorn-log-level warning"
            ]
        );
    }

    #[test]
    fn a_tensor_parallel_degree_above_one_reaches_serve_to_be_refused() {
        let (kept, ignored) = split(&["kvlens", "serve", "-tp", "2", "--tensor-parallel-size=1"]);
        assert_eq!(kept, ["kvlens", "serve", "--tensor-parallel-size", "2"]);
        assert_eq!(ignored, ["--tensor-parallel-size=1"]);
        let (kept, _) = split(&["kvlens", "serve", "--tensor-parallel-size=4"]);
        assert_eq!(kept, ["kvlens", "serve", "--tensor-parallel-size", "4"]);
    }

    #[test]
    fn other_commands_and_unknown_flags_pass_through() {
        let (kept, ignored) = split(&["kvlens", "plan", "--tensor-parallel-size", "2"]);
        assert_eq!(kept, ["kvlens", "plan", "--tensor-parallel-size", "2"]);
        assert!(ignored.is_empty());
        let (kept, ignored) = split(&["kvlens", "serve", "--no-such-flag", "--", "--enforce-eager"]);
        assert_eq!(kept, ["kvlens", "serve", "--no-such-flag", "--", "--enforce-eager"]);
        assert!(ignored.is_empty());
    }
}
