//! `kvlens`: the command line of the kvlens engine.

#[cfg(feature = "bench")]
mod bench;
mod checkpoint;
mod generate_cmd;
mod kv_events;
mod lesson_cmd;
mod logging;
mod plan_cmd;
mod preprocess;
mod random_checkpoint_cmd;
mod runtime;
mod serve;
mod startup;
mod to_gguf_cmd;
mod watch_cmd;

use clap::{Parser, Subcommand};

/// mimalloc keeps large tensor buffers for reuse instead of mapping and zeroing fresh pages for
/// every operation (glibc hands allocations over 32 MiB straight back to the kernel).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::process::ExitCode;

/// kvlens: Qwen-VL inference that makes memory visible.
#[derive(Debug, Parser)]
#[command(name = "kvlens", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmark a running server (`bench serve`: vLLM's `vllm bench serve`, plus a memory timeline).
    #[cfg(feature = "bench")]
    Bench(bench::BenchArgs),
    /// Generate a reply to one conversation (text and images) on the CPU.
    Generate(Box<generate_cmd::GenerateArgs>),
    /// A lesson in memory profiling: a vLLM incident replayed step by step, its numbers computed.
    Lesson(Box<lesson_cmd::LessonArgs>),
    /// Reproduce vLLM's start-up memory budget for a Qwen-VL model on a device, before a job runs.
    Plan(Box<plan_cmd::PlanArgs>),
    /// Write a Hugging Face-layout checkpoint with random weights of a config's real shapes.
    RandomCheckpoint(random_checkpoint_cmd::RandomCheckpointArgs),
    /// Serve the OpenAI-compatible API and the playground.
    Serve(Box<serve::ServeArgs>),
    /// Write a Hugging Face checkpoint as the GGUF pair llama.cpp's converter writes (text + mmproj).
    ToGguf(to_gguf_cmd::ToGgufArgs),
    /// Watch a vLLM server's KV cache block by block (its KV events and /metrics) in the playground.
    Watch(Box<watch_cmd::WatchArgs>),
}

/// A user mistake: printed on one line, exit code 2 (as clap does for bad flags).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A [`UsageError`] as the `anyhow::Error` commands return.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

fn main() -> ExitCode {
    logging::init();
    let cli = Cli::parse_from(serve::strip_ignored_vllm_flags(std::env::args_os().collect()));
    let result = match cli.command {
        #[cfg(feature = "bench")]
        Command::Bench(args) => bench::run(&args),
        Command::Generate(args) => generate_cmd::run(&args),
        Command::Lesson(args) => lesson_cmd::run(&args),
        Command::Plan(args) => plan_cmd::run(&args),
        Command::RandomCheckpoint(args) => random_checkpoint_cmd::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::ToGguf(args) => to_gguf_cmd::run(&args),
        Command::Watch(args) => watch_cmd::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let usage = e.downcast_ref::<UsageError>().is_some();
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::from(if usage { 2 } else { 1 })
        }
    }
}
