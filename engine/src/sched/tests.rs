//! Scheduler tests without a model: a simulated model side keeps what each KV slot holds and which
//! encoder outputs exist, "samples" a token computed from the sequence, and checks every step that
//! the scheduler kept its budgets and that the KV cache really holds each sequence before it samples.

use std::collections::{HashMap, HashSet};

use super::*;
use crate::cache::{EncoderCacheManager, KvCacheManager};

/// The placeholder token of images in these tests.
const IMAGE: TokenId = 9999;

/// Budgets and cache sizes of one simulated engine.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    num_blocks: usize,
    block_size: usize,
    max_model_len: usize,
    prefix_caching: bool,
    encoder_cache: usize,
    encoder_budget: usize,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    long_prefill_token_threshold: usize,
}

impl Default for Sizes {
    fn default() -> Self {
        Sizes {
            num_blocks: 64,
            block_size: 4,
            max_model_len: 256,
            prefix_caching: true,
            encoder_cache: 32,
            encoder_budget: 32,
            max_num_seqs: 8,
            max_num_batched_tokens: 32,
            long_prefill_token_threshold: 0,
        }
    }
}

/// What the model side holds in one KV slot: position, token, image overlapping that position.
type Slot = (usize, TokenId, Option<MmHash>);

/// A scheduler driven by a fake model. `data` is each request's `max_tokens`.
#[derive(Debug)]
struct Sim {
    sizes: Sizes,
    sched: Scheduler<usize>,
    slots: HashMap<usize, Slot>,
    encoder_outputs: HashSet<MmHash>,
    emitted: HashMap<RequestId, Vec<TokenId>>,
    /// Ids of the requests the last step ran, in batch order.
    last_ids: Vec<String>,
    preemptions: usize,
}

fn image(offset: usize, length: usize, hash: &str) -> MmSpan {
    MmSpan {
        hash: hash.into(),
        offset,
        length,
    }
}

/// A prompt of `len` tokens from `seed` with image placeholders over those `images` that lie
/// inside it, and the images.
fn req(seed: u32, len: usize, images: Vec<MmSpan>) -> (Vec<TokenId>, Vec<MmSpan>) {
    let mut p: Vec<TokenId> = (0..len as u32).map(|i| seed * 1000 + i).collect();
    for s in &images {
        if let Some(run) = p.get_mut(s.offset..s.offset + s.length) {
            run.fill(IMAGE);
        }
    }
    (p, images)
}

/// The fake model's greedy choice: a function of every token of the sequence.
fn fake_token(seq: &Sequence<usize>) -> TokenId {
    (0..seq.len()).fold(seq.len() as TokenId, |acc, i| {
        acc.wrapping_mul(31).wrapping_add(seq.token_at(i))
    }) % 500
}

impl Sim {
    fn new(sizes: Sizes) -> Self {
        let kv = KvCacheManager::new(
            sizes.num_blocks,
            sizes.block_size,
            sizes.max_model_len,
            sizes.prefix_caching,
        )
        .unwrap();
        let cfg = SchedulerConfig {
            max_num_seqs: sizes.max_num_seqs,
            max_num_batched_tokens: sizes.max_num_batched_tokens,
            max_num_encoder_input_tokens: sizes.encoder_budget,
            long_prefill_token_threshold: sizes.long_prefill_token_threshold,
        };
        Sim {
            sizes,
            sched: Scheduler::new(cfg, kv, EncoderCacheManager::new(sizes.encoder_cache)),
            slots: HashMap::new(),
            encoder_outputs: HashSet::new(),
            emitted: HashMap::new(),
            last_ids: Vec::new(),
            preemptions: 0,
        }
    }

    fn add(
        &mut self,
        id: &str,
        (prompt, images): (Vec<TokenId>, Vec<MmSpan>),
        max_tokens: usize,
    ) -> Result<(), SchedError> {
        self.sched.add(id.into(), prompt, images, max_tokens, max_tokens)
    }

