//! Sampling: penalties, temperature, top-k, top-p, min-p, a seeded generator per request, and the
//! log-probabilities of the top tokens (of the model's distribution, before any processing, as vLLM
//! reports them by default).

use crate::backend::cpu::vector_math::log_sum_exp;
use std::borrow::Cow;
use std::collections::HashMap;

/// The temperature at or below which sampling is greedy.
const GREEDY_TEMPERATURE: f32 = 1e-5;

/// How to pick the next token.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass (1 = off).
    pub top_p: f32,
    /// Keep the k most likely (0 or -1 = off).
    pub top_k: i32,
    /// Drop tokens below `min_p × p_max` (0 = off).
    pub min_p: f32,
    /// Seed of this request's generator (None: derived from the request order).
    pub seed: Option<u64>,
    /// Divides positive logits (multiplies negative ones) of tokens already seen (1 = off).
    pub repetition_penalty: f32,
    /// Subtracted once from the logits of generated tokens.
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logits of generated tokens.
    pub frequency_penalty: f32,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Extra token ids that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Report this many top log-probabilities per generated token.
    pub logprobs: Option<usize>,
    /// Added to the logits of these tokens before sampling (OpenAI's `logit_bias`, each in
    /// [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks the ranges the OpenAI API allows.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be a non-negative number, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!(
                "repetition_penalty must be positive, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(format!(
                "logit_bias values must be in [-100, 100], got {b} for token {t}"
            ));
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        Ok(())
    }

    /// Checks that every token id the settings name is below `vocab_size`.
    pub fn validate_token_ids(&self, vocab_size: usize) -> Result<(), String> {
        let ids = self.logit_bias.iter().map(|(t, _)| t).chain(&self.stop_token_ids);
        match ids.filter(|&&t| t as usize >= vocab_size).collect::<Vec<_>>() {
            bad if bad.is_empty() => Ok(()),
            bad => Err(format!(
                "token ids {bad:?} are outside the vocabulary of {vocab_size} tokens"
            )),
        }
    }
}

/// SplitMix64: small, seedable, the same on every platform.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The chosen token and, when asked, the top log-probabilities `(token, logprob)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The next token.
    pub token: u32,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// Picks the next token from `logits` given the tokens so far (`prompt` and `output`). Only ids
/// below `allowed` are chosen or listed (the rest of the row is padding with no token); the
/// log-probabilities are the model's, normalized over the whole row as transformers does.
pub fn sample(
    logits: &[f32],
    allowed: usize,
    prompt: &[u32],
    output: &[u32],
    p: &SamplingParams,
    rng: &mut Rng,
) -> Sampled {
    let lz = log_sum_exp(logits);
    let allowed = allowed.clamp(1, logits.len().max(1));
    let top = top_logprobs(logits, allowed, lz, p.logprobs.unwrap_or(0));
    let penalised = p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
    let l = if p.logit_bias.is_empty() && !penalised {
        Cow::Borrowed(&logits[..allowed])
    } else {
        let mut l = logits[..allowed].to_vec();
        for &(t, b) in &p.logit_bias {
            if let Some(v) = l.get_mut(t as usize) {
                *v += b;
            }
        }
        apply_penalties(&mut l, prompt, output, p);
        Cow::Owned(l)
    };
    let token = DeviceSampling::new(p, allowed, rng).choose(&l);
    Sampled {
        token: token as u32,
        logprob: logits[token] - lz,
        top,
    }
}

/// The `k` most likely ids below `allowed` with their log-probabilities, best first (ties by id).
fn top_logprobs(logits: &[f32], allowed: usize, lz: f32, k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let logp = |i: usize| logits[i] - lz;
    let mut idx: Vec<usize> = (0..allowed).collect();
    let k = k.min(idx.len());
    idx.select_nth_unstable_by(k - 1, |&a, &b| logp(b).total_cmp(&logp(a)));
    idx.truncate(k);
    idx.sort_by(|&a, &b| logp(b).total_cmp(&logp(a)).then(a.cmp(&b)));
    idx.into_iter().map(|i| (i as u32, logp(i))).collect()
}

