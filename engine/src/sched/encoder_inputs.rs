//! Which images a request needs encoded this step (vLLM `_try_schedule_encoder_inputs`).

use super::Sequence;
use crate::cache::EncoderCacheManager;

/// The encoder side of scheduling one request.
#[derive(Debug)]
pub(super) struct EncoderPlan {
    /// Tokens that can run: the asked count, or only the text before the first image that cannot
    /// be encoded this step (0 when the range starts inside such an image).
    pub num_new: usize,
    /// Indices of the images to encode this step, each mm hash once.
    pub encode: Vec<usize>,
    /// Encoder tokens those images cost against the step's compute budget.
    pub cost: usize,
}

/// Walks the images overlapping tokens `[start, start + num_new)` of `seq` in placeholder order:
/// images already in the KV cache are skipped, cached encoder outputs are referenced (they cost
/// nothing), and the others must fit both `budget` (the compute budget left this step) and the
/// encoder cache (which may evict unreferenced entries to make room). Nothing is allocated: the
/// caller allocates `encode` once the request's KV blocks are secured.
pub(super) fn plan_encoder_inputs<T>(
    enc: &mut EncoderCacheManager,
    seq: &Sequence<T>,
    start: usize,
    num_new: usize,
    budget: usize,
) -> EncoderPlan {
    let mut plan = EncoderPlan {
        num_new,
        encode: Vec::new(),
        cost: 0,
    };
    let spans = seq.spans();
    for (i, span) in spans.iter().enumerate() {
        if span.offset >= start + num_new {
            break;
        }
        if span.offset + span.length <= start
            || plan.encode.iter().any(|&j| spans[j].hash == span.hash)
            || enc.check_and_update_cache(seq.id(), &span.hash)
        {
            continue;
        }
        if !enc.can_allocate(span.length, budget - plan.cost, plan.cost) {
            plan.num_new = span.offset.saturating_sub(start);
            break;
        }
        plan.cost += span.length;
        plan.encode.push(i);
    }
    plan
}
