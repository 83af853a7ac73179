//! The engine with a tiny random-weight Qwen2-VL on the CPU backend: preemption under KV pressure
//! gives the same greedy tokens as running each request alone, and an aborted waiting request
//! leaves nothing behind. An in-memory random checkpoint of the config's tensor specs stands in for one on disk.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use kvlens_engine::arch::config::ModelConfig;
use kvlens_engine::arch::spec::tensor_specs;
use kvlens_engine::backend::cpu::CpuBackend;
use kvlens_engine::backend::instrumented::{Instrumented, Transfers};
use kvlens_engine::backend::{block_on, Backend};
use kvlens_engine::engine::{Engine, EngineConfig, FinishReason, ImageInput, Request};
use kvlens_engine::memory::ledger::{Category, MemoryLedger};
use kvlens_engine::model::random_weights::RandomInit;
use kvlens_engine::model::weights::SafetensorsFiles;
use kvlens_engine::model::QwenVl;
use kvlens_engine::runner::ModelRunner;
use kvlens_engine::sample::SamplingParams;
use std::future::Future;
use std::task::{Context, Poll, Waker};

/// The tests of this file run one at a time: one of them measures the process's resident memory.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Uniform values in [-0.5, 0.5) from a xorshift generator (the pixels of test images).
fn random_f32(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn tiny_config() -> ModelConfig {
    ModelConfig::from_json(include_str!("../../tools/golden/configs/qwen2_vl_tiny.json")).unwrap()
}

/// Loads a model of `cfg` from a random checkpoint written in memory (std 0.5).
fn random_model<B: Backend>(cfg: ModelConfig, be: &B) -> QwenVl<B> {
    let mut bytes = Vec::new();
    RandomInit::new(0, 0.5)
        .write_safetensors(&mut bytes, &tensor_specs(&cfg), |_| {})
        .unwrap();
    let shards = [("model.safetensors".to_string(), bytes.as_slice())];
    let weights = SafetensorsFiles::parse(&shards).unwrap();
    QwenVl::load(cfg, &weights, be, |_, _| {}).unwrap()
}

/// The tiny model with random weights.
fn tiny_model<B: Backend>(be: &B) -> QwenVl<B> {
    random_model(tiny_config(), be)
}

fn engine(num_blocks: usize, max_num_seqs: usize) -> Engine {
    engine_with_vocab(num_blocks, max_num_seqs, 0)
}

fn engine_with_vocab(num_blocks: usize, max_num_seqs: usize, vocab_size: usize) -> Engine {
    let be = CpuBackend::new(MemoryLedger::new());
    let model = tiny_model(&be);
    engine_over(be, model, num_blocks, max_num_seqs, vocab_size)
}

fn engine_over<B: Backend>(
    be: B,
    model: QwenVl<B>,
    num_blocks: usize,
    max_num_seqs: usize,
    vocab_size: usize,
) -> Engine {
    Engine::new(
        Box::new(ModelRunner::new(be, model)),
        small_config(num_blocks, max_num_seqs, vocab_size),
    )
    .unwrap()
}

/// Blocks of 4 tokens, 64 per request, 64 per step, the prefix cache on.
fn small_config(num_blocks: usize, max_num_seqs: usize, vocab_size: usize) -> EngineConfig {
    EngineConfig {
        num_blocks,
        block_size: 4,
        max_model_len: 64,
        enable_prefix_caching: true,
        encoder_cache_tokens: 16,
        max_num_seqs,
        max_num_batched_tokens: 64,
        vocab_size,
        long_prefill_token_threshold: 0,
    }
}

/// A greedy request of `len` prompt tokens, with a 4-token image (a 4×4 patch grid) at `image`.
fn request(cfg: &ModelConfig, id: &str, len: usize, image: Option<(usize, &str)>, max_tokens: usize) -> Request {
    let mut prompt: Vec<u32> = (0..len as u32)
        .map(|i| 100 + 37 * i + id.len() as u32 * 7 + id.as_bytes()[0] as u32)
        .collect();
    let images = image
        .map(|(offset, hash)| {
            prompt[offset..offset + 4].fill(cfg.tokens.image);
            let patch_dim = cfg.vision.as_ref().map_or(0, |v| v.patch_dim());
            ImageInput {
                pixel_values: random_f32(hash.len() as u64 + 7, 16 * patch_dim).into(),
                grid_thw: [1, 4, 4],
                mm_hash: hash.into(),
                offset,
                num_tokens: 4,
            }
        })
        .into_iter()
        .collect();
    Request {
        id: id.into(),
        prompt,
        images,
        params: SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        },
    }
}