/// One row's choice with its random number already drawn: what [`sample`] does once the logit bias
/// and penalties are applied, and what [`crate::backend::Backend::sample`] does on the device for a
/// request that needs neither (see [`SamplingParams::samples_on_device`]). [`Self::pick`] is the
/// host's definition, which the CPU backend runs and the device kernels reproduce.
///
/// The wgpu kernel sums in f32 where this sums in f64 (the normaliser, the running mass), so the
/// two can choose different tokens only on a near-tie: when the draw `u·z` falls within the f32
/// rounding of the running sums (typically around 1e-7 of the mass, at most a few 1e-5 for a
/// 151,936-wide row) of the boundary between two candidates, or when a candidate's running top-p
/// mass or min-p ratio is that close to its cut-off. Greedy choice and the top-k cut are exact
/// (comparisons of the logits themselves). Measured on lavapipe: 1 of 23,166 seeded draws differed,
/// a plain-temperature draw with `u·z` within 1e-7 of the boundary between ids 977 and 978.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSampling {
    /// Temperature; at most 1e-5 means greedy.
    pub temperature: f32,
    /// Keep the k most likely (0 = off).
    pub top_k: usize,
    /// Nucleus mass (1 = off).
    pub top_p: f32,
    /// Drop tokens below `min_p × p_max` (0 = off).
    pub min_p: f32,
    /// Only ids below this are chosen (clamped to the row's width, at least 1).
    pub allowed: usize,
    /// The uniform in [0, 1) the draw walks with (0 when greedy: nothing is drawn).
    pub u: f64,
}

impl SamplingParams {
    /// Whether a request's tokens can be sampled on the device from the logits alone: it asks for
    /// no top log-probabilities, no logit bias and no penalties (those need the host's sampler).
    pub fn samples_on_device(&self) -> bool {
        self.logprobs.unwrap_or(0) == 0
            && self.logit_bias.is_empty()
            && self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
    }

    /// Whether the request takes the most likely token (temperature at most 1e-5).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= GREEDY_TEMPERATURE
    }
}

impl DeviceSampling {
    /// The choice `p` asks for among ids below `allowed`. Unless greedy it takes one uniform from
    /// `rng`, the one [`sample`] draws for the token, so the request's stream is the same whether
    /// it samples on the host or on the device.
    pub fn new(p: &SamplingParams, allowed: usize, rng: &mut Rng) -> Self {
        let mut s = DeviceSampling {
            temperature: p.temperature,
            top_k: usize::try_from(p.top_k).unwrap_or(0),
            top_p: p.top_p,
            min_p: p.min_p,
            allowed,
            u: 0.0,
        };
        if !s.is_greedy() {
            s.u = rng.uniform();
        }
        s
    }