    fn running_ids(&self) -> Vec<&str> {
        self.sched.running().map(|s| s.id().as_str()).collect()
    }

    fn waiting_ids(&self) -> Vec<&str> {
        self.sched.waiting().map(|s| s.id().as_str()).collect()
    }

    /// Refs on the encoder-cache entry `hash` (None when absent).
    fn encoder_refs(&self, hash: &str) -> Option<Vec<RequestId>> {
        let snap = self.sched.encoder_cache().snapshot();
        snap.entries
            .into_iter()
            .find(|e| e.mm_hash.as_str() == hash)
            .map(|e| e.refs)
    }

    /// One step: schedule, check, "run" the model, sample, finish.
    fn step(&mut self) -> SchedulerOutput {
        let out = self.sched.schedule().unwrap();
        self.check_plan(&out);
        self.preemptions += out.preempted.len();
        for h in &out.freed_mm_hashes {
            assert!(self.encoder_outputs.remove(h), "freed {h} was never computed");
        }
        let bs = self.sizes.block_size;
        self.last_ids = out.scheduled.iter().map(|s| s.id.to_string()).collect();
        for s in &out.scheduled {
            let seq = self.sched.get(&s.id).unwrap();
            for &i in &s.encode {
                assert!(
                    self.encoder_outputs.insert(seq.spans()[i].hash.clone()),
                    "encoded twice"
                );
            }
        }
        let mut to_sample = Vec::new();
        for s in &out.scheduled {
            let seq = self.sched.get(&s.id).unwrap();
            for i in seq.images_in(s.start, s.end()) {
                let h = &seq.spans()[i].hash;
                assert!(
                    self.encoder_outputs.contains(h),
                    "{}: encoder output {h} missing",
                    seq.id()
                );
            }
            let table = self.sched.kv().block_table(seq.id());
            assert!(table.len() * bs >= s.end(), "{}: too few blocks", seq.id());
            for p in s.start..s.end() {
                self.slots.insert(table[p / bs] * bs + p % bs, slot_of(seq, p));
            }
            if s.end() == seq.len() {
                to_sample.push(s.id.clone());
            }
        }
        let mut finished = Vec::new();
        for id in to_sample {
            let seq = self.sched.get(&id).unwrap();
            let table = self.sched.kv().block_table(seq.id());
            for p in 0..seq.len() {
                assert_eq!(
                    self.slots.get(&(table[p / bs] * bs + p % bs)),
                    Some(&slot_of(seq, p)),
                    "{}: KV position {p} holds the wrong token",
                    seq.id()
                );
            }
            let token = fake_token(seq);
            assert!(self.sched.push_token(&id, token).unwrap());
            let emitted = self.emitted.entry(id.clone()).or_default();
            emitted.push(token);
            let seq = self.sched.get(&id).unwrap();
            assert_eq!(emitted.as_slice(), seq.output(), "emitted twice or lost");
            if emitted.len() >= seq.data {
                finished.push(id);
            }
        }
        self.sched.finish(&finished).unwrap();
        self.check_state();
        out
    }

    /// Budgets of one step.
    fn check_plan(&self, out: &SchedulerOutput) {
        let running = self.sched.num_running();
        assert!(out.num_tokens() <= self.sizes.max_num_batched_tokens);
        assert!(running <= self.sizes.max_num_seqs);
        let mut seen = HashSet::new();
        let mut encoded = 0;
        for s in &out.scheduled {
            assert!(s.num_new > 0 && seen.insert(s.id.clone()), "{s:?}");
            let threshold = self.sizes.long_prefill_token_threshold;
            assert!(threshold == 0 || s.num_new <= threshold, "{s:?} over {threshold}");
            let seq = self.sched.get(&s.id).unwrap();
            assert_eq!(seq.computed(), s.end());
            assert!(s.end() <= seq.len());
            encoded += s.encode.iter().map(|&i| seq.spans()[i].length).sum::<usize>();
        }
        assert!(encoded <= self.sizes.encoder_budget, "encoder compute budget exceeded");
        for id in &out.preempted {
            assert!(self.sched.waiting().any(|s| s.id() == id));
        }
    }