/// Steps until done; returns each request's tokens and checks every request ended once.
fn drain(engine: &mut Engine) -> HashMap<String, Vec<u32>> {
    drain_with(engine, |e| e.step().unwrap())
}

/// [`drain`] with each step run by `step`.
fn drain_with(
    engine: &mut Engine,
    mut step: impl FnMut(&mut Engine) -> Vec<kvlens_engine::engine::TokenEvent>,
) -> HashMap<String, Vec<u32>> {
    let mut out: HashMap<String, Vec<u32>> = HashMap::new();
    let mut ended = Vec::new();
    for _ in 0..500 {
        if !engine.has_unfinished() {
            break;
        }
        for e in step(engine) {
            assert!(!ended.contains(&e.id), "{} got a token after it finished", e.id);
            out.entry(e.id.to_string()).or_default().push(e.token);
            if e.finish.is_some() {
                assert_eq!(e.finish, Some(FinishReason::Length));
                ended.push(e.id);
            }
        }
    }
    assert!(!engine.has_unfinished());
    assert_eq!(engine.kv().num_requests(), 0);
    assert_eq!(engine.kv().usage(), 0.0);
    assert!(engine
        .encoder_cache()
        .snapshot()
        .entries
        .iter()
        .all(|e| e.refs.is_empty()));
    out
}

/// Three greedy requests (two with an image) run together in 12 usable blocks of 4, where the
/// prompts take 9 and all three grow to 5 blocks each, so some are preempted: each gets the tokens
/// it gets alone in a roomy engine. Returns the tight engine.
fn preempted_requests_match_each_alone(cfg: &ModelConfig, make: impl Fn(usize, usize) -> Engine) -> Engine {
    let reqs = [
        request(cfg, "a", 10, Some((2, "img-a")), 10),
        request(cfg, "b", 11, None, 10),
        request(cfg, "c", 12, Some((5, "img-c")), 10),
    ];
    let mut alone = HashMap::new();
    let mut roomy = make(64, 1);
    for r in &reqs {
        roomy.add_request(r.clone()).unwrap();
        alone.extend(drain(&mut roomy));
    }
    assert_eq!(roomy.counters().num_preemptions, 0);
    let mut tight = make(13, 4);
    for r in &reqs {
        tight.add_request(r.clone()).unwrap();
    }
    let together = drain(&mut tight);
    assert!(tight.counters().num_preemptions > 0, "{:?}", tight.counters());
    assert_eq!(together, alone);
    assert!(alone.values().all(|t| t.len() == 10));
    tight
}

#[test]
fn greedy_tokens_with_preemption_match_each_request_alone() {
    let _serial = serial();
    preempted_requests_match_each_alone(&tiny_config(), engine);
}

fn qwen3_5_config() -> ModelConfig {
    ModelConfig::from_json(include_str!("../../tools/golden/configs/qwen3_5_tiny.json")).unwrap()
}

fn qwen3_5_moe_config() -> ModelConfig {
    ModelConfig::from_json(include_str!("../../tools/golden/configs/qwen3_5_moe_tiny.json")).unwrap()
}