    /// Whether the most likely token is taken.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= GREEDY_TEMPERATURE
    }

    /// Whether top-k, top-p or min-p cuts the candidates: the draw then walks them by descending
    /// logit (ties by id); without cut-offs it walks the ids in order with the most likely one
    /// swapped to the front (no sort of the vocabulary).
    pub fn has_cutoffs(&self) -> bool {
        self.top_k > 0 || self.min_p > 0.0 || self.top_p < 1.0
    }

    /// The token for one logits row and its log-probability under the model (normalized over the
    /// whole row): the host's definition of [`crate::backend::Backend::sample`].
    pub fn pick(&self, row: &[f32]) -> (u32, f32) {
        let allowed = self.allowed.clamp(1, row.len().max(1));
        let token = self.choose(&row[..allowed]);
        (token as u32, row[token] - log_sum_exp(row))
    }

    /// The chosen index of `l`, the processed logits of the allowed ids.
    fn choose(&self, l: &[f32]) -> usize {
        if self.is_greedy() {
            argmax(l)
        } else {
            self.draw(l)
        }
    }

    /// Temperature, top-k, top-p and min-p, then the draw with [`Self::u`].
    fn draw(&self, l: &[f32]) -> usize {
        let mut idx: Vec<usize> = (0..l.len()).collect();
        let by_logit = |a: &usize, b: &usize| l[*b].total_cmp(&l[*a]).then(a.cmp(b));
        let k = self.top_k;
        if k > 0 && k < idx.len() {
            idx.select_nth_unstable_by(k - 1, by_logit);
            idx.truncate(k);
        }
        // The cut-offs below need descending order; plain temperature sampling does not (a full
        // sort of a 150k vocabulary per token is the sampler's main cost).
        if self.has_cutoffs() {
            idx.sort_by(by_logit);
        } else {
            let best = argmax(l);
            idx.swap(0, best);
        }
        let max = l[idx[0]];
        let mut probs: Vec<f64> = idx
            .iter()
            .map(|&i| (((l[i] - max) / self.temperature) as f64).exp())
            .collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= z);
        if self.min_p > 0.0 {
            let cut = probs[0] * self.min_p as f64;
            let keep = probs.iter().take_while(|&&q| q >= cut).count().max(1);
            idx.truncate(keep);
            probs.truncate(keep);
        }
        if self.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = 0;
            for q in &probs {
                keep += 1;
                acc += q;
                if acc >= self.top_p as f64 {
                    break;
                }
            }
            idx.truncate(keep);
            probs.truncate(keep);
        }
        let z: f64 = probs.iter().sum();
        let mut u = self.u * z;
        for (i, q) in idx.iter().zip(&probs) {
            if u < *q {
                return *i;
            }
            u -= q;
        }
        idx[idx.len() - 1]
    }
}

fn argmax(l: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best
}

