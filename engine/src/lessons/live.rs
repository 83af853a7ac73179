//! The lessons' live steps: each one an act on a loaded engine (resize its KV cache, send
//! requests and run them to their end, empty a cache), then figures read from the engine's own
//! counters, block pool, encoder and processor caches and ledger. The same code runs natively
//! (`kvlens lesson`, blocking on each step) and in the playground's worker (awaiting each step's
//! read). Images are drawn here, sized against the largest image start-up profiled, so a lesson
//! fits any checkpoint.

use std::collections::BTreeMap;
use std::io::Cursor;

use base64::Engine as _;

use super::{Figure, Lesson, LessonError, Step};
use crate::engine::{Engine, EngineConfig, EngineCounters, Request};
use crate::input::chat::{ChatMessage, Content, ContentPart, ImageUrl};
use crate::input::processor::{InlineImages, InputProcessor};
use crate::memory::ledger::Category;
use crate::memory::planner::thousands;
use crate::profile::ProfileResult;
use crate::sample::SamplingParams;

/// A live step as written: what to look at, what it does, what it shows.
#[derive(Debug)]
pub(super) struct LiveSpec {
    pub say: &'static str,
    pub act: Act,
    pub figures: &'static [Read],
}

/// What a live step does.
#[derive(Debug)]
pub(super) enum Act {
    /// Resizes the KV cache to this many blocks (None: the engine's own size); every cache starts
    /// empty.
    Configure { kv_blocks: Option<usize> },
    /// Sends these requests at once and steps the engine until all have ended.
    Send(&'static [Ask]),
    /// Empties one cache, as the server's reset endpoint does.
    Reset(CacheReset),
    /// Sends a request the engine must refuse, and keeps what it said.
    Refuse(&'static Ask),
}

/// The three resets, named after vLLM's endpoints.
#[derive(Debug, Clone, Copy)]
pub(super) enum CacheReset {
    /// `/reset_mm_cache`: the processor cache (preprocessed images, host memory).
    Processor,
    /// `/reset_encoder_cache`: the vision tower's kept outputs (device memory).
    Encoder,
    /// `/reset_prefix_cache`: the hashes of free KV blocks.
    Prefix,
}

/// One request of a step: a user message with at most one image, greedy, `max_tokens` long.
#[derive(Debug)]
pub(super) struct Ask {
    pub id: &'static str,
    pub text: &'static str,
    pub image: Option<Pic>,
    pub max_tokens: usize,
}

/// An image drawn for a request: square, with `quarters / 4` times as many tokens as the largest
/// image start-up profiled; the same seed draws the same pixels.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pic {
    pub quarters: usize,
    pub seed: u8,
}

/// A figure a live step shows.
#[derive(Debug, Clone, Copy)]
pub(super) enum Read {
    KvBlocks,
    KvInUse,
    KvCached,
    EncoderEntries,
    EncoderBytes,
    ProcessorEntries,
    ProcessorBytes,
    DeviceBytes,
    VisionRuns,
    EncoderHits,
    ImagePlace,
    BlocksPerRequest,
    Refusal,
    MaxModelLen,
    WeightsBytes,
    KvCacheBytes,
    EncoderBudget,
    ProfiledImages,
    PromptTokens,
    PrefixHitTokens,
    PromptComputed,
    Generated,
    Preemptions,
    ProfiledImageTokens,
    OwnSizeTokens,
    SentTokens,
    ScoresOwnSize,
    ScoresSent,
    ScoresVsProfiled,
    StepPeak,
    ProfiledPeak,
    Recomputed,
    SameReplies,
}

/// What a live lesson runs on.
#[derive(Debug)]
pub struct Bench<'a> {
    /// The engine, idle; the lesson resizes it and gives it back idle at its own sizes.
    pub engine: &'a mut Engine,
    /// Its tokenizer, template and image processing (sized by start-up).
    pub input: &'a InputProcessor,
    /// What start-up's profile run measured.
    pub profile: &'a ProfileResult,
    /// How many of the largest images start-up's profile run encoded.
    pub profiled_images: usize,
}