    /// Bookkeeping between steps: KV only for running requests, encoder outputs as the manager says.
    fn check_state(&self) {
        let kv = self.sched.kv();
        assert_eq!(kv.num_requests(), self.sched.num_running());
        for seq in self.sched.running() {
            assert!(kv.block_table(seq.id()).len() * self.sizes.block_size >= seq.computed());
        }
        for seq in self.sched.waiting() {
            assert_eq!(seq.computed(), 0);
            assert!(kv.block_table(seq.id()).is_empty());
        }
        let enc = self.sched.encoder_cache();
        assert_eq!(enc.num_entries(), self.encoder_outputs.len());
        assert!(self.encoder_outputs.iter().all(|h| enc.is_cached(h)));
    }

    /// Steps until nothing is left, at most `limit` steps. (A single step may schedule nothing: the
    /// only request that could run preempted itself while the others wait for encoder room.)
    fn run(&mut self, limit: usize) {
        for _ in 0..limit {
            if !self.sched.has_unfinished() {
                return;
            }
            self.step();
        }
        panic!("requests still unfinished after {limit} steps");
    }

    /// Everything released: no KV block in use, every encoder entry unreferenced and droppable.
    fn check_drained(&mut self) {
        assert!(!self.sched.has_unfinished());
        assert_eq!(self.sched.kv().num_requests(), 0);
        assert_eq!(self.sched.kv().usage(), 0.0);
        let snap = self.sched.encoder_cache().snapshot();
        assert!(snap.entries.iter().all(|e| e.refs.is_empty() && e.freeable), "{snap:?}");
        for h in self.sched.reset_encoder_cache() {
            assert!(self.encoder_outputs.remove(&h));
        }
        assert!(self.encoder_outputs.is_empty());
        let enc = self.sched.encoder_cache();
        assert_eq!((enc.num_entries(), enc.num_free_slots()), (0, enc.cache_size()));
        self.sched.reset_prefix_cache().unwrap();
    }
}

fn slot_of(seq: &Sequence<usize>, p: usize) -> Slot {
    let img = seq.images_in(p, p + 1).next().map(|i| seq.spans()[i].hash.clone());
    (p, seq.token_at(p), img)
}

#[test]
fn chunked_prefill_then_decode_within_the_token_budget() {
    let mut sim = Sim::new(Sizes {
        max_num_batched_tokens: 8,
        ..Sizes::default()
    });
    sim.add("a", req(1, 10, vec![]), 3).unwrap();
    sim.add("b", req(2, 5, vec![]), 2).unwrap();
    let out = sim.step();
    assert_eq!(out.scheduled.len(), 1);
    assert_eq!((out.scheduled[0].start, out.scheduled[0].num_new), (0, 8));
    // a finishes its prompt (2 tokens) and samples; b gets the rest of the budget.
    let out = sim.step();
    let got: Vec<(usize, usize)> = out.scheduled.iter().map(|s| (s.start, s.num_new)).collect();
    assert_eq!(got, [(8, 2), (0, 5)]);
    assert_eq!(sim.emitted[&RequestId::from("a")].len(), 1);
    // Both decode one token per step now.
    let out = sim.step();
    assert!(out.scheduled.iter().all(|s| s.num_new == 1));
    sim.run(10);
    sim.check_drained();
}

#[test]
fn a_long_prefill_takes_its_threshold_per_step_and_shorter_requests_run_beside_it() {
    let mut sim = Sim::new(Sizes {
        max_num_batched_tokens: 16,
        long_prefill_token_threshold: 6,
        ..Sizes::default()
    });
    sim.add("long", req(1, 60, vec![]), 2).unwrap();
    let out = sim.step();
    assert_eq!((out.scheduled[0].start, out.scheduled[0].num_new), (0, 6));
    // A short chat arriving during the long prefill runs in the very next step.
    sim.add("short", req(2, 5, vec![]), 2).unwrap();
    let out = sim.step();
    let got: Vec<(usize, usize)> = out.scheduled.iter().map(|s| (s.start, s.num_new)).collect();
    assert_eq!(got, [(6, 6), (0, 5)]);
    assert_eq!(sim.emitted[&RequestId::from("short")].len(), 1);
    sim.run(40);
    sim.check_drained();
}