/// A tiny Qwen3.5 in an engine whose steps compute at most 8 tokens, so that prompts are
/// prefilled in chunks and each chunk continues the Gated DeltaNet states of the one before.
fn hybrid_engine(model_cfg: ModelConfig) -> impl Fn(usize, usize) -> Engine {
    move |num_blocks, max_num_seqs| {
        let be = CpuBackend::new(MemoryLedger::new());
        let model = random_model(model_cfg.clone(), &be);
        let cfg = EngineConfig {
            max_num_batched_tokens: 8,
            ..small_config(num_blocks, max_num_seqs, 0)
        };
        Engine::new(Box::new(ModelRunner::new(be, model)), cfg).unwrap()
    }
}

/// The state slots held now.
fn states_held(e: &Engine) -> usize {
    e.snapshot()
        .states
        .expect("a hybrid model has state slots")
        .held_by
        .len()
}

#[test]
fn qwen3_5_preempted_and_chunked_requests_give_the_tokens_of_undisturbed_runs() {
    let _serial = serial();
    let tight = preempted_requests_match_each_alone(&qwen3_5_config(), hybrid_engine(qwen3_5_config()));
    assert_eq!(states_held(&tight), 0);
}

/// The same for the mixture of experts: a step's rows route to their experts independently of
/// which other requests share the step.
#[test]
fn qwen3_5_moe_preempted_and_chunked_requests_give_the_tokens_of_undisturbed_runs() {
    let _serial = serial();
    let cfg = qwen3_5_moe_config();
    let tight = preempted_requests_match_each_alone(&cfg, hybrid_engine(cfg.clone()));
    assert_eq!(states_held(&tight), 0);
}

#[test]
fn sixty_four_qwen3_5_requests_leave_no_kv_block_and_no_state_held() {
    let _serial = serial();
    let cfg = qwen3_5_config();
    let reqs: Vec<Request> = (0..64)
        .map(|i| request(&cfg, &format!("r{i}"), 6 + i % 9, None, 4 + i % 5))
        .collect();
    let mut e = hybrid_engine(cfg.clone())(40, 16);
    let slots = e.snapshot().states.unwrap();
    assert_eq!(slots.total, 16);
    assert_eq!(
        e.ledger().bytes(Category::StateCache),
        slots.total as u64 * slots.bytes_per_slot,
        "the ledger holds every slot's state"
    );
    for r in &reqs {
        e.add_request(r.clone()).unwrap();
    }
    let mut most = 0;
    let tokens = drain_with(&mut e, |e| {
        let events = e.step().unwrap();
        let held = states_held(e);
        assert!(
            held <= e.num_running(),
            "{held} states held by {} running requests",
            e.num_running()
        );
        most = most.max(held);
        events
    });
    assert!(most > 1, "requests ran side by side");
    assert_eq!(tokens.len(), 64);
    assert_eq!(states_held(&e), 0);
    assert_eq!(e.kv().summary().num_in_use, 0);
}

/// Eight requests, five with images (two sharing one), in a KV cache too small for all of them.
fn eight_image_requests(cfg: &ModelConfig) -> Vec<Request> {
    (0..8)
        .map(|i| {
            let id = format!("r{i}");
            let image = match i % 4 {
                0 => Some((1, "img-shared")),
                1 => None,
                2 => Some((3, ["img-2", "img-6"][i / 4])),
                _ => Some((0, ["img-3", "img-7"][i / 4])),
            };
            request(cfg, &id, 8 + i, image, 6)
        })
        .collect()
}