fn apply_penalties(l: &mut [f32], prompt: &[u32], output: &[u32], p: &SamplingParams) {
    if p.repetition_penalty != 1.0 {
        for &t in prompt.iter().chain(output) {
            if let Some(v) = l.get_mut(t as usize) {
                *v = if *v > 0.0 {
                    *v / p.repetition_penalty
                } else {
                    *v * p.repetition_penalty
                };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(v) = l.get_mut(t as usize) {
                *v -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_and_logprobs() {
        let logits = [1.0, 3.0, 2.0, -1.0];
        let s = sample(
            &logits,
            usize::MAX,
            &[],
            &[],
            &SamplingParams {
                logprobs: Some(2),
                ..params()
            },
            &mut Rng::new(0),
        );
        assert_eq!(s.token, 1);
        let z: f32 = logits.iter().map(|l: &f32| l.exp()).sum();
        assert!((s.logprob - (3.0 - z.ln())).abs() < 1e-6);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn penalties_change_the_choice() {
        let logits = [2.0, 1.9];
        let p = SamplingParams {
            repetition_penalty: 1.2,
            ..params()
        };
        assert_eq!(sample(&logits, usize::MAX, &[0], &[], &p, &mut Rng::new(0)).token, 1);
        let p = SamplingParams {
            frequency_penalty: 0.05,
            ..params()
        };
        assert_eq!(
            sample(&logits, usize::MAX, &[], &[0, 0, 0], &p, &mut Rng::new(0)).token,
            1
        );
    }

    #[test]
    fn seeded_draws_repeat_and_filters_bound_them() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 0.8,
            seed: Some(7),
            ..Default::default()
        };
        let a: Vec<u32> = (0..20)
            .scan(Rng::new(7), |r, _| {
                Some(sample(&logits, usize::MAX, &[], &[], &p, r).token)
            })
            .collect();
        let b: Vec<u32> = (0..20)
            .scan(Rng::new(7), |r, _| {
                Some(sample(&logits, usize::MAX, &[], &[], &p, r).token)
            })
            .collect();
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
        let top2 = SamplingParams { top_k: 2, ..p.clone() };
        let mut sorted: Vec<usize> = (0..50).collect();
        sorted.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
        let mut r = Rng::new(1);
        for _ in 0..50 {
            let t = sample(&logits, usize::MAX, &[], &[], &top2, &mut r).token as usize;
            assert!(t == sorted[0] || t == sorted[1]);
        }
        let tiny_p = SamplingParams { top_p: 1e-6, ..p };
        assert_eq!(
            sample(&logits, usize::MAX, &[], &[], &tiny_p, &mut r).token as usize,
            sorted[0]
        );
    }

    /// The device's definition is the host sampler without bias and penalties: the same tokens and
    /// log-probabilities from the same seeds, one uniform per drawn token and none when greedy.
    #[test]
    fn device_sampling_picks_as_the_host_sampler_from_the_same_stream() {
        let logits: Vec<f32> = (0..300).map(|i| (i as f32 * 0.61).sin() * 4.0).collect();
        let drawn = SamplingParams {
            temperature: 0.9,
            ..Default::default()
        };
        let cut = SamplingParams {
            top_k: 40,
            top_p: 0.8,
            min_p: 0.02,
            ..drawn.clone()
        };
        for (p, draws) in [(params(), 0), (drawn, 1), (cut, 1)] {
            assert!(p.samples_on_device());
            let (mut host, mut device) = (Rng::new(3), Rng::new(3));
            for _ in 0..20 {
                let s = sample(&logits, 250, &[], &[], &p, &mut host);
                let (token, logprob) = DeviceSampling::new(&p, 250, &mut device).pick(&logits);
                assert_eq!((s.token, s.logprob), (token, logprob));
                assert!(token < 250);
            }
            let mut fresh = Rng::new(3);
            for _ in 0..20 * draws {
                fresh.next_u64();
            }
            let next = fresh.next_u64();
            assert_eq!((host.next_u64(), device.next_u64()), (next, next));
        }
    }

    #[test]
    fn only_bias_penalties_and_top_logprobs_keep_sampling_on_the_host() {
        let on_host = [
            SamplingParams {
                logprobs: Some(1),
                ..params()
            },
            SamplingParams {
                logit_bias: vec![(1, 1.0)],
                ..params()
            },
            SamplingParams {
                repetition_penalty: 1.1,
                ..params()
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..params()
            },
            SamplingParams {
                frequency_penalty: -0.5,
                ..params()
            },
        ];
        assert!(on_host.iter().all(|p| !p.samples_on_device()));
        let chosen_only = SamplingParams {
            logprobs: Some(0),
            top_k: 5,
            ..Default::default()
        };
        assert!(chosen_only.samples_on_device());
    }

    #[test]
    fn validation() {
        assert!(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            max_tokens: 0,
            ..Default::default()
        }
        .validate()
        .is_err());
        for bad in [-3e38, -2.5, 2.01, f32::NAN] {
            let p = SamplingParams {
                frequency_penalty: bad,
                ..Default::default()
            };
            assert!(p.validate().unwrap_err().contains("frequency_penalty"), "{bad}");
            let p = SamplingParams {
                presence_penalty: bad,
                ..Default::default()
            };
            assert!(p.validate().unwrap_err().contains("presence_penalty"), "{bad}");
        }
        let biased = |b: f32| SamplingParams {
            logit_bias: vec![(3, b)],
            ..Default::default()
        };
        assert!(biased(100.0).validate().is_ok());
        assert!(biased(100.5).validate().is_err());
        assert!(biased(f32::NAN).validate().is_err());
        assert!(biased(1.0).validate_token_ids(4).is_ok());
        assert!(biased(1.0).validate_token_ids(3).unwrap_err().contains("[3]"));
        let stop = SamplingParams {
            stop_token_ids: vec![9],
            ..Default::default()
        };
        assert!(stop.validate_token_ids(9).is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }

    #[test]
    fn logit_bias_moves_the_choice() {
        let logits = [2.0, 1.0, 0.0];
        let p = SamplingParams {
            logit_bias: vec![(2, 2.5), (0, -100.0)],
            ..params()
        };
        assert_eq!(sample(&logits, usize::MAX, &[], &[], &p, &mut Rng::new(0)).token, 2);
        // The reported log-probability is the model's, before the bias.
        let s = sample(&logits, usize::MAX, &[], &[], &p, &mut Rng::new(0));
        assert!((s.logprob - (logits[2] - log_sum_exp(&logits))).abs() < 1e-6);
    }
}