#[test]
fn the_last_running_request_is_preempted_and_recomputed() {
    // 6 usable blocks of 4 tokens; three prompts of 8 tokens take 2 blocks each, and the first
    // decode step needs a new block for each.
    let mut sim = Sim::new(Sizes {
        num_blocks: 7,
        ..Sizes::default()
    });
    for (k, id) in ["a", "b", "c"].into_iter().enumerate() {
        sim.add(id, req(k as u32, 8, vec![]), 6).unwrap();
    }
    sim.step();
    assert_eq!(sim.running_ids(), ["a", "b", "c"]);
    assert_eq!(sim.sched.kv().num_free_blocks(), 0);
    let out = sim.step();
    assert_eq!(out.preempted, [RequestId::from("c")]);
    assert_eq!(sim.running_ids(), ["a", "b"]);
    assert_eq!(sim.waiting_ids(), ["c"]);
    // The preempted request keeps its generated token; it is recomputed with it later.
    assert_eq!(sim.sched.waiting().next().unwrap().output().len(), 1);
    sim.run(40);
    assert!(sim.preemptions >= 1);
    sim.check_drained();
    // The same requests without KV pressure generate the same tokens.
    let mut roomy = Sim::new(Sizes::default());
    for (k, id) in ["a", "b", "c"].into_iter().enumerate() {
        roomy.add(id, req(k as u32, 8, vec![]), 6).unwrap();
    }
    roomy.run(40);
    assert_eq!(roomy.preemptions, 0);
    assert_eq!(roomy.emitted, sim.emitted);
}

#[test]
fn a_request_that_preempts_itself_stops_the_running_queue_and_no_one_is_admitted() {
    // 4 usable blocks: a's prompt fills 2, b's fills 1.
    let mut sim = Sim::new(Sizes {
        num_blocks: 5,
        ..Sizes::default()
    });
    sim.add("a", req(1, 8, vec![]), 4).unwrap();
    sim.add("b", req(2, 4, vec![]), 6).unwrap();
    sim.step();
    sim.add("c", req(3, 2, vec![]), 1).unwrap();
    // a's ninth token takes the spare block; b's fifth needs another and b is the last running one.
    let out = sim.step();
    assert_eq!(out.preempted, [RequestId::from("b")]);
    assert_eq!(sim.last_ids, ["a"]);
    assert_eq!(
        sim.waiting_ids(),
        ["b", "c"],
        "nothing admitted in a step with preemption"
    );
    sim.run(40);
    sim.check_drained();
}

#[test]
fn the_encoder_compute_budget_limits_new_images_per_step() {
    let mut sim = Sim::new(Sizes {
        encoder_cache: 16,
        encoder_budget: 8,
        ..Sizes::default()
    });
    let (x, y) = (image(2, 6, "x"), image(2, 6, "y"));
    sim.add("a", req(1, 10, vec![x]), 1).unwrap();
    sim.add("b", req(2, 10, vec![y]), 1).unwrap();
    let out = sim.step();
    // a's image takes 6 of the 8; b runs only the text before its image.
    assert_eq!(out.scheduled[0].encode, [0]);
    assert_eq!((out.scheduled[1].num_new, out.scheduled[1].encode.len()), (2, 0));
    let out = sim.step();
    assert_eq!(out.scheduled.iter().map(|s| s.encode.len()).sum::<usize>(), 1);
    sim.run(10);
    sim.check_drained();
}