/// The engine stepped through its asynchronous path with every read held back until the test
/// releases it: each step stays pending on its read, then completes with the tokens the blocking
/// path gives, through images and preemption.
#[test]
fn held_back_reads_give_the_blocking_path_s_tokens() {
    let _serial = serial();
    let cfg = tiny_config();
    let reqs = eight_image_requests(&cfg);
    let mut blocking = engine(20, 8);
    for r in &reqs {
        blocking.add_request(r.clone()).unwrap();
    }
    let want = drain(&mut blocking);
    assert!(blocking.counters().num_preemptions > 0, "{:?}", blocking.counters());

    let be = Instrumented::new(CpuBackend::new(MemoryLedger::new()));
    let model = tiny_model(&be);
    let handle = be.clone();
    handle.hold_reads();
    let mut held = engine_over(be, model, 20, 8, 0);
    for r in &reqs {
        held.add_request(r.clone()).unwrap();
    }
    let mut pending_steps = 0;
    let got = drain_with(&mut held, |e| {
        let mut step = std::pin::pin!(e.step_async());
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            match step.as_mut().poll(&mut cx) {
                Poll::Ready(events) => return events.unwrap(),
                Poll::Pending => {
                    assert_eq!(handle.pending_reads(), 1, "a pending step waits on its one read");
                    pending_steps += 1;
                    handle.release_reads();
                }
            }
        }
    });
    // Every token came out of a step that waited on its read: at least one per generated token.
    assert!(pending_steps >= 6, "{pending_steps} steps waited on a read");
    assert_eq!(pending_steps, held.counters().steps, "a step that read nothing waited");
    assert_eq!(held.counters().num_preemptions, blocking.counters().num_preemptions);
    assert_eq!(got, want);
}

/// Host-to-device transfers per step, for a model of `layers` decoder layers and vision blocks.
fn transfers_per_step(layers: usize) -> Vec<Transfers> {
    let mut json: serde_json::Value =
        serde_json::from_str(include_str!("../../tools/golden/configs/qwen2_vl_tiny.json")).unwrap();
    json["num_hidden_layers"] = layers.into();
    json["vision_config"]["depth"] = layers.into();
    let cfg = ModelConfig::from_json(&json.to_string()).unwrap();
    assert_eq!(cfg.text.num_hidden_layers, layers);
    let be = Instrumented::new(CpuBackend::new(MemoryLedger::new()));
    let model = random_model(cfg.clone(), &be);
    let counter = be.clone();
    let mut e = engine_over(be, model, 64, 8, 0);
    for r in eight_image_requests(&cfg) {
        e.add_request(r).unwrap();
    }
    let mut per_step = Vec::new();
    while e.has_unfinished() {
        let before = counter.transfers();
        e.step().unwrap();
        let after = counter.transfers();
        per_step.push(Transfers {
            uploads: after.uploads - before.uploads,
            index_lists: after.index_lists - before.index_lists,
            reads: after.reads - before.reads,
            read_floats: after.read_floats - before.read_floats,
            table_ids: after.table_ids - before.table_ids,
        });
    }
    per_step
}

/// A step's metadata crosses to the device once, not once per layer: the same requests give the
/// same transfers per step with 2 and with 5 layers, and a decode step uploads cos, sin, the
/// paged metadata and the sampling settings only, and reads back one sampled token (greedy, on
/// the device: 2 floats).
#[test]
fn uploads_per_step_do_not_grow_with_the_layers() {
    let _serial = serial();
    let two = transfers_per_step(2);
    let five = transfers_per_step(5);
    assert_eq!(two, five);
    let last = two.last().unwrap();
    assert_eq!(
        *last,
        Transfers {
            uploads: 4,
            index_lists: 2,
            reads: 1,
            read_floats: 2,
            table_ids: last.table_ids,
        }
    );
}

/// Block ids written into the runner's block tables by requests of `prompt` tokens generating
/// `max_tokens`, `n` at once, and the decode steps they took.
fn table_ids_written(n: usize, prompt: usize, max_tokens: usize) -> (u64, u64) {
    let be = Instrumented::new(CpuBackend::new(MemoryLedger::new()));
    let model = tiny_model(&be);
    let counter = be.clone();
    let blocks_each = (prompt + max_tokens).div_ceil(4);
    let mut e = engine_over(be, model, n * blocks_each + 1, n, 0);
    let cfg = tiny_config();
    for i in 0..n {
        // Distinct prompts: no block is shared through the prefix cache.
        let mut r = request(&cfg, &format!("q{i}"), prompt, None, max_tokens);
        r.prompt[0] = 1000 + i as u32;
        e.add_request(r).unwrap();
    }
    drain(&mut e);
    assert_eq!(e.counters().num_preemptions, 0);
    (counter.transfers().table_ids, e.counters().steps)
}

