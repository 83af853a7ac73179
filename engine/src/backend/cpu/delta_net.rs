//! Qwen3.5's Gated DeltaNet on the CPU, in its recurrent form for prefill and decode alike
//! (transformers' `torch_recurrent_gated_delta_rule` after `causal_conv1d_update`). The chunked
//! form exists for GPUs' parallelism; on a CPU the recurrence costs about
//! `6 · heads · key_dim · value_dim` flops per token and layer (1.6 M for Qwen3.5-2B's shape), under
//! 1 % of the token's matrix products, so one form serves both.

use super::isa::fastest;
use crate::backend::{StateLayout, StateSeq};
use crate::memory::ledger::{Category, Held, MemoryLedger};
use crate::parallel::for_each_piece;

/// Every Gated DeltaNet layer's slots: conv windows `[slots, conv_len, conv_dim]` (oldest input
/// first, vLLM's "SD" layout) and recurrent states `[slots, heads, key_dim, value_dim]`.
#[derive(Debug)]
pub struct CpuStates {
    pub(super) layout: StateLayout,
    conv: Vec<Vec<f32>>,
    recurrent: Vec<Vec<f32>>,
    _held: Held,
}

impl CpuStates {
    /// Zeroed states of `layout`, recorded as state cache.
    pub(super) fn new(layout: StateLayout, ledger: &MemoryLedger) -> Self {
        let (conv, rec) = layout.slot_values();
        CpuStates {
            layout,
            conv: (0..layout.layers).map(|_| vec![0.0; layout.slots * conv]).collect(),
            recurrent: (0..layout.layers).map(|_| vec![0.0; layout.slots * rec]).collect(),
            _held: ledger.hold(Category::StateCache, layout.bytes(4)),
        }
    }
}

/// One layer's inputs on the host (see [`crate::backend::DeltaNetInput`]).
pub(super) struct Inputs<'a> {
    pub qkv: &'a [f32],
    pub a: &'a [f32],
    pub b: &'a [f32],
    pub conv: &'a [f32],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
}

/// torch's `softplus` (β = 1, linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Scales `x` to unit length as FLA and transformers do: `x / √(Σx² + 10⁻⁶)`.
fn l2_normalize(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Runs layer `layer` over `seqs`, updating their slots in `states`; returns `[n, heads·value_dim]`.
pub(super) fn run(states: &mut CpuStates, layer: usize, x: &Inputs<'_>, seqs: &[StateSeq]) -> Result<Vec<f32>, String> {
    let l = states.layout;
    let (conv_dim, len, kernel) = (l.conv_dim, l.conv_len, l.conv_len + 1);
    let (heads, dk, dv) = (l.heads, l.key_dim, l.value_dim);
    let key_width = l.key_heads * dk;
    let n = x.qkv.len() / conv_dim.max(1);
    let group = heads / l.key_heads.max(1);
    let sizes_fit = conv_dim == 2 * key_width + heads * dv
        && x.qkv.len() == n * conv_dim
        && x.a.len() == n * heads
        && x.b.len() == n * heads
        && x.conv.len() == conv_dim * kernel
        && x.a_log.len() == heads
        && x.dt_bias.len() == heads
        && group * l.key_heads == heads
        && layer < l.layers;
    if !sizes_fit {
        return Err(format!(
            "gated delta net: inputs do not fit the state layout {l:?} (layer {layer}, {} qkv values)",
            x.qkv.len()
        ));
    }
    if let Some(s) = seqs.iter().find(|s| s.slot >= l.slots || s.start + s.len > n) {
        return Err(format!(
            "gated delta net: sequence {s:?} is outside {n} rows or {} slots",
            l.slots
        ));
    }
    let (conv_values, rec_values) = l.slot_values();
    let mut out = vec![0f32; n * heads * dv];
    let scale = 1.0 / (dk as f32).sqrt();
    for s in seqs {
        let window = &mut states.conv[layer][s.slot * conv_values..(s.slot + 1) * conv_values];
        let state = &mut states.recurrent[layer][s.slot * rec_values..(s.slot + 1) * rec_values];
        if s.fresh {
            window.fill(0.0);
            state.fill(0.0);
        }
        // The conv over the sequence's rows (SiLU after it), then q and k L2-normalised and q
        // scaled, token by token: cheap beside the delta rule, which then runs per head.
        let rows = &x.qkv[s.start * conv_dim..(s.start + s.len) * conv_dim];
        let mut y = vec![0f32; rows.len()];
        for (row, yrow) in rows.chunks_exact(conv_dim).zip(y.chunks_exact_mut(conv_dim)) {
            for (c, yc) in yrow.iter_mut().enumerate() {
                let w = &x.conv[c * kernel..(c + 1) * kernel];
                let mut acc = w[len] * row[c];
                for j in 0..len {
                    acc += w[j] * window[j * conv_dim + c];
                }
                *yc = acc / (1.0 + (-acc).exp());
            }
            if len > 0 {
                window.copy_within(conv_dim.., 0);
                window[(len - 1) * conv_dim..].copy_from_slice(row);
            }
            let (q, k) = yrow[..2 * key_width].split_at_mut(key_width);
            for h in 0..l.key_heads {
                l2_normalize(&mut q[h * dk..(h + 1) * dk]);
                l2_normalize(&mut k[h * dk..(h + 1) * dk]);
            }
            q.iter_mut().for_each(|v| *v *= scale);
        }
        // Heads are independent over the whole sequence: each takes its state and its outputs.
        let mut head_out = vec![0f32; heads * s.len * dv];
        let mut work: Vec<(&mut [f32], &mut [f32])> = state
            .chunks_exact_mut(dk * dv)
            .zip(head_out.chunks_exact_mut(s.len * dv))
            .collect();
        let head = Head {
            y: &y,
            a: &x.a[s.start * heads..(s.start + s.len) * heads],
            b: &x.b[s.start * heads..(s.start + s.len) * heads],
            a_log: x.a_log,
            dt_bias: x.dt_bias,
            heads,
            group,
            conv_dim,
            key_width,
            dk,
            dv,
        };
        for_each_piece(&mut work, 1, |h, piece| {
            for (sh, oh) in piece.iter_mut() {
                head.run_fastest(h, sh, oh);
            }
        });
        for (h, oh) in head_out.chunks_exact(s.len * dv).enumerate() {
            for (t, o) in oh.chunks_exact(dv).enumerate() {
                let at = ((s.start + t) * heads + h) * dv;
                out[at..at + dv].copy_from_slice(o);
            }
        }
    }
    Ok(out)
}

/// One value head's delta rule over a sequence's rows (its conv outputs `y`, q and k normalised).
struct Head<'a> {
    y: &'a [f32],
    a: &'a [f32],
    b: &'a [f32],
    a_log: &'a [f32],
    dt_bias: &'a [f32],
    heads: usize,
    group: usize,
    conv_dim: usize,
    key_width: usize,
    dk: usize,
    dv: usize,
}