#[test]
fn cached_encoder_outputs_cost_nothing() {
    let mut sim = Sim::new(Sizes {
        encoder_cache: 6,
        encoder_budget: 6,
        ..Sizes::default()
    });
    let x = image(1, 6, "x");
    sim.add("a", req(1, 9, vec![x.clone()]), 1).unwrap();
    sim.add("b", req(2, 9, vec![x]), 1).unwrap();
    let out = sim.step();
    assert_eq!(out.scheduled.len(), 2);
    assert_eq!(out.scheduled[0].encode, [0]);
    assert!(
        out.scheduled[1].encode.is_empty(),
        "b reuses a's output in the same step"
    );
    assert_eq!(out.num_tokens(), 18);
    sim.run(10);
    sim.check_drained();
}

#[test]
fn a_running_request_blocked_on_its_image_is_skipped_not_the_ones_after_it() {
    let mut sim = Sim::new(Sizes {
        encoder_cache: 18,
        encoder_budget: 6,
        ..Sizes::default()
    });
    let (z, y, x) = (image(0, 6, "z"), image(4, 6, "y"), image(3, 6, "x"));
    sim.add("w", req(1, 8, vec![z]), 1).unwrap();
    sim.add("b", req(2, 10, vec![y]), 2).unwrap();
    sim.add("a", req(3, 9, vec![x]), 2).unwrap();
    sim.add("c", req(4, 2, vec![]), 4).unwrap();
    // w's image takes the whole compute budget: b and a run their text up to their images.
    let out = sim.step();
    let got: Vec<(usize, usize)> = out.scheduled.iter().map(|s| (s.start, s.num_new)).collect();
    assert_eq!(got, [(0, 8), (0, 4), (0, 3), (0, 2)]);
    // b's image takes the budget now; a cannot start its image and is skipped, c still runs.
    let out = sim.step();
    assert_eq!(sim.last_ids, ["b", "c"]);
    assert_eq!(out.scheduled[0].encode, [0]);
    assert_eq!(sim.running_ids(), ["b", "a", "c"]);
    let out = sim.step();
    assert_eq!(sim.last_ids, ["b", "a", "c"]);
    assert_eq!(out.scheduled[1].encode, [0]);
    sim.run(10);
    sim.check_drained();
}

#[test]
fn a_prefix_hit_covering_an_image_needs_no_encoder() {
    let mut sim = Sim::new(Sizes::default());
    let r = req(1, 13, vec![image(2, 6, "x")]);
    sim.add("a", r.clone(), 1).unwrap();
    sim.run(5);
    sim.add("b", r, 1).unwrap();
    let out = sim.step();
    // Blocks 0..3 (12 tokens) hit; only the last token is computed, with no image in range.
    assert_eq!((out.scheduled[0].num_cached, out.scheduled[0].num_new), (12, 1));
    assert!(out.scheduled[0].encode.is_empty());
    sim.run(5);
    sim.check_drained();
}

#[test]
fn aborting_a_waiting_request_after_a_stopped_attempt_leaves_no_encoder_reference() {
    // a leaves image x in the encoder cache, unreferenced.
    let mut sim = Sim::new(Sizes {
        num_blocks: 5,
        ..Sizes::default()
    });
    let x = image(0, 4, "x");
    sim.add("a", req(1, 5, vec![x.clone()]), 1).unwrap();
    sim.run(5);
    assert_eq!(sim.encoder_refs("x"), Some(vec![]));
    // b holds 3 of the 4 blocks; c (x plus text, 2 blocks) then finds x cached but no KV room.
    sim.add("b", req(2, 12, vec![]), 4).unwrap();
    sim.step();
    sim.add("c", req(3, 6, vec![x]), 1).unwrap();
    sim.step();
    assert_eq!(sim.last_ids, ["b"]);
    assert_eq!(sim.waiting_ids(), ["c"]);
    assert_eq!(
        sim.encoder_refs("x"),
        Some(vec![]),
        "the stopped attempt keeps no reference"
    );
    assert!(sim.sched.abort(&"c".into()).unwrap().is_some());
    assert_eq!(sim.encoder_refs("x"), Some(vec![]), "no reference left behind");
    assert!(sim.sched.abort(&"c".into()).unwrap().is_none());
    sim.run(10);
    sim.check_drained();
}

