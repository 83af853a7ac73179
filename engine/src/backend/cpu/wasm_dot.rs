//! The integer products with wasm's 128-bit SIMD, the tab's CPU fallback: `q8_0`/`q4_0` blocks
//! and `q4_K`/`q6_K` super-blocks against activations quantized to 8 bits.
//!
//! The weights are unpacked straight into i16 lanes, each 16 values' even-indexed ones apart from
//! the odd-indexed ones (a mask or a shift per vector: the two bytes of an i16 lane are an even
//! and an odd value), and multiplied with the activations' matching halves (kept beside their i8
//! values in that order, [`even_odd`]) by `i32x4.dot_i16x8`, one instruction on x86 and ARM.
//! Four blocks' (or sub-blocks') i32 sums are reduced across their lanes together and scaled in
//! f32 lanes; the offsets' terms are f32 lanes too.
//!
//! The kernels before these multiplied bytes by `i16x8.extmul`: LLVM splits an extmul of
//! unsigned weights by signed activations into four extends and two multiplies, and they scaled
//! each block in scalar code. The K-quant ones took the tab's `Q4_K_M` decode from 0.81× wllama's
//! to 1.59× at one thread (docs/PERFORMANCE-HISTORY.md, "The tab against wllama").
#![allow(unsafe_code)]

use std::arch::wasm32::*;

use super::block_dot::ActRow;
use super::k_quant_dot::{scales_mins, KRow, Q4K_BYTES, Q6K_BYTES};
use crate::arch::blocks::BLOCK;
use crate::arch::ggml::{half_at, QK_K};

/// `q` (whole 16s of i8 values) in i16, each 16's even-indexed values first, then the odd-indexed:
/// the order the products here take the activations in.
pub(super) fn even_odd(q: &[i8]) -> impl Iterator<Item = i16> + '_ {
    q.chunks_exact(16)
        .flat_map(|q| (0..16).map(move |j| q[2 * (j % 8) + j / 8] as i16))
}

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

