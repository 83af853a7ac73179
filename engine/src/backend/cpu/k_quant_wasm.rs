//! The K-quant products with wasm's 128-bit SIMD: the tab's CPU fallback for a `Q4_K_M` file.
//!
//! The weights are unpacked straight into i16 lanes, each 16 values' even-indexed ones apart from
//! the odd-indexed ones (a mask or a shift per vector: the two bytes of an i16 lane are an even
//! and an odd value), and multiplied with the activations' matching halves ([`KRow::wide`]) by
//! `i32x4.dot_i16x8`, one instruction on x86 and ARM. Four sub-blocks' i32 sums are reduced
//! across their lanes together and scaled in f32 lanes; the offsets' terms are f32 lanes too.
//!
//! The kernel before this one multiplied bytes by `i16x8.extmul`: LLVM splits an extmul of
//! unsigned weights by signed activations into four extends and two multiplies, and it scaled
//! each sub-block in scalar code. This one took the tab's `Q4_K_M` decode from 0.81× wllama's to
//! 1.59× at one thread (docs/PERFORMANCE.md, "The tab against wllama").
#![allow(unsafe_code)]

use std::arch::wasm32::*;

use super::k_quant_dot::{scales_mins, KRow, Q4K_BYTES, Q6K_BYTES};
use crate::arch::ggml::{half_at, QK_K};

/// 16 bytes at `at` of `bytes` (checked; constant offsets into a super-block cost no check).
#[inline(always)]
fn load(bytes: &[u8], at: usize) -> v128 {
    let bytes = &bytes[at..at + 16];
    // SAFETY: 16 bytes, just checked; wasm's loads need no alignment.
    unsafe { v128_load(bytes.as_ptr() as *const v128) }
}

/// Four f32 lanes at `at` of `values` (checked).
#[inline(always)]
fn load_f32(values: &[f32], at: usize) -> v128 {
    let values = &values[at..at + 4];
    // SAFETY: as in `load`.
    unsafe { v128_load(values.as_ptr() as *const v128) }
}

/// `[Σ a, Σ b, Σ c, Σ d]` of four vectors of i32 lanes.
#[inline(always)]
fn sum_lanes4(a: v128, b: v128, c: v128, d: v128) -> v128 {
    let ab = i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(a, b), i32x4_shuffle::<2, 6, 3, 7>(a, b));
    let cd = i32x4_add(i32x4_shuffle::<0, 4, 1, 5>(c, d), i32x4_shuffle::<2, 6, 3, 7>(c, d));
    i32x4_add(i32x4_shuffle::<0, 1, 4, 5>(ab, cd), i32x4_shuffle::<2, 3, 6, 7>(ab, cd))
}

/// 16 bytes, unsigned or `SIGNED`, as f32, four lanes at a time.
#[inline(always)]
fn bytes_f32<const SIGNED: bool>(v: v128) -> [v128; 4] {
    let quarters = |h: v128| match SIGNED {
        true => [i32x4_extend_low_i16x8(h), i32x4_extend_high_i16x8(h)],
        false => [u32x4_extend_low_u16x8(h), u32x4_extend_high_u16x8(h)],
    };
    let [a, b] = quarters(match SIGNED {
        true => i16x8_extend_low_i8x16(v),
        false => u16x8_extend_low_u8x16(v),
    });
    let [c, d] = quarters(match SIGNED {
        true => i16x8_extend_high_i8x16(v),
        false => u16x8_extend_high_u8x16(v),
    });
    [
        f32x4_convert_i32x4(a),
        f32x4_convert_i32x4(b),
        f32x4_convert_i32x4(c),
        f32x4_convert_i32x4(d),
    ]
}

/// The activations' i16 halves for 16 values at `at`: `(even, odd)`.
#[inline(always)]
fn wide(x: &KRow<'_>, at: usize) -> (v128, v128) {
    // SAFETY: `KRow::check` asserted that `wide` holds every super-block's values that `row` has
    // weights for; `at + 16` stays inside them.
    unsafe {
        let p = x.wide.as_ptr().add(at);
        (v128_load(p as *const v128), v128_load(p.add(8) as *const v128))
    }
}

/// 16 weights in i16 lanes, `(even, odd)`, times the activations at `at`, in four i32 lanes.
#[inline(always)]
fn dot16(even: v128, odd: v128, x: &KRow<'_>, at: usize) -> v128 {
    let (xe, xo) = wide(x, at);
    i32x4_add(i32x4_dot_i16x8(even, xe), i32x4_dot_i16x8(odd, xo))
}