#[test]
fn a_waiting_request_that_does_not_fit_holds_no_encoder_room() {
    // 9 usable KV blocks, room for 12 encoder tokens. r1 has images b (5) and c (8); r2 has b.
    let mut sim = Sim::new(Sizes {
        num_blocks: 10,
        prefix_caching: false,
        encoder_cache: 12,
        encoder_budget: 12,
        max_num_seqs: 2,
        max_num_batched_tokens: 34,
        ..Sizes::default()
    });
    let a = vec![image(1, 3, "a")];
    let bc = vec![image(7, 5, "b"), image(21, 8, "c")];
    let b = vec![image(7, 5, "b")];
    sim.add("r0", req(0, 5, a), 2).unwrap();
    sim.add("r1", req(1, 30, bc), 1).unwrap();
    sim.add("r2", req(2, 13, b), 1).unwrap();
    sim.step();
    let out = sim.step();
    assert_eq!(out.preempted, [RequestId::from("r1")]);
    // r1 runs up to c while r2 finds b cached but no KV blocks. Had r2 kept its reference to b,
    // c would never fit beside it, and r2 would wait forever for r1's blocks.
    sim.step();
    assert_eq!(sim.last_ids, ["r1"]);
    assert_eq!(sim.waiting_ids(), ["r2"]);
    assert_eq!(sim.encoder_refs("b"), Some(vec![]));
    let out = sim.step();
    assert_eq!(
        (sim.last_ids.as_slice(), out.scheduled[0].encode.as_slice()),
        (&["r1".to_string()][..], &[1][..])
    );
    sim.run(10);
    sim.check_drained();
}

#[test]
fn aborting_running_and_waiting_requests_releases_everything() {
    let mut sim = Sim::new(Sizes {
        max_num_seqs: 1,
        ..Sizes::default()
    });
    let x = image(1, 4, "x");
    sim.add("a", req(1, 9, vec![x.clone()]), 5).unwrap();
    sim.add("b", req(2, 9, vec![x]), 5).unwrap();
    sim.step();
    assert_eq!((sim.sched.num_running(), sim.sched.num_waiting()), (1, 1));
    assert!(sim.sched.abort(&"a".into()).unwrap().is_some());
    assert!(sim.sched.abort(&"b".into()).unwrap().is_some());
    sim.check_drained();
}

#[test]
fn requests_that_can_never_run_are_refused() {
    let mut sim = Sim::new(Sizes {
        num_blocks: 5,
        max_model_len: 20,
        encoder_cache: 8,
        encoder_budget: 6,
        ..Sizes::default()
    });
    let refused = |r: Result<(), SchedError>| matches!(r, Err(SchedError::BadRequest(_)));
    assert!(refused(sim.add("e", (vec![], vec![]), 1)));
    assert!(refused(sim.add("long", req(1, 20, vec![]), 1)));
    assert!(refused(sim.add("total", req(1, 10, vec![]), 11)));
    // 17 tokens need 5 blocks of 4; only 4 are usable.
    assert!(refused(sim.add("kv", req(1, 10, vec![]), 7)));
    assert!(refused(sim.add("big", req(1, 10, vec![image(0, 7, "big")]), 1)));
    let overlap = vec![image(0, 3, "p"), image(2, 3, "q")];
    assert!(refused(sim.add("overlap", req(1, 10, overlap), 1)));
    assert!(refused(sim.add("outside", req(1, 10, vec![image(8, 3, "p")]), 1)));
    assert!(refused(sim.add("empty", req(1, 10, vec![image(8, 0, "p")]), 1)));
    sim.add("ok", req(1, 10, vec![]), 6).unwrap();
    assert!(refused(sim.add("ok", req(2, 4, vec![]), 1)));
    sim.run(10);
    sim.check_drained();
}

mod proptests {
    use super::*;
    use proptest::prelude::*;

