//! The fused operations of [`Backend`] spelled out in its plain ones: their default
//! implementations, and what a backend that fuses them falls back to where its kernel does not
//! apply. A fused kernel must give what these give.

use super::{BResult, Backend, BackendError};

/// `(x + y, rms_norm(x + y, w))`: a residual add and the norm after it.
pub fn add_rms_norm<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    y: &B::Tensor,
    w: &B::Tensor,
    eps: f64,
) -> BResult<(B::Tensor, B::Tensor)> {
    let sum = b.add(x, y)?;
    let normed = b.rms_norm(&sum, w, eps)?;
    Ok((sum, normed))
}

/// Per head of `head_dim` in `x [n, heads·head_dim]`: RMSNorm by `w [head_dim]` where given,
/// then the rotary embedding of the first `cos.cols` values ([`Backend::rope`] where that is the
/// whole head, [`Backend::rope_partial`] otherwise).
pub fn norm_rope<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    w: Option<&B::Tensor>,
    eps: f64,
    cos: &B::Tensor,
    sin: &B::Tensor,
    head_dim: usize,
) -> BResult<B::Tensor> {
    let normed = match (w, &b.shape(x)[..]) {
        (None, _) => x.clone(),
        (Some(w), &[rows, cols]) if head_dim > 0 && cols.is_multiple_of(head_dim) => {
            let heads = b.reshape(x, rows * cols / head_dim, head_dim)?;
            b.reshape(&b.rms_norm(&heads, w, eps)?, rows, cols)?
        }
        (Some(_), shape) => {
            return Err(BackendError::Shape(format!(
                "norm_rope: x {shape:?} in heads of {head_dim}"
            )))
        }
    };
    if b.shape(cos).get(1).is_some_and(|&d| d < head_dim) {
        b.rope_partial(&normed, cos, sin, head_dim)
    } else {
        b.rope(&normed, cos, sin)
    }
}

/// `silu(x · gateᵀ) ⊙ (x · upᵀ)`: a SwiGLU's products before its down projection.
pub fn swiglu<B: Backend + ?Sized>(b: &B, x: &B::Tensor, gate: &B::Weight, up: &B::Weight) -> BResult<B::Tensor> {
    let mut products = b.linears(x, &[(gate, None), (up, None)])?;
    match (products.pop(), products.pop()) {
        (Some(u), Some(g)) if products.is_empty() => b.silu_mul(&g, &u),
        _ => Err(BackendError::Shape(
            "linears gave other than two products for gate and up".into(),
        )),
    }
}
