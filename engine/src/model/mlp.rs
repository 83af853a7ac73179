//! The decoder's MLPs: one SwiGLU, or a mixture of experts (`Qwen3VLMoeTextSparseMoeBlock` and
//! `Qwen3_5MoeSparseMoeBlock`, which adds a shared expert, in transformers'
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py>).
//!
//! The mixture routes on the host: the router's scores are read back once per layer and step,
//! the softmax and top-k run on those floats, and each chosen expert runs the ordinary
//! [`Backend::linear`] on the rows routed to it. Every weight format and backend that runs a dense
//! model so runs the experts; the cost is one read per layer, which a browser's GPU cannot
//! answer inside a step (wasm32 builds refuse these models).

use super::weights::{Loader, TensorSource};
use super::ModelError;
use crate::arch::config::MoeConfig;
use crate::arch::spec::{SwigluSpec, TextMlpSpec};
use crate::backend::{block_on, Backend};

/// `down(silu(gate·x) ⊙ up·x)`.
#[derive(Debug)]
pub(super) struct Swiglu<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

impl<B: Backend> Swiglu<B> {
    fn load<S: TensorSource<B>>(s: &SwigluSpec, l: &Loader<'_, '_, S, B>) -> Result<Self, ModelError> {
        Ok(Swiglu {
            gate: l.matrix(&s.gate)?,
            up: l.matrix(&s.up)?,
            down: l.matrix(&s.down)?,
        })
    }

    fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        Ok(be.linear(&be.swiglu(x, &self.gate, &self.up)?, &self.down, None)?)
    }
}

/// A mixture of experts with an optional shared expert.
#[derive(Debug)]
pub(super) struct Experts<B: Backend> {
    /// `[experts, H]`.
    router: B::Weight,
    /// Each expert's gate and up projections stacked `[2·I, H]` (gate first), and its down
    /// projection `[H, I]`.
    experts: Vec<(B::Weight, B::Weight)>,
    /// `I`.
    width: usize,
    /// The shared expert and its gate `[1, H]`.
    shared: Option<(Swiglu<B>, B::Weight)>,
    top_k: usize,
}

/// A decoder layer's MLP.
#[derive(Debug)]
pub(super) enum Mlp<B: Backend> {
    Dense(Swiglu<B>),
    Experts(Experts<B>),
}

impl<B: Backend> Mlp<B> {
    /// Loads the MLP of one layer.
    pub(super) fn load<S: TensorSource<B>>(
        s: &TextMlpSpec,
        moe: Option<&MoeConfig>,
        l: &Loader<'_, '_, S, B>,
    ) -> Result<Self, ModelError> {
        let (top_k, width) = moe.map_or((0, 0), |m| (m.num_experts_per_tok, m.moe_intermediate_size));
        match s {
            TextMlpSpec::Dense(d) => Ok(Mlp::Dense(Swiglu::load(d, l)?)),
            TextMlpSpec::Experts {
                router,
                gate_up,
                down,
                shared,
            } => {
                let (gate_up, down) = (l.experts(gate_up)?, l.experts(down)?);
                if gate_up.len() != down.len() {
                    return Err(ModelError::Checkpoint(format!(
                        "{} gate/up but {} down expert matrices",
                        gate_up.len(),
                        down.len()
                    )));
                }
                Ok(Mlp::Experts(Experts {
                    router: l.matrix(router)?,
                    experts: gate_up.into_iter().zip(down).collect(),
                    width,
                    shared: match shared.as_deref() {
                        Some((mlp, gate)) => Some((Swiglu::load(mlp, l)?, l.matrix(gate)?)),
                        None => None,
                    },
                    top_k,
                }))
            }
        }
    }

    /// The MLP's output `[rows, H]` for normed input `h [rows, H]`.
    pub(super) fn forward(&self, be: &B, h: &B::Tensor) -> Result<B::Tensor, ModelError> {
        match self {
            Mlp::Dense(d) => d.forward(be, h),
            Mlp::Experts(e) => e.forward(be, h),
        }
    }
}