/// As vLLM's model runner does, the runner keeps each request's block table in a row on the device
/// and a step sends only the blocks a table gained: every block id crosses once per request, the
/// same per request whether 8 or 256 run at once (a step that sent whole tables would send each
/// id again on every step after its block was allocated: 4 ids a request per decode step here).
#[test]
fn block_table_ids_cross_once_whatever_the_batch() {
    let _serial = serial();
    let (prompt, max_tokens): (usize, usize) = (8, 12);
    // The last token is sampled, not computed: 19 positions in the cache, 5 blocks of 4.
    let blocks_each = (prompt + max_tokens - 1).div_ceil(4) as u64;
    for n in [8, 256] {
        let (ids, steps) = table_ids_written(n, prompt, max_tokens);
        assert_eq!(ids, n as u64 * blocks_each, "{n} requests over {steps} steps");
    }
}

/// An image whose first placeholders the prefix cache holds (the hit ends inside it) and whose
/// output the encoder cache still has is counted once, as an encoder hit; before, it was counted
/// in no counter.
#[test]
fn an_image_whose_start_the_prefix_cache_holds_is_counted_once() {
    let _serial = serial();
    let cfg = tiny_config();
    let mut e = engine(16, 4);
    // Same id length and first letter: the same prompt, its image at tokens 6..10.
    e.add_request(request(&cfg, "p1", 12, Some((6, "img-p")), 1)).unwrap();
    drain(&mut e);
    let before = e.snapshot().counters;
    e.add_request(request(&cfg, "p2", 12, Some((6, "img-p")), 1)).unwrap();
    drain(&mut e);
    let after = e.snapshot().counters;
    assert_eq!(
        after.prompt_tokens_cached - before.prompt_tokens_cached,
        8,
        "two blocks of 4: the hit ends inside the image"
    );
    assert_eq!(after.vision_runs, before.vision_runs, "{after:?}");
    assert_eq!(after.encoder_hits - before.encoder_hits, 1, "{after:?}");
    assert_eq!(after.prefix_cached_images, before.prefix_cached_images, "{after:?}");
}

#[test]
fn aborting_a_waiting_request_leaves_no_encoder_reference() {
    let _serial = serial();
    let cfg = tiny_config();
    let mut e = engine(8, 4);
    // a leaves img-x in the encoder cache; b then takes 6 of the 7 blocks.
    e.add_request(request(&cfg, "a", 6, Some((0, "img-x")), 1)).unwrap();
    drain(&mut e);
    e.add_request(request(&cfg, "b", 22, None, 4)).unwrap();
    e.step().unwrap();
    // c finds img-x cached (after a text token, so no prefix hit) but no room for its blocks.
    e.add_request(request(&cfg, "c", 9, Some((1, "img-x")), 1)).unwrap();
    e.step().unwrap();
    assert_eq!((e.num_running(), e.num_waiting()), (1, 1));
    assert!(e.abort(&"c".into()).unwrap());
    let snap = e.snapshot();
    assert!(
        snap.encoder_cache.entries.iter().all(|x| x.refs.is_empty()),
        "{:?}",
        snap.encoder_cache
    );
    assert_eq!(snap.num_waiting, 0);
    drain(&mut e);
    assert!(e.reset_encoder_cache() > 0);
}

#[test]
fn sampling_stays_inside_the_tokenizer_vocabulary() {
    let _serial = serial();
    let cfg = tiny_config();
    let reqs = [
        request(&cfg, "a", 10, None, 12),
        request(&cfg, "b", 7, Some((1, "img-b")), 12),
    ];
    let mut full = engine(64, 4);
    for r in &reqs {
        full.add_request(r.clone()).unwrap();
    }
    let unlimited = drain(&mut full);
    // Cut the vocabulary below the largest token the unlimited run produced.
    let top = unlimited.values().flatten().copied().max().unwrap() as usize;
    assert!(top > 0);
    let mut cut = engine_with_vocab(64, 4, top);
    for r in &reqs {
        cut.add_request(r.clone()).unwrap();
    }
    let limited = drain(&mut cut);
    assert!(limited.values().flatten().all(|&t| (t as usize) < top), "{limited:?}");
}