/// The sum of `v`'s four f32 lanes.
#[inline(always)]
fn lane_sum(v: v128) -> f32 {
    (f32x4_extract_lane::<0>(v) + f32x4_extract_lane::<1>(v))
        + (f32x4_extract_lane::<2>(v) + f32x4_extract_lane::<3>(v))
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

/// 16 weights in i16 lanes, `(even, odd)`, times the activations' [`even_odd`] values at `at` of
/// `wide`, in four i32 lanes.
#[inline(always)]
fn dot16(even: v128, odd: v128, wide: &[i16], at: usize) -> v128 {
    // SAFETY: every caller asserted that `wide` holds the values of every block (or super-block)
    // its weight row has, and `at + 16` stays inside them.
    let (xe, xo) = unsafe {
        let p = wide.as_ptr().add(at);
        (v128_load(p as *const v128), v128_load(p.add(8) as *const v128))
    };
    i32x4_add(i32x4_dot_i16x8(even, xe), i32x4_dot_i16x8(odd, xo))
}

/// 16 bytes of nibbles in i16 lanes: `[low even, low odd, high even, high odd]` (in each i16 lane
/// the even byte's nibbles are bits 0–3 and 4–7, the odd byte's 8–11 and 12–15).
#[inline(always)]
fn nibble_lanes(w: v128) -> [v128; 4] {
    let nibble = u16x8_splat(0x000F);
    let bits = |shift: u32| v128_and(u16x8_shr(w, shift), nibble);
    [v128_and(w, nibble), bits(8), bits(4), u16x8_shr(w, 12)]
}

/// Four f16 bit patterns (the low halves of four u32 lanes) as f32, as `half` converts them
/// (subnormals, infinities and NaN included).
#[inline(always)]
fn halves_f32(h: v128) -> v128 {
    let sign = i32x4_shl(v128_and(h, u32x4_splat(0x8000)), 16);
    let magnitude = v128_and(h, u32x4_splat(0x7FFF));
    // The exponent and fraction moved into f32's place, then scaled by 2^112 (127 − 15): right
    // for normal and subnormal values and zero; infinities and NaN take the top exponent.
    let moved = i32x4_shl(magnitude, 13);
    let finite = f32x4_mul(moved, f32x4_splat(f32::from_bits(0x7780_0000)));
    let special = v128_or(moved, u32x4_splat(0x7F80_0000));
    v128_or(
        sign,
        v128_bitselect(special, finite, u32x4_ge(magnitude, u32x4_splat(0x7C00))),
    )
}

/// One `q8_0` (`Q4` false: stored with 128 added, as `block_dot` keeps them) or `q4_0` weight
/// row (f16 `scales`, `quants`) times one activation row, four blocks at a time.
pub(super) fn blocks<const Q4: bool>(scales: &[u16], quants: &[u8], x: &ActRow<'_>) -> f32 {
    let nb = scales.len();
    let qb = if Q4 { BLOCK / 2 } else { BLOCK };
    assert!(quants.len() == nb * qb && x.scales.len() >= nb && x.corrections.len() >= nb);
    assert!(x.wide.len() >= nb * BLOCK);
    // Block `b`'s integer sums in four i32 lanes.
    let block = |b: usize| {
        let at = b * BLOCK;
        if Q4 {
            // Byte j holds value j (low nibble) and j + 16 (high nibble).
            let [le, lo, he, ho] = nibble_lanes(load(quants, b * qb));
            i32x4_add(dot16(le, lo, x.wide, at), dot16(he, ho, x.wide, at + 16))
        } else {
            let signed = |w: v128| {
                let w = v128_xor(w, u8x16_splat(0x80));
                (i16x8_shr(i16x8_shl(w, 8), 8), i16x8_shr(w, 8))
            };
            let ((e0, o0), (e1, o1)) = (signed(load(quants, b * qb)), signed(load(quants, b * qb + 16)));
            i32x4_add(dot16(e0, o0, x.wide, at), dot16(e1, o1, x.wide, at + 16))
        }
    };
    let (mut acc, mut corrections) = (f32x4_splat(0.0), f32x4_splat(0.0));
    let mut b = 0;
    while b + 4 <= nb {
        let isum = f32x4_convert_i32x4(sum_lanes4(block(b), block(b + 1), block(b + 2), block(b + 3)));
        let s = &scales[b..b + 4];
        let dw = halves_f32(u32x4(s[0] as u32, s[1] as u32, s[2] as u32, s[3] as u32));
        acc = f32x4_add(acc, f32x4_mul(f32x4_mul(dw, load_f32(x.scales, b)), isum));
        if Q4 {
            corrections = f32x4_add(corrections, f32x4_mul(dw, load_f32(x.corrections, b)));
        }
        b += 4;
    }
    let mut rest = 0f32;
    for (b, &d) in scales.iter().enumerate().skip(b) {
        let dw = half::f16::from_bits(d).to_f32();
        let isum = lane_sum(f32x4_convert_i32x4(block(b)));
        rest += dw * x.scales[b] * isum - if Q4 { dw * x.corrections[b] } else { 0.0 };
    }
    lane_sum(f32x4_sub(acc, corrections)) + rest
}

/// `q4_K`: per pair of sub-blocks 32 bytes of nibbles, the low nibbles sub-block `2p` and the
/// high ones `2p + 1`.
pub(super) fn q4k(row: &[u8], x: &KRow<'_>) -> f32 {
    x.check(row, Q4K_BYTES);
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
            let [le0, lo0, he0, ho0] = nibble_lanes(load(block, 16 + 32 * pair));
            let [le1, lo1, he1, ho1] = nibble_lanes(load(block, 32 + 32 * pair));
            let at = b * QK_K + 64 * pair;
            sub[0] = i32x4_add(dot16(le0, lo0, x.wide, at), dot16(le1, lo1, x.wide, at + 16));
            sub[1] = i32x4_add(dot16(he0, ho0, x.wide, at + 32), dot16(he1, ho1, x.wide, at + 48));
        }
        for (half, (s, sums)) in [(s0, &isums[..4]), (s1, &isums[4..])].into_iter().enumerate() {
            let isum = f32x4_convert_i32x4(sum_lanes4(sums[0], sums[1], sums[2], sums[3]));
            acc = f32x4_add(acc, f32x4_mul(f32x4_mul(d, s), f32x4_mul(load_f32(xs, 4 * half), isum)));
        }
    }
    lane_sum(f32x4_sub(acc, offsets))
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
        dot16(even, odd, x.wide, b * QK_K + 16 * (2 * run + half))
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
    lane_sum(acc) - 32.0 * lane_sum(offsets)
}