    /// One request: a shared prefix group, its length, images from a small pool, when it arrives
    /// and maybe when it is aborted.
    #[derive(Debug, Clone)]
    struct Spec {
        group: u32,
        shared: usize,
        len: usize,
        images: Vec<(usize, usize)>,
        max_tokens: usize,
        arrive: usize,
        abort: Option<usize>,
    }

    /// Image sizes by pool index: the same hash always has the same size.
    const POOL: [usize; 4] = [3, 5, 8, 12];

    fn spec() -> impl Strategy<Value = Spec> {
        (
            0..3u32,
            0..24usize,
            1..40usize,
            prop::collection::vec((0..12usize, 0..POOL.len()), 0..3),
            1..8usize,
            0..12usize,
            prop::option::weighted(0.15, 0..30usize),
        )
            .prop_map(|(group, shared, len, images, max_tokens, arrive, abort)| Spec {
                group,
                shared,
                len,
                images,
                max_tokens,
                arrive,
                abort,
            })
    }

    /// Token ids and image spans of a spec: images placed after gaps, then the shared prefix of its
    /// group overwritten at the start, so requests of a group share leading blocks.
    fn build(k: usize, s: &Spec) -> (Vec<TokenId>, Vec<MmSpan>) {
        let mut spans = Vec::new();
        let mut at = 0;
        for &(gap, img) in &s.images {
            at += gap;
            spans.push(image(at, POOL[img], &format!("img{img}")));
            at += POOL[img];
        }
        let len = s.len.max(at + 1);
        let shared = s.shared.min(spans.first().map_or(len, |f| f.offset));
        let (mut p, spans) = req(100 + k as u32, len, spans);
        for (i, t) in p.iter_mut().enumerate().take(shared) {
            *t = s.group * 100 + i as u32;
        }
        (p, spans)
    }