impl Head<'_> {
    /// Head `h`: `state [dk, dv]` carried through the rows, `out [rows, dv]` written.
    #[inline(always)]
    fn run(&self, h: usize, state: &mut [f32], out: &mut [f32]) {
        let (dk, dv) = (self.dk, self.dv);
        let kh = h / self.group;
        let mut kv_mem = vec![0f32; dv];
        for (t, o) in out.chunks_exact_mut(dv).enumerate() {
            let row = &self.y[t * self.conv_dim..(t + 1) * self.conv_dim];
            let q = &row[kh * dk..(kh + 1) * dk];
            let k = &row[self.key_width + kh * dk..self.key_width + (kh + 1) * dk];
            let v = &row[2 * self.key_width + h * dv..2 * self.key_width + (h + 1) * dv];
            let decay = (-self.a_log[h].exp() * softplus(self.a[t * self.heads + h] + self.dt_bias[h])).exp();
            let beta = 1.0 / (1.0 + (-self.b[t * self.heads + h]).exp());
            kv_mem.fill(0.0);
            for (i, srow) in state.chunks_exact_mut(dv).enumerate() {
                for (m, sv) in kv_mem.iter_mut().zip(srow.iter_mut()) {
                    *sv *= decay;
                    *m += *sv * k[i];
                }
            }
            for (m, &vv) in kv_mem.iter_mut().zip(v) {
                *m = (vv - *m) * beta;
            }
            o.fill(0.0);
            for (i, srow) in state.chunks_exact_mut(dv).enumerate() {
                for ((sv, &d), ov) in srow.iter_mut().zip(kv_mem.iter()).zip(o.iter_mut()) {
                    *sv += k[i] * d;
                    *ov += *sv * q[i];
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn run_avx2(&self, h: usize, state: &mut [f32], out: &mut [f32]) {
        self.run(h, state, out)
    }

    /// [`Head::run`] compiled for the widest instructions this CPU has.
    fn run_fastest(&self, h: usize, state: &mut [f32], out: &mut [f32]) {
        fastest!(avx2_fma => self.run_avx2(h, state, out), _ => self.run(h, state, out))
    }
}

/// Rotate-half rotary over the first `cos.len() / rows` values of each head of `head_dim` in
/// `x [rows, heads·head_dim]`.
pub(super) fn rope_partial(x: &mut [f32], cos: &[f32], sin: &[f32], rows: usize, head_dim: usize) {
    let r = cos.len() / rows.max(1);
    let half = r / 2;
    let cols = x.len() / rows.max(1);
    for (n, row) in x.chunks_exact_mut(cols).enumerate() {
        let (c, s) = (&cos[n * r..(n + 1) * r], &sin[n * r..(n + 1) * r]);
        for head in row.chunks_exact_mut(head_dim) {
            for j in 0..half {
                let (a, b) = (head[j], head[j + half]);
                head[j] = a * c[j] - b * s[j];
                head[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> StateLayout {
        StateLayout {
            layers: 1,
            slots: 2,
            conv_dim: 2 * 2 * 2 + 4 * 3,
            conv_len: 3,
            key_heads: 2,
            heads: 4,
            key_dim: 2,
            value_dim: 3,
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn splitting_a_sequence_across_calls_keeps_its_state() {
        let l = layout();
        let n = 7;
        let (qkv, a, b) = (
            values(n * l.conv_dim, 1),
            values(n * l.heads, 2),
            values(n * l.heads, 3),
        );
        let (conv, a_log, dt) = (values(l.conv_dim * 4, 4), values(l.heads, 5), values(l.heads, 6));
        let inputs = |rows: std::ops::Range<usize>| Inputs {
            qkv: &qkv[rows.start * l.conv_dim..rows.end * l.conv_dim],
            a: &a[rows.start * l.heads..rows.end * l.heads],
            b: &b[rows.start * l.heads..rows.end * l.heads],
            conv: &conv,
            a_log: &a_log,
            dt_bias: &dt,
        };
        let ledger = MemoryLedger::new();
        let mut whole = CpuStates::new(l, &ledger);
        let seq = |len, slot, fresh| StateSeq {
            start: 0,
            len,
            slot,
            fresh,
        };
        let all = run(&mut whole, 0, &inputs(0..n), &[seq(n, 0, true)]).unwrap();
        let mut split = CpuStates::new(l, &ledger);
        let mut parts = run(&mut split, 0, &inputs(0..3), &[seq(3, 1, true)]).unwrap();
        for t in 3..n {
            parts.extend(run(&mut split, 0, &inputs(t..t + 1), &[seq(1, 1, false)]).unwrap());
        }
        assert_eq!(all, parts, "prefill in one call and token by token agree exactly");
        assert!(all.iter().any(|v| v.abs() > 1e-3));
        // A fresh sequence in a used slot starts from zero states again.
        let again = run(&mut split, 0, &inputs(0..n), &[seq(n, 1, true)]).unwrap();
        assert_eq!(again, all);
        assert_eq!(ledger.bytes(Category::StateCache), 2 * l.bytes(4));
    }

    #[test]
    fn the_recurrence_matches_its_definition_on_one_head() {
        // One key head, one value head of width 1, kernel 1: S is a scalar, q = k = ±1 after the
        // L2 norm, so o_t = S_t · q_t / √1 with S_t = e^g S_{t−1} + k β (v − S_{t−1}e^g k).
        let l = StateLayout {
            layers: 1,
            slots: 1,
            conv_dim: 3,
            conv_len: 0,
            key_heads: 1,
            heads: 1,
            key_dim: 1,
            value_dim: 1,
        };
        let qkv = [2.0, 3.0, 0.5, -1.0, 4.0, 1.5];
        let silu = |x: f32| x / (1.0 + (-x).exp());
        let (a, b, a_log, dt) = ([0.3, -0.2], [0.1, 0.7], [0.0f32], [0.5f32]);
        let mut states = CpuStates::new(l, &MemoryLedger::new());
        let x = Inputs {
            qkv: &qkv,
            a: &a,
            b: &b,
            conv: &[1.0, 1.0, 1.0],
            a_log: &a_log,
            dt_bias: &dt,
        };
        let seq = StateSeq {
            start: 0,
            len: 2,
            slot: 0,
            fresh: true,
        };
        let out = run(&mut states, 0, &x, &[seq]).unwrap();
        let mut s = 0f32;
        for t in 0..2 {
            let (q, k, v) = (
                silu(qkv[3 * t]).signum(),
                silu(qkv[3 * t + 1]).signum(),
                silu(qkv[3 * t + 2]),
            );
            let g = (-(softplus(a[t] + dt[0]))).exp();
            let beta = 1.0 / (1.0 + (-b[t]).exp());
            s *= g;
            s += k * beta * (v - s * k);
            assert!((out[t] - s * q).abs() < 1e-5, "{t}: {} vs {}", out[t], s * q);
        }
    }

    #[test]
    fn partial_rotary_turns_only_the_leading_values() {
        // Two heads of 4, rotary width 2: each head's values 0 and 1 rotate by 90°.
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        rope_partial(&mut x, &[0.0, 0.0], &[1.0, 1.0], 1, 4);
        assert_eq!(x, vec![-2.0, 1.0, 3.0, 4.0, -6.0, 5.0, 7.0, 8.0]);
    }
}