/// Seeded requests that draw (temperature alone, with top-k and top-p, with min-p and top-p) and
/// one greedy; `logprobs[i]` asks request i for top log-probabilities, which only the host gives.
fn seeded_requests(cfg: &ModelConfig, logprobs: [Option<usize>; 4]) -> Vec<Request> {
    let settings = [
        (0.0, 0, 1.0, 0.0),
        (0.9, 0, 1.0, 0.0),
        (0.8, 20, 0.9, 0.0),
        (1.2, 0, 0.7, 0.05),
    ];
    settings
        .into_iter()
        .zip(logprobs)
        .enumerate()
        .map(|(i, ((temperature, top_k, top_p, min_p), logprobs))| {
            let mut r = request(cfg, &format!("s{i}"), 5 + 2 * i, None, 8);
            r.params = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: Some(40 + i as u64),
                logprobs,
                ..r.params
            };
            r
        })
        .collect()
}

/// Each request's tokens with their log-probabilities, and per step the floats read per row.
#[derive(Debug, Default)]
struct SampledRun {
    tokens: HashMap<String, Vec<(u32, f32)>>,
    floats_per_row: Vec<u64>,
}

/// Steps `e` until done, counting the floats `counter` reads.
fn run_counted<B: Backend>(e: &mut Engine, counter: &Instrumented<B>) -> SampledRun {
    let mut run = SampledRun::default();
    while e.has_unfinished() {
        let before = counter.transfers().read_floats;
        let events = e.step().unwrap();
        if !events.is_empty() {
            run.floats_per_row
                .push((counter.transfers().read_floats - before) / events.len() as u64);
        }
        for ev in events {
            run.tokens
                .entry(ev.id.to_string())
                .or_default()
                .push((ev.token, ev.logprob));
        }
    }
    run
}

/// Logits per row in the sampling tests: a vocabulary small enough for lavapipe to run the lm_head
/// of every step quickly.
const SMALL_VOCAB: usize = 4096;

/// Ids the sampler may return in the sampling tests (the rest of a row is padding).
const ALLOWED: usize = 4000;

/// An engine over `be` with the tiny model cut to [`SMALL_VOCAB`] logits, holding
/// [`seeded_requests`] with `logprobs`.
fn seeded_engine<B: Backend>(be: B, logprobs: [Option<usize>; 4]) -> Engine {
    let mut json: serde_json::Value =
        serde_json::from_str(include_str!("../../tools/golden/configs/qwen2_vl_tiny.json")).unwrap();
    json["vocab_size"] = SMALL_VOCAB.into();
    let cfg = ModelConfig::from_json(&json.to_string()).unwrap();
    let model = random_model(cfg.clone(), &be);
    let mut e = engine_over(be, model, 64, 8, ALLOWED);
    for r in seeded_requests(&cfg, logprobs) {
        e.add_request(r).unwrap();
    }
    e
}

/// [`seeded_engine`] over `be`, run to the end.
fn seeded_run<B: Backend + Clone>(be: Instrumented<B>, logprobs: [Option<usize>; 4]) -> SampledRun {
    let counter = be.clone();
    run_counted(&mut seeded_engine(be, logprobs), &counter)
}

