//! The run itself, as `vllm bench serve`'s `benchmark()`: the initial single-prompt test, the
//! traffic lines, requests sent on the arrival schedule (within `--max-concurrency`), the memory
//! timeline sampled alongside (and, with `--after-run-s`, on after the run, with an optional reset
//! in the middle), and the wall time from the first send to the last completion.

use super::client::{chat_payload, wait_for_endpoint, Http, RequestOutput};
use super::dataset::BenchRequest;
use super::timeline::{self, Timeline};
use anyhow::{bail, Result};
use indicatif::ProgressBar;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Mutex, Semaphore};

/// How to send.
#[derive(Debug, Clone)]
pub struct Traffic {
    /// The chat endpoint, e.g. `/v1/chat/completions`.
    pub endpoint: String,
    /// The model name sent in each request.
    pub model: String,
    /// Send `ignore_eos`.
    pub ignore_eos: bool,
    /// `--request-rate`.
    pub request_rate: f64,
    /// `--burstiness`.
    pub burstiness: f64,
    /// `--max-concurrency`.
    pub max_concurrency: Option<usize>,
    /// 0 skips the initial test run.
    pub ready_check: Duration,
    /// Between `/v1/memory` readings.
    pub memory_interval: Duration,
    /// Draw a progress bar.
    pub progress: bool,
    /// Keep sampling `/v1/memory` this long after the last request.
    pub after_run: Duration,
    /// POST this endpoint (e.g. `/reset_encoder_cache`) halfway through `after_run`.
    pub after_run_post: Option<String>,
}

/// What a run measured.
#[derive(Debug)]
pub struct Outcome {
    /// One per request, in order.
    pub outputs: Vec<RequestOutput>,
    /// Seconds from the first send to the last completion.
    pub duration: f64,
    /// `/v1/memory` over the run.
    pub timeline: Timeline,
}

/// Sends `requests[i]` at `delays[i]` seconds after the start and gathers the outputs.
pub async fn benchmark(http: &Http, requests: &[BenchRequest], delays: &[f64], t: &Traffic) -> Result<Outcome> {
    println!("Starting initial single prompt test run...");
    if t.ready_check.is_zero() {
        println!("Skipping endpoint ready check.");
    } else {
        let payload = chat_payload(&t.model, &requests[0], t.ignore_eos);
        let test = wait_for_endpoint(http, &t.endpoint, payload, t.ready_check).await;
        if !test.success {
            bail!(
                "Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: {}",
                test.error
            );
        }
        println!("Initial test run completed. Starting main benchmark run...");
    }
    let distribution = if t.burstiness == 1.0 {
        "Poisson process"
    } else {
        "Gamma distribution"
    };
    // Python's float and None spelling, as vLLM prints them.
    println!("Traffic request rate: {:?}", t.request_rate);
    println!("Burstiness factor: {:?} ({distribution})", t.burstiness);
    match t.max_concurrency {
        Some(c) => println!("Maximum request concurrency: {c}"),
        None => println!("Maximum request concurrency: None"),
    }
    let bar = if t.progress {
        ProgressBar::new(requests.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    // 0 means no limit, as in vLLM.
    let limit = t
        .max_concurrency
        .filter(|&c| c > 0)
        .map(|c| Arc::new(Semaphore::new(c)));
    let t0 = Instant::now();
    let (stop, stopped) = oneshot::channel();
    let quiet = Arc::new(Mutex::new(()));
    let sampler = tokio::spawn(timeline::record(
        http.clone(),
        t.memory_interval,
        t0,
        quiet.clone(),
        stopped,
    ));
    let mut tasks = Vec::with_capacity(requests.len());
    for (i, (req, &delay)) in requests.iter().zip(delays).enumerate() {
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(delay)).into()).await;
        let (http, req, bar, limit, t) = (http.clone(), req.clone(), bar.clone(), limit.clone(), t.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = match limit {
                Some(s) => s.acquire_owned().await.ok(),
                None => None,
            };
            let payload = chat_payload(&t.model, &req, t.ignore_eos);
            let out = http
                .chat(&t.endpoint, payload, &format!("benchmark-serving{i}"), t0)
                .await;
            bar.inc(1);
            out
        }));
    }
    let mut outputs = Vec::with_capacity(tasks.len());
    for task in tasks {
        outputs.push(task.await?);
    }
    let duration = t0.elapsed().as_secs_f64();
    bar.finish();
    let (mut events, mut around_events) = (Vec::new(), Vec::new());
    if !t.after_run.is_zero() {
        tokio::time::sleep(t.after_run / 2).await;
        if let Some(path) = &t.after_run_post {
            // Samples right before and after the request show what it changed, however busy the
            // machine and whatever the sampling interval. The sampler waits meanwhile: a reading
            // it sent before the request could be answered after it, and would show the reset
            // under a time before the event.
            let _quiet = quiet.lock().await;
            around_events.extend(timeline::sample_now(http, t0).await);
            let answer = http.post(path).await;
            let status = answer.as_ref().map_or(0, |(s, _)| s.as_u16());
            println!("After the run: POST {path} answered {status}");
            events.push(timeline::Event {
                t: t0.elapsed().as_secs_f64(),
                what: format!("POST {path}"),
                status,
            });
            around_events.extend(timeline::sample_now(http, t0).await);
        }
        tokio::time::sleep(t.after_run / 2).await;
    }
    let _ = stop.send(());
    let mut timeline = sampler.await?;
    if timeline.note.is_none() {
        timeline.merge(around_events);
    }
    timeline.events = events;
    Ok(Outcome {
        outputs,
        duration,
        timeline,
    })
}