/// What a running lesson reports.
#[derive(Debug)]
pub enum Watch<'a> {
    /// The engine after an engine step, a resize or a reset (draw its occupancy).
    Stepped(&'a Engine),
    /// A lesson step ended with its figures.
    Done(usize, &'a Step),
    /// Before the first step: what the lesson runs on, in one sentence.
    Setting(&'a str),
}

/// An image as sent.
#[derive(Debug, Clone, Copy)]
struct SentImage {
    own_tokens: usize,
    tokens: usize,
    /// Where its tokens start in the prompt.
    offset: usize,
}

/// What one `Send` did.
#[derive(Debug, Default)]
struct Sent {
    prompt_tokens: usize,
    /// The most tokens one request holds at its end (prompt and output).
    longest: usize,
    images: Vec<SentImage>,
    replies: BTreeMap<String, Vec<u32>>,
    computed: u64,
    /// What the engine said when it refused the request.
    refusal: Option<String>,
}

/// Everything a step's figures are read from.
struct Facts<'a> {
    engine: &'a Engine,
    input: &'a InputProcessor,
    profile: &'a ProfileResult,
    profiled_images: usize,
    before: EngineCounters,
    transient_base: u64,
    sent: Option<&'a Sent>,
    earlier: Option<&'a Sent>,
}

fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

impl Read {
    fn of(self, f: &Facts) -> Figure {
        let o = f.engine.snapshot();
        let after = o.counters;
        let delta = |get: fn(&EngineCounters) -> u64| get(&after).saturating_sub(get(&f.before));
        let processor = f
            .input
            .processor_cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .snapshot();
        let last_image = f.sent.and_then(|s| s.images.last().copied());
        let heads = f.engine.model_config().vision.as_ref().map_or(0, |v| v.num_heads) as u64;
        let merge = f.input.settings.merge_size as u64;
        // One vision attention layer's scores, in f32: (patches)² per head.
        let scores = |tokens: usize| (tokens as u64 * merge * merge).pow(2) * heads * 4;
        let count = |n: u64| (thousands(n), Some(n));
        let pool = "the engine: its KV block pool";
        let counters = "the engine's counters, this step";
        let (name, (value, raw), source): (&str, (String, Option<u64>), &str) = match self {
            Read::KvBlocks => ("KV blocks", count(o.kv.num_blocks.saturating_sub(1) as u64), pool),
            Read::KvInUse => ("KV blocks in use", count(o.kv.num_in_use as u64), pool),
            Read::KvCached => (
                "KV blocks cached (free, still found by hash)",
                count(o.kv.num_cached_free as u64),
                pool,
            ),
            Read::EncoderEntries => (
                "encoder cache entries",
                count(o.encoder_cache.entries.len() as u64),
                "the engine: its encoder cache",
            ),
            Read::DeviceBytes => {
                let b = f.engine.ledger().total() - f.engine.ledger().bytes(Category::Requests);
                (
                    "memory the backend holds (weights, KV, encoder outputs, activations)",
                    (bytes(b), Some(b)),
                    "the ledger: every category but host requests",
                )
            }
            Read::EncoderBytes => {
                let b = f.engine.ledger().bytes(Category::EncoderCache);
                (
                    "encoder cache (device memory)",
                    (bytes(b), Some(b)),
                    "the ledger: encoder_cache",
                )
            }
            Read::ProcessorEntries => (
                "processor cache entries",
                count(processor.entries.len() as u64),
                "the input processor's cache",
            ),
            Read::ProcessorBytes => (
                "processor cache (host memory)",
                (bytes(processor.bytes_used), Some(processor.bytes_used)),
                "the input processor's cache",
            ),
            Read::VisionRuns => (
                "images through the vision tower",
                count(delta(|c| c.vision_runs)),
                counters,
            ),
            Read::EncoderHits => ("encoder cache hits", count(delta(|c| c.encoder_hits)), counters),
            Read::ImagePlace => {
                let (from, to) = last_image.map_or((0, 0), |i| (i.offset + 1, i.offset + i.tokens));
                (
                    "the image's tokens in the prompt (positions)",
                    (format!("{from}–{to}"), Some(to as u64)),
                    "the request as tokenized",
                )
            }
            Read::BlocksPerRequest => {
                let block = o.kv.block_size.max(1);
                let n = f.sent.map_or(0, |s| s.longest.div_ceil(block)) as u64;
                (
                    "KV blocks the longest request needs at its end",
                    count(n),
                    "its prompt and output ÷ the block size",
                )
            }
            Read::Refusal => (
                "the engine's answer",
                (
                    f.sent
                        .and_then(|s| s.refusal.clone())
                        .unwrap_or_else(|| "accepted".into()),
                    None,
                ),
                "the engine, as the request was added",
            ),
            Read::MaxModelLen => (
                "the longest request (--max-model-len)",
                count(f.engine.config().max_model_len as u64),
                "the engine's sizes",
            ),
            Read::WeightsBytes => {
                let b = f.engine.ledger().bytes(Category::Weights);
                ("weights", (bytes(b), Some(b)), "the ledger: weights, as loaded")
            }
            Read::KvCacheBytes => {
                let b = f.engine.ledger().bytes(Category::KvCache);
                ("KV cache", (bytes(b), Some(b)), "the ledger: kv_cache")
            }
            Read::EncoderBudget => (
                "encoder cache budget (tokens)",
                count(f.engine.config().encoder_cache_tokens as u64),
                "start-up: max(--max-num-batched-tokens, largest image)",
            ),
            Read::ProfiledImages => (
                "largest images start-up's profile run encoded",
                count(f.profiled_images as u64),
                "start-up's plan: budget ÷ largest image",
            ),
            Read::PromptTokens => (
                "prompt tokens sent",
                count(f.sent.map_or(0, |s| s.prompt_tokens) as u64),
                "the requests as tokenized",
            ),
            Read::PrefixHitTokens => (
                "prompt tokens found in the prefix cache",
                count(delta(|c| c.prompt_tokens_cached)),
                counters,
            ),
            Read::PromptComputed => (
                "prompt tokens computed",
                count(delta(|c| c.prompt_tokens_computed)),
                counters,
            ),
            Read::Generated => ("tokens generated", count(delta(|c| c.generated_tokens)), counters),
            Read::Preemptions => ("preemptions", count(delta(|c| c.num_preemptions)), counters),
            Read::ProfiledImageTokens => (
                "largest image start-up profiled (tokens)",
                count(f.input.max_image_tokens as u64),
                "start-up: max_pixels, the image its profile run encoded",
            ),
            Read::OwnSizeTokens => (
                "the image at its own size (tokens)",
                count(last_image.map_or(0, |i| i.own_tokens) as u64),
                "its pixels ÷ (patch × merge)²",
            ),
            Read::SentTokens => (
                "the image as kvlens resized it (tokens)",
                count(last_image.map_or(0, |i| i.tokens) as u64),
                "the processor: smart_resize within the profiled max_pixels",
            ),
            Read::ScoresOwnSize => {
                let b = scores(last_image.map_or(0, |i| i.own_tokens));
                (
                    "one vision attention layer's scores stored in full, at its own size",
                    (bytes(b), Some(b)),
                    "estimated: patches² × heads × 4 bytes",
                )
            }
            Read::ScoresSent => {
                let b = scores(last_image.map_or(0, |i| i.tokens));
                (
                    "the same, as resized",
                    (bytes(b), Some(b)),
                    "estimated: patches² × heads × 4 bytes",
                )
            }
            Read::ScoresVsProfiled => {
                let own = scores(last_image.map_or(0, |i| i.own_tokens));
                let pct = own * 100 / f.profile.activation_peak_bytes.max(1);
                (
                    "those own-size scores against the profiled peak",
                    (format!("{pct} %"), Some(pct)),
                    "the estimate ÷ start-up's profile run",
                )
            }
            Read::StepPeak => {
                let b = f.engine.ledger().transient(true).saturating_sub(f.transient_base);
                (
                    "peak this step (activations, staging, encoder outputs)",
                    (bytes(b), Some(b)),
                    "the ledger: peaks since the step began",
                )
            }
            Read::ProfiledPeak => {
                let b = f.profile.activation_peak_bytes;
                (
                    "peak of start-up's profile run",
                    (bytes(b), Some(b)),
                    "start-up's profile run (vLLM's torch peak increase)",
                )
            }
            Read::Recomputed => {
                let n = match (f.earlier, f.sent) {
                    (Some(e), Some(s)) => e.computed.saturating_sub(s.computed),
                    _ => 0,
                };
                (
                    "tokens computed again because of preemption",
                    count(n),
                    "the engine's counters: positions the decoder ran, the preempted run's − this run's",
                )
            }
            Read::SameReplies => {
                let (same, of) = match (f.earlier, f.sent) {
                    (Some(e), Some(s)) => (
                        s.replies.iter().filter(|(id, r)| e.replies.get(*id) == Some(r)).count(),
                        s.replies.len(),
                    ),
                    _ => (0, 0),
                };
                (
                    "replies token for token the same as the preempted run's",
                    (format!("{same} of {of}"), Some(same as u64)),
                    "the tokens of both runs, compared",
                )
            }
        };
        Figure {
            name: name.into(),
            value,
            source: source.to_string(),
            raw,
            area: self.area().into(),
        }
    }
}

impl Read {
    /// The part of the memory view a figure is about: `kv`, `encoder`, `processor`, `ledger` or
    /// `counters`.
    fn area(self) -> &'static str {
        match self {
            Read::KvBlocks
            | Read::KvInUse
            | Read::KvCached
            | Read::KvCacheBytes
            | Read::BlocksPerRequest
            | Read::MaxModelLen => "kv",
            Read::EncoderEntries | Read::EncoderBytes | Read::EncoderBudget | Read::EncoderHits => "encoder",
            Read::ProcessorEntries | Read::ProcessorBytes => "processor",
            Read::DeviceBytes
            | Read::WeightsBytes
            | Read::StepPeak
            | Read::ProfiledPeak
            | Read::ScoresOwnSize
            | Read::ScoresSent
            | Read::ScoresVsProfiled => "ledger",
            Read::VisionRuns
            | Read::ImagePlace
            | Read::Refusal
            | Read::ProfiledImages
            | Read::PromptTokens
            | Read::PrefixHitTokens
            | Read::PromptComputed
            | Read::Generated
            | Read::Preemptions
            | Read::ProfiledImageTokens
            | Read::OwnSizeTokens
            | Read::SentTokens
            | Read::Recomputed
            | Read::SameReplies => "counters",
        }
    }
}