/// The same seeded requests sample on the device (no request asks for top log-probabilities: each
/// step reads 2 floats per row) and on the host (all ask, or one does: each step reads the whole
/// vocabulary per row): the same tokens and log-probabilities, and the draws vary.
fn device_and_host_sampling_agree<B: Backend + Clone>(make: impl Fn() -> Instrumented<B>, tol: f32) {
    let device = seeded_run(make(), [None; 4]);
    let host = seeded_run(make(), [Some(1); 4]);
    let mixed = seeded_run(make(), [None, None, Some(2), None]);
    assert!(
        device.floats_per_row.iter().all(|&f| f == 2),
        "{:?}",
        device.floats_per_row
    );
    for run in [&host, &mixed] {
        let vocab = SMALL_VOCAB as u64;
        assert!(
            run.floats_per_row.iter().all(|&f| f == vocab),
            "{:?}",
            run.floats_per_row
        );
    }
    for run in [&host, &mixed] {
        assert_eq!(run.tokens.len(), 4);
        for (id, want) in &run.tokens {
            let got = &device.tokens[id];
            let ids = |t: &[(u32, f32)]| t.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(ids(got), ids(want), "{id}");
            for (g, w) in got.iter().zip(want) {
                assert!((g.1 - w.1).abs() <= tol, "{id}: logprob {} vs {}", g.1, w.1);
            }
        }
    }
    for (id, tokens) in &device.tokens {
        assert!(tokens.iter().all(|t| (t.0 as usize) < ALLOWED), "{id}: {tokens:?}");
        let distinct: std::collections::HashSet<u32> = tokens.iter().map(|t| t.0).collect();
        assert!(id == "s0" || distinct.len() > 1, "{id} drew one token: {tokens:?}");
    }
}

#[test]
fn seeded_requests_sample_the_same_tokens_on_the_device_as_on_the_host() {
    let _serial = serial();
    device_and_host_sampling_agree(|| Instrumented::new(CpuBackend::new(MemoryLedger::new())), 0.0);
}

#[cfg(feature = "wgpu")]
#[test]
fn seeded_requests_sample_the_same_tokens_on_a_wgpu_device_as_on_the_host() {
    use kvlens_engine::backend::wgpu::{WgpuBackend, WgpuOptions};
    let _serial = serial();
    let make = || {
        let be = WgpuBackend::new_blocking(MemoryLedger::new(), WgpuOptions::default())
            .unwrap_or_else(|e| panic!("the wgpu tests need an adapter (lavapipe): {e}"));
        Instrumented::new(be)
    };
    device_and_host_sampling_agree(make, 1e-4);
}

/// A request aborted while a device-sampled step is in flight (its uniform already drawn) is
/// skipped when the step completes, and the other requests draw the tokens they draw without it.
#[test]
fn aborting_during_a_device_sampled_step_leaves_the_other_requests_draws_alone() {
    let _serial = serial();
    let want = seeded_run(Instrumented::new(CpuBackend::new(MemoryLedger::new())), [None; 4]).tokens;
    let mut e = seeded_engine(CpuBackend::new(MemoryLedger::new()), [None; 4]);
    e.step().unwrap();
    let (meta, read) = e.launch().unwrap().unwrap().into_parts();
    assert!(e.abort(&"s1".into()).unwrap());
    let events = e.complete(meta, read.map(block_on).transpose()).unwrap();
    assert_eq!(events.len(), 3);
    assert!(events.iter().all(|ev| ev.id.to_string() != "s1"));
    let mut got = drain(&mut e);
    for (id, tokens) in &want {
        let ids: Vec<u32> = tokens.iter().map(|t| t.0).collect();
        if id == "s1" {
            continue;
        }
        let rest = got.remove(id).unwrap_or_default();
        assert_eq!(ids[2..], rest[..], "{id}");
    }
}