impl<B: Backend> Experts<B> {
    fn forward(&self, be: &B, h: &B::Tensor) -> Result<B::Tensor, ModelError> {
        let shape = be.shape(h);
        let (rows, width) = (shape.first().copied().unwrap_or(0), shape.get(1).copied().unwrap_or(0));
        let mut heads = vec![(&self.router, None)];
        if let Some((_, gate)) = &self.shared {
            heads.push((gate, None));
        }
        let scores = be.linears(h, &heads)?;
        let logits = block_on(be.read(&scores[0]))?;
        let routes = route(&logits, self.experts.len(), self.top_k)?;
        // transformers adds the experts in index order from zero, then the shared expert.
        let mut out = be.upload(vec![0.0; rows * width], &[rows, width])?;
        for (expert, picks) in self.experts.iter().zip(&routes) {
            if picks.rows.is_empty() {
                continue;
            }
            let y = self.expert(be, expert, &be.gather_rows(h, &picks.rows)?)?;
            out = be.scatter_rows(&out, &picks.rows, &be.scale_rows(&y, &picks.weights)?, true)?;
        }
        if let (Some((shared, _)), Some(gate)) = (&self.shared, scores.get(1)) {
            let gate: Vec<f32> = block_on(be.read(gate))?
                .iter()
                .map(|g| 1.0 / (1.0 + (-g).exp()))
                .collect();
            out = be.add(&out, &be.scale_rows(&shared.forward(be, h)?, &gate)?)?;
        }
        Ok(out)
    }

    /// One expert's SwiGLU on its rows `x`.
    fn expert(&self, be: &B, (gate_up, down): &(B::Weight, B::Weight), x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        let gu = be.linear(x, gate_up, None)?;
        let (gate, up) = (
            be.narrow_cols(&gu, 0, self.width)?,
            be.narrow_cols(&gu, self.width, self.width)?,
        );
        Ok(be.linear(&be.silu_mul(&gate, &up)?, down, None)?)
    }
}

/// The rows one expert takes and their routing weights.
#[derive(Debug, Default, Clone, PartialEq)]
struct Picks {
    rows: Vec<usize>,
    weights: Vec<f32>,
}

/// Each row's `top_k` most probable experts under the softmax of its router `logits
/// [rows, experts]`, their probabilities renormalised to sum to 1 (transformers'
/// `Qwen3_5MoeTopKRouter`), grouped by expert.
fn route(logits: &[f32], experts: usize, top_k: usize) -> Result<Vec<Picks>, ModelError> {
    if experts == 0 || !logits.len().is_multiple_of(experts) || top_k == 0 || top_k > experts {
        return Err(ModelError::Input(format!(
            "router scores of {} values for {experts} experts, top {top_k}",
            logits.len()
        )));
    }
    let mut picks = vec![Picks::default(); experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for (row, l) in logits.chunks(experts).enumerate() {
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let p: Vec<f32> = l.iter().map(|&v| (v - max).exp()).collect();
        let total: f32 = p.iter().sum();
        order.clear();
        order.extend(0..experts);
        // Highest first; equal probabilities keep the lower index first, as torch.topk does on CPU.
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let kept: f32 = chosen.iter().map(|&e| p[e] / total).sum();
        for &e in chosen {
            picks[e].rows.push(row);
            picks[e].weights.push(p[e] / total / kept);
        }
    }
    Ok(picks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_takes_the_top_k_and_renormalises_their_probabilities() {
        // Row 0 prefers expert 2 then 0; row 1 prefers 1 then 2.
        let logits = [1.0, 0.0, 2.0, 0.0, 3.0, 1.0];
        let picks = route(&logits, 3, 2).unwrap();
        assert_eq!(picks[0].rows, vec![0]);
        assert_eq!(picks[1].rows, vec![1]);
        assert_eq!(picks[2].rows, vec![0, 1]);
        let (e1, e2) = (1f32.exp(), 2f32.exp());
        assert!((picks[2].weights[0] - e2 / (e1 + e2)).abs() < 1e-6);
        assert!((picks[0].weights[0] - e1 / (e1 + e2)).abs() < 1e-6);
        assert!((picks[1].weights[0] - 1.0 / (1.0 + (-2f32).exp())).abs() < 1e-6);
        let sums: f32 = picks.iter().flat_map(|p| p.weights.iter()).sum();
        assert!((sums - 2.0).abs() < 1e-5, "each row's weights sum to 1");
        assert!(route(&logits, 4, 2).is_err(), "6 scores are not rows of 4");
        assert!(route(&logits, 3, 4).is_err(), "top 4 of 3 experts");
    }
}