    fn sizes() -> impl Strategy<Value = Sizes> {
        (
            1..5usize,
            4..40usize,
            1..48usize,
            1..5usize,
            0..16usize,
            0..16usize,
            any::<bool>(),
            0..12usize,
        )
            .prop_map(
                |(bs_log, blocks, mnbt, seqs, extra_cache, extra_budget, prefix_caching, threshold)| {
                    let block_size = 1 << (bs_log - 1);
                    Sizes {
                        num_blocks: blocks,
                        block_size,
                        max_model_len: 128,
                        prefix_caching,
                        encoder_cache: 12 + extra_cache,
                        encoder_budget: 12 + extra_budget,
                        max_num_seqs: seqs,
                        max_num_batched_tokens: mnbt,
                        long_prefill_token_threshold: threshold,
                    }
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Random requests, budgets and aborts: every step keeps the budgets and the KV contents
        /// (checked inside `Sim::step`), every request that was not aborted generates exactly
        /// `max_tokens` tokens, and nothing stays allocated at the end.
        #[test]
        fn scheduler_keeps_budgets_and_releases_everything(
            sizes in sizes(),
            specs in prop::collection::vec(spec(), 1..8),
        ) {
            let mut sim = Sim::new(sizes);
            let mut accepted = Vec::new();
            let mut aborted = HashSet::new();
            let mut step = 0;
            while step < 2000 {
                for (k, s) in specs.iter().enumerate() {
                    let id = format!("r{k}");
                    if s.arrive == step && sim.add(&id, build(k, s), s.max_tokens).is_ok() {
                        accepted.push(k);
                    }
                    if s.abort == Some(step) && sim.sched.abort(&id.as_str().into()).unwrap().is_some() {
                        aborted.insert(k);
                    }
                }
                if !sim.sched.has_unfinished() && step > 12 {
                    break;
                }
                if sim.sched.has_unfinished() {
                    sim.step();
                }
                step += 1;
            }
            prop_assert!(!sim.sched.has_unfinished(), "requests left after 2000 steps");
            for k in accepted {
                let got = sim.emitted.get(&RequestId::from(format!("r{k}"))).map_or(0, Vec::len);
                if !aborted.contains(&k) {
                    prop_assert_eq!(got, specs[k].max_tokens);
                }
            }
            sim.check_drained();
        }

        /// Requests admitted together that outgrow the KV cache: preemption happens, and the
        /// preempted requests finish with the tokens they would have generated without it.
        #[test]
        fn preempted_requests_complete_with_the_same_tokens(
            prompts in prop::collection::vec(3..12usize, 3..7),
            max_tokens in 6..16usize,
            block_size in 1..5usize,
            slack in 0..3usize,
        ) {
            let blocks = |n: usize| n.div_ceil(block_size);
            let need = prompts.iter().map(|&p| blocks(p + max_tokens)).max().unwrap_or(1);
            let usable = need.max(prompts.iter().map(|&p| blocks(p)).sum::<usize>() + slack);
            // Growing in lockstep, the batch needs more blocks than there are before anyone finishes.
            prop_assume!(prompts.iter().map(|&p| blocks(p + max_tokens - 1)).sum::<usize>() > usable);
            let run = |usable: usize| {
                let mut sim = Sim::new(Sizes {
                    num_blocks: usable + 1,
                    block_size,
                    max_num_batched_tokens: 256,
                    ..Sizes::default()
                });
                for (k, &p) in prompts.iter().enumerate() {
                    sim.add(&format!("r{k}"), req(k as u32, p, vec![]), max_tokens).unwrap();
                }
                sim.run(1000);
                sim.check_drained();
                sim
            };
            let tight = run(usable);
            let roomy = run(prompts.iter().map(|&p| blocks(p + max_tokens)).sum());
            prop_assert!(tight.preemptions > 0);
            prop_assert_eq!(roomy.preemptions, 0);
            prop_assert_eq!(&tight.emitted, &roomy.emitted);
        }
    }
}

/// Per decode step and request, the scheduler's bookkeeping (admission, lookups by id, tokens
/// pushed, finished requests removed) compares as many request ids at a batch of 256 as at 8: a
/// lookup that scanned the running list made it grow with the batch (measured: 0.5 · batch
/// comparisons per lookup).
#[test]
fn per_step_work_per_request_does_not_grow_with_the_batch() {
    use crate::cache::ID_COMPARISONS;
    let per_request_and_step = |batch: usize| {
        let sizes = Sizes {
            num_blocks: 4 * batch + 1,
            block_size: 16,
            max_model_len: 64,
            max_num_seqs: batch,
            max_num_batched_tokens: 8 * batch,
            ..Sizes::default()
        };
        let mut sim = Sim::new(sizes);
        for r in 0..batch {
            sim.add(&format!("r{r}"), (vec![1 + r as TokenId; 8], vec![]), 40)
                .unwrap();
        }
        let steps = 24;
        ID_COMPARISONS.with(|c| c.set(0));
        for step in 0..steps {
            let out = sim.sched.schedule().unwrap();
            assert_eq!(out.scheduled.len(), batch, "every request runs every step");
            for s in &out.scheduled {
                let seq = sim.sched.get(&s.id).unwrap();
                if s.end() == seq.len() {
                    let token = fake_token(seq);
                    assert!(sim.sched.push_token(&s.id, token).unwrap());
                }
            }
            // A few requests finish and as many arrive, every step.
            let done: Vec<RequestId> = out.scheduled.iter().take(2).map(|s| s.id.clone()).collect();
            assert_eq!(sim.sched.finish(&done).unwrap().len(), 2);
            for k in 0..2 {
                sim.add(&format!("s{step}-{k}"), (vec![7; 8], vec![]), 40).unwrap();
            }
        }
        ID_COMPARISONS.with(|c| c.get()) as f64 / (steps * batch) as f64
    };
    let (small, large) = (per_request_and_step(8), per_request_and_step(256));
    assert!(
        large <= 2.0 * small + 1.0,
        "id comparisons per request and step: {small:.2} at a batch of 8, {large:.2} at 256"
    );
}