/// The heap of this test binary, counted: bytes allocated now and the most at once since a reset.
mod heap {
    #![allow(unsafe_code)]
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering};

    static NOW: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);

    struct Counting;

    // SAFETY: every call goes to the system allocator unchanged; only counters are added.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
            unsafe { System.alloc(layout) }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
            unsafe { System.alloc_zeroed(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            NOW.fetch_sub(layout.size(), Ordering::Relaxed);
            unsafe { System.dealloc(ptr, layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            let now = NOW.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(now, Ordering::Relaxed);
            NOW.fetch_sub(layout.size(), Ordering::Relaxed);
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    /// Starts a new peak at the current level and returns that level.
    pub fn reset_peak() -> usize {
        let now = NOW.load(Ordering::Relaxed);
        PEAK.store(now, Ordering::Relaxed);
        now
    }

    /// The most bytes allocated at once since the last reset.
    pub fn peak() -> usize {
        PEAK.load(Ordering::Relaxed)
    }
}

/// One 3,000-token prefill step (after a shorter one): the most heap memory it held at once
/// beyond what it started with is what the ledger's activations peaked at, within 10 %.
#[test]
fn a_long_prefill_s_transient_memory_is_counted_in_the_ledger() {
    let _serial = serial();
    let cfg = tiny_config();
    let n: usize = 3000;
    let be = CpuBackend::new(MemoryLedger::new());
    let model = tiny_model(&be);
    let engine_cfg = EngineConfig {
        num_blocks: n.div_ceil(4) + 8,
        block_size: 4,
        max_model_len: 4096,
        enable_prefix_caching: false,
        encoder_cache_tokens: 16,
        max_num_seqs: 1,
        max_num_batched_tokens: n,
        vocab_size: 0,
        long_prefill_token_threshold: 0,
    };
    let mut e = Engine::new(Box::new(ModelRunner::new(be, model)), engine_cfg).unwrap();
    // A shorter request first: each pool thread's first attention product allocates the `gemm`
    // crate's packing buffers, which it keeps for every later one (not the step's transient).
    e.add_request(request(&cfg, "warm-up", 700, None, 1)).unwrap();
    assert_eq!(e.step().unwrap().len(), 1);
    e.add_request(request(&cfg, "long", n, None, 1)).unwrap();
    let ledger = e.ledger().clone();
    ledger.reset_peaks();
    let before = heap::reset_peak();
    let events = e.step().unwrap();
    let growth = (heap::peak() - before) as u64;
    assert_eq!(events.len(), 1);
    let counted = ledger.peak(Category::Activations);
    println!("heap growth {growth} B, activations counted {counted} B");
    let diff = growth.abs_diff(counted) as f64;
    assert!(
        diff <= 0.1 * growth as f64,
        "heap growth {growth} B, activations counted {counted} B"
    );
}

/// 50 requests (half with one of five images) in five rounds on the wgpu backend: every round
/// ends with no KV block or encoder reference held (checked by `drain`), the ledger equal to the
/// device buffers that exist, and from the second round on the same activation bytes and the same
/// pooled buffers: no activation buffer leaks from request to request.
#[cfg(feature = "wgpu")]
#[test]
fn fifty_requests_on_wgpu_reach_a_steady_state_without_leaking_buffers() {
    use kvlens_engine::backend::wgpu::{WgpuBackend, WgpuOptions};
    let _serial = serial();
    let cfg = tiny_config();
    let be = WgpuBackend::new_blocking(MemoryLedger::new(), WgpuOptions::default())
        .unwrap_or_else(|e| panic!("this test needs a wgpu adapter (`cargo xtask test` installs lavapipe): {e}"));
    let probe = be.clone();
    let model = tiny_model(&be);
    let mut e = engine_over(be, model, 64, 8, 0);
    let ledger = e.ledger().clone();
    let mut rounds = Vec::new();
    for round in 0..5 {
        for i in 0..10 {
            let id = format!("r{round}-{i}");
            let image = (i % 2 == 0).then(|| (2, ["a", "bb", "ccc", "dddd", "eeeee"][i / 2]));
            e.add_request(request(&cfg, &id, 9 + i, image, 3)).unwrap();
        }
        let tokens = drain(&mut e);
        assert_eq!(tokens.len(), 10);
        assert!(tokens.values().all(|t| t.len() == 3));
        assert_eq!(
            ledger.total(),
            probe.device_bytes(),
            "round {round}: ledger against live buffers"
        );
        rounds.push((ledger.bytes(Category::Activations), probe.pooled()));
    }
    assert!(
        rounds[1..].iter().all(|r| *r == rounds[1]),
        "per round (activations, pooled): {rounds:?}"
    );
}