/// `q4_K`: per pair of sub-blocks 32 bytes of nibbles, the low nibbles sub-block `2p` and the
/// high ones `2p + 1`.
pub(super) fn q4k(row: &[u8], x: &KRow<'_>) -> f32 {
    x.check(row, Q4K_BYTES);
    let nibble = u16x8_splat(0x000F);
    let (mut acc, mut offsets) = (f32x4_splat(0.0), f32x4_splat(0.0));
    for (b, block) in row.chunks_exact(Q4K_BYTES).enumerate() {
        let w = scales_mins(&block[4..16]);
        let [s0, s1, m0, m1] = bytes_f32::<false>(u32x4(w[0], w[1], w[2], w[3]));
        let (d, dmin) = (f32x4_splat(half_at(block, 0)), f32x4_splat(half_at(block, 2)));
        let (xs, sums) = (&x.scales[8 * b..][..8], &x.sums[16 * b..][..16]);
        // The minimums' terms: per sub-block dmin · m · its two 16 values' sums.
        let pairs = |at: usize| {
            let (a, c) = (load_f32(sums, at), load_f32(sums, at + 4));
            f32x4_add(i32x4_shuffle::<0, 2, 4, 6>(a, c), i32x4_shuffle::<1, 3, 5, 7>(a, c))
        };
        offsets = f32x4_add(offsets, f32x4_mul(f32x4_mul(dmin, m0), pairs(0)));
        offsets = f32x4_add(offsets, f32x4_mul(f32x4_mul(dmin, m1), pairs(8)));
        let mut isums = [i32x4_splat(0); 8];
        for (pair, sub) in isums.chunks_exact_mut(2).enumerate() {
            let (w0, w1) = (load(block, 16 + 32 * pair), load(block, 32 + 32 * pair));
            let at = b * QK_K + 64 * pair;
            // In each i16 lane the even value's nibbles are bits 0–3 (low) and 4–7 (high), the
            // odd value's 8–11 and 12–15.
            let bits = |w: v128, shift: u32| v128_and(u16x8_shr(w, shift), nibble);
            sub[0] = i32x4_add(
                dot16(v128_and(w0, nibble), bits(w0, 8), x, at),
                dot16(v128_and(w1, nibble), bits(w1, 8), x, at + 16),
            );
            sub[1] = i32x4_add(
                dot16(bits(w0, 4), u16x8_shr(w0, 12), x, at + 32),
                dot16(bits(w1, 4), u16x8_shr(w1, 12), x, at + 48),
            );
        }
        for (half, (s, sums)) in [(s0, &isums[..4]), (s1, &isums[4..])].into_iter().enumerate() {
            let isum = f32x4_convert_i32x4(sum_lanes4(sums[0], sums[1], sums[2], sums[3]));
            acc = f32x4_add(acc, f32x4_mul(f32x4_mul(d, s), f32x4_mul(load_f32(xs, 4 * half), isum)));
        }
    }
    super::block_dot::lane_sum(f32x4_sub(acc, offsets))
}

/// `q6_K`'s 16 weights (`0..64`) of run `T` of a half (see `dot_portable`), their low nibbles at
/// `ql` and high bit pairs at `qh`, in i16 lanes `(even, odd)`.
#[inline(always)]
fn q6k_weights<const T: u32>(block: &[u8], ql: usize, qh: usize) -> (v128, v128) {
    let (l, h) = (load(block, ql), load(block, qh));
    let nibbles = if T >= 2 {
        u8x16_shr(l, 4)
    } else {
        v128_and(l, u8x16_splat(0x0F))
    };
    // The pair at bits 2T..2T + 2 of each high byte, moved to bits 4–5.
    let pairs = match T {
        0 => u8x16_shl(h, 4),
        1 => u8x16_shl(h, 2),
        2 => h,
        _ => u8x16_shr(h, 2),
    };
    let w = v128_or(nibbles, v128_and(pairs, u8x16_splat(0x30)));
    (v128_and(w, u16x8_splat(0x00FF)), u16x8_shr(w, 8))
}

/// Run `T` of half `h` of super-block `b` (32 values, two scales'): each 16 values' products.
#[inline(always)]
fn q6k_run<const T: u32>(block: &[u8], h: usize, x: &KRow<'_>, b: usize) -> [v128; 2] {
    let run = 4 * h + T as usize;
    let (ql, qh) = (64 * h + 32 * (T as usize % 2), 128 + 32 * h);
    std::array::from_fn(|half| {
        let (even, odd) = q6k_weights::<T>(block, ql + 16 * half, qh + 16 * half);
        dot16(even, odd, x, b * QK_K + 16 * (2 * run + half))
    })
}

/// `q6_K`: sixteen scales per super-block, one per 16 values, each 32 values' activations one
/// scale; the weights' offset of 32 taken off through the activations' sums.
pub(super) fn q6k(row: &[u8], x: &KRow<'_>) -> f32 {
    x.check(row, Q6K_BYTES);
    let (mut acc, mut offsets) = (f32x4_splat(0.0), f32x4_splat(0.0));
    for (b, block) in row.chunks_exact(Q6K_BYTES).enumerate() {
        let d = f32x4_splat(half_at(block, 208));
        let scales = bytes_f32::<true>(load(block, 192));
        let (xs, sums) = (&x.scales[8 * b..][..8], &x.sums[16 * b..][..16]);
        // Each 16 values' activation scale: the scale of the 32 they are in.
        let (xa, xb) = (load_f32(xs, 0), load_f32(xs, 4));
        let x_scales = [
            i32x4_shuffle::<0, 0, 1, 1>(xa, xa),
            i32x4_shuffle::<2, 2, 3, 3>(xa, xa),
            i32x4_shuffle::<0, 0, 1, 1>(xb, xb),
            i32x4_shuffle::<2, 2, 3, 3>(xb, xb),
        ];
        for h in 0..2 {
            let [a0, a1] = q6k_run::<0>(block, h, x, b);
            let [b0, b1] = q6k_run::<1>(block, h, x, b);
            let [c0, c1] = q6k_run::<2>(block, h, x, b);
            let [d0, d1] = q6k_run::<3>(block, h, x, b);
            // Groups of four 16-value runs: the scales 4g..4g + 4.
            for (g, isum) in [
                (2 * h, sum_lanes4(a0, a1, b0, b1)),
                (2 * h + 1, sum_lanes4(c0, c1, d0, d1)),
            ] {
                let s = f32x4_mul(d, scales[g]);
                acc = f32x4_add(acc, f32x4_mul(s, f32x4_mul(x_scales[g], f32x4_convert_i32x4(isum))));
                offsets = f32x4_add(offsets, f32x4_mul(s, load_f32(sums, 4 * g)));
            }
        }
    }
    super::block_dot::lane_sum(acc) - 32.0 * super::block_dot::lane_sum(offsets)
}