fn failed(e: impl std::fmt::Display) -> LessonError {
    LessonError::Engine(e.to_string())
}

/// A square image of `side` pixels, as a PNG data URL.
fn picture(side: u32, seed: u8) -> Result<String, LessonError> {
    let s = u32::from(seed);
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        image::Rgb([
            (x.wrapping_mul(7) + s * 40) as u8,
            (y.wrapping_mul(5) + s * 90) as u8,
            ((x ^ y) + s * 13) as u8,
        ])
    });
    let mut png = Vec::new();
    img.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
        .map_err(failed)?;
    Ok(format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(png)
    ))
}

/// Resizes the engine's KV cache (None: its own size) and empties every cache.
fn configure(
    engine: &mut Engine,
    input: &InputProcessor,
    own: EngineConfig,
    kv_blocks: Option<usize>,
) -> Result<(), LessonError> {
    let cfg = match kv_blocks {
        Some(n) => EngineConfig {
            num_blocks: n + 1,
            max_model_len: own.max_model_len.min(n * own.block_size),
            ..own
        },
        None => own,
    };
    engine.reconfigure(cfg).map_err(failed)?;
    input.processor_cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
    Ok(())
}

fn reset(engine: &mut Engine, input: &InputProcessor, which: CacheReset) -> Result<(), LessonError> {
    match which {
        CacheReset::Processor => {
            input.processor_cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        CacheReset::Encoder => {
            engine.reset_encoder_cache();
        }
        CacheReset::Prefix => engine.reset_prefix_cache().map_err(failed)?,
    }
    Ok(())
}

/// `ask` as an engine request: one user message of `parts`, greedy, `ask.max_tokens` long.
fn request(input: &InputProcessor, ask: &Ask, parts: Vec<ContentPart>) -> Result<Request, LessonError> {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: ask.max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let messages = [ChatMessage {
        role: "user".into(),
        content: Content::Parts(parts),
    }];
    input
        .request(ask.id, &messages, params, false, &mut InlineImages)
        .map_err(failed)
}

/// Sends a request the engine must refuse; what it said, or a failure when it accepted.
fn refused(engine: &mut Engine, input: &InputProcessor, ask: &Ask) -> Result<Sent, LessonError> {
    let req = request(input, ask, vec![ContentPart::Text { text: ask.text.into() }])?;
    let prompt_tokens = req.prompt.len();
    let id = req.id.clone();
    match engine.add_request(req) {
        Ok(()) => {
            let _ = engine.abort(&id);
            Err(LessonError::Engine(format!(
                "{} was accepted; the lesson expects a refusal",
                ask.id
            )))
        }
        Err(e) => Ok(Sent {
            prompt_tokens,
            longest: prompt_tokens + ask.max_tokens,
            refusal: Some(e.to_string()),
            ..Sent::default()
        }),
    }
}

/// Sends `asks` at once and steps the engine until every one has ended.
async fn send(
    engine: &mut Engine,
    input: &InputProcessor,
    asks: &[Ask],
    watch: &mut dyn FnMut(Watch<'_>),
) -> Result<Sent, LessonError> {
    let unit = (input.settings.patch_size * input.settings.merge_size) as u32;
    let before = engine.counters().tokens_computed;
    let mut sent = Sent::default();
    let mut added = Vec::new();
    for ask in asks {
        // The text first, so that a shared question fills KV blocks before the image.
        let mut parts = vec![ContentPart::Text { text: ask.text.into() }];
        let mut own_tokens = 0;
        if let Some(pic) = ask.image {
            let target = (pic.quarters * input.max_image_tokens / 4).max(1);
            let side = (target as f64).sqrt().ceil() as u32;
            own_tokens = (side * side) as usize;
            parts.push(ContentPart::ImageUrl {
                image_url: ImageUrl {
                    url: picture(side * unit, pic.seed)?,
                },
            });
        }
        let added_now = request(input, ask, parts).and_then(|req| {
            sent.prompt_tokens += req.prompt.len();
            sent.longest = sent.longest.max(req.prompt.len() + ask.max_tokens);
            sent.images.extend(req.images.iter().map(|i| SentImage {
                own_tokens,
                tokens: i.num_tokens,
                offset: i.offset,
            }));
            let id = req.id.clone();
            engine.add_request(req).map_err(failed).map(|()| id)
        });
        match added_now {
            Ok(id) => added.push(id),
            Err(e) => {
                for id in &added {
                    let _ = engine.abort(id);
                }
                return Err(e);
            }
        }
    }
    while engine.has_unfinished() {
        let steps = engine.counters().steps;
        // A failed step has dropped every request and emptied the caches.
        for e in engine.step_async().await.map_err(failed)? {
            sent.replies.entry(e.id.as_str().to_string()).or_default().push(e.token);
        }
        watch(Watch::Stepped(engine));
        if engine.counters().steps == steps {
            for id in &added {
                let _ = engine.abort(id);
            }
            return Err(LessonError::Engine(
                "the engine scheduled nothing for the lesson's requests".into(),
            ));
        }
    }
    sent.computed = engine.counters().tokens_computed - before;
    Ok(sent)
}

/// What a lesson runs on, for its reader: the model, the backend, the KV cache, the largest image.
fn setting(engine: &Engine, input: &InputProcessor) -> String {
    let cfg = engine.model_config();
    let kv = engine.ledger().bytes(Category::KvCache);
    let c = engine.config();
    let unit = input.settings.patch_size * input.settings.merge_size;
    format!(
        "Runs on the loaded model ({}, {} layers, hidden size {}) on the {} backend: a KV cache of {} blocks of {} \
         tokens ({}), images of at most {} tokens (max_pixels {}; a token is {unit}×{unit} pixels). A small \
         stand-in for a full-size Qwen-VL: the numbers are small, computed the way vLLM computes them.",
        cfg.family.model_type(),
        cfg.text.num_hidden_layers,
        cfg.text.hidden_size,
        engine.backend_name(),
        thousands(c.num_blocks.saturating_sub(1) as u64),
        c.block_size,
        bytes(kv),
        input.max_image_tokens,
        thousands(input.settings.limits.max_pixels),
    )
}

/// Runs a lesson's live steps on `bench`: every cache starts empty, each step acts and then
/// reads its figures; `watch` hears every engine step and every finished lesson step. The engine
/// is given back idle at its own sizes, whether the lesson ran through or failed.
pub async fn run_live(
    lesson: &Lesson,
    bench: Bench<'_>,
    watch: &mut dyn FnMut(Watch<'_>),
) -> Result<Vec<Step>, LessonError> {
    let Bench {
        engine,
        input,
        profile,
        profiled_images,
    } = bench;
    let own = *engine.config();
    let mut steps = Vec::new();
    let ran = async {
        configure(engine, input, own, None)?;
        watch(Watch::Setting(&setting(engine, input)));
        watch(Watch::Stepped(engine));
        let mut sends: Vec<Sent> = Vec::new();
        for spec in lesson.live {
            let before = engine.counters();
            let transient_base = engine.ledger().transient(false);
            engine.ledger().reset_peaks();
            let sent = match spec.act {
                Act::Configure { kv_blocks } => {
                    configure(engine, input, own, kv_blocks)?;
                    false
                }
                Act::Send(asks) => {
                    sends.push(send(engine, input, asks, watch).await?);
                    true
                }
                Act::Reset(which) => {
                    reset(engine, input, which)?;
                    false
                }
                Act::Refuse(ask) => {
                    sends.push(refused(engine, input, ask)?);
                    true
                }
            };
            watch(Watch::Stepped(engine));
            let n = sends.len();
            let facts = Facts {
                engine,
                input,
                profile,
                profiled_images,
                before,
                transient_base,
                sent: sent.then(|| &sends[n - 1]),
                earlier: (sent && n >= 2).then(|| &sends[n - 2]),
            };
            let step = Step {
                say: spec.say.into(),
                query: None,
                figures: spec.figures.iter().map(|r| r.of(&facts)).collect(),
            };
            watch(Watch::Done(steps.len(), &step));
            steps.push(step);
        }
        Ok::<(), LessonError>(())
    }
    .await;
    // Idle at its own sizes, every cache empty, whether the lesson ran through or not.
    let restored = configure(engine, input, own, None);
    watch(Watch::Stepped(engine));
    match (ran, restored) {
        (Ok(()), Ok(())) => Ok(steps),
        (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
        (Err(e), Err(again)) => Err(LessonError::Engine(format!(
            "{e}; and the engine could not be given back its own sizes: {again}"
        ))),
    }
}
