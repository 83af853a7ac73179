//! The products of GGML's K-quant super-blocks (`q4_K`, `q6_K`: 256 values each, read as a GGUF
//! file stores them) with activations on the CPU: the formats a `Q4_K_M` file holds almost all of
//! its weights in.
//!
//! The activations are quantized per 32 values as for `q8_0` ([`KActivations`], natural order),
//! with each 16 quants' sum (times the block's scale) kept beside them for the weights' offsets:
//! `q4_K`'s minimums and `q6_K`'s 32 (on x86-64 also `32 Σ q_x` in integers, for the `q6_K`
//! tiles, which take the 32 off inside their integer sums). The integer sums of each 32 (`q4_K`)
//! or 16 (`q6_K`) weights are scaled in f32: `Σ d_w · d_x · Σ q_w q_x − offsets`. llama.cpp takes
//! one activation scale per 256 values (`q8_K`); one per 32 keeps the activations as close as the
//! `q8_0`/`q4_0` products keep them. AVX-512 VNNI (64 weights per `vpdpbusd`), AVX2 (32 per
//! `vpmaddubsw` pair), wasm `simd128` (`wasm_dot`: 8 per `i32x4.dot_i16x8`), and portable code the
//! compiler vectorises.

use super::block_dot::{quantize_q8_to_even, QUANTIZE_ROWS};
use super::isa::fastest;
use super::packed::prefetch_ahead;
use crate::arch::blocks::BLOCK;
use crate::arch::ggml::{half_at, GgmlType, QK_K};
use crate::parallel::map_ranges;

/// Bytes of a `q4_K` super-block: d and dmin (f16), 12 bytes of 6-bit scales and minimums, 128 of
/// nibbles.
pub(super) const Q4K_BYTES: usize = 144;

/// Bytes of a `q6_K` super-block: 128 of low nibbles, 64 of high bit pairs, 16 i8 scales, d (f16).
pub(super) const Q6K_BYTES: usize = 210;

/// The K-quant formats with products here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KQuant {
    Q4K,
    Q6K,
}

impl KQuant {
    /// The format of a GGML type, if it has products here.
    pub fn from_ggml(t: GgmlType) -> Option<Self> {
        match t {
            GgmlType::Q4K => Some(KQuant::Q4K),
            GgmlType::Q6K => Some(KQuant::Q6K),
            _ => None,
        }
    }

    /// The GGML type.
    pub(super) fn ggml(self) -> GgmlType {
        match self {
            KQuant::Q4K => GgmlType::Q4K,
            KQuant::Q6K => GgmlType::Q6K,
        }
    }

    /// Bytes of one super-block.
    pub(super) fn block_bytes(self) -> usize {
        match self {
            KQuant::Q4K => Q4K_BYTES,
            KQuant::Q6K => Q6K_BYTES,
        }
    }
}

/// A matrix's rows of K-quant super-blocks, as stored.
#[derive(Debug)]
pub struct KRows {
    kind: KQuant,
    row_bytes: usize,
    data: Vec<u8>,
}

impl KRows {
    /// `rows` rows of `cols` values from a tensor's bytes, or None when `cols` is not whole
    /// super-blocks or the bytes are not `rows` rows.
    pub fn new(kind: KQuant, data: &[u8], rows: usize, cols: usize) -> Option<Self> {
        let row_bytes = cols / QK_K * kind.block_bytes();
        (cols.is_multiple_of(QK_K) && data.len() == rows * row_bytes).then(|| KRows {
            kind,
            row_bytes,
            data: data.to_vec(),
        })
    }

    /// Drops every row from `rows` on (their memory too).
    pub fn keep_rows(&mut self, rows: usize) {
        self.data.truncate(rows * self.row_bytes);
        self.data.shrink_to_fit();
    }

    /// Bytes of the stored blocks.
    pub fn bytes(&self) -> u64 {
        self.data.len() as u64
    }

    /// The format.
    pub fn kind(&self) -> KQuant {
        self.kind
    }

    /// Rows of the matrix.
    pub(super) fn rows(&self) -> usize {
        self.data.len().checked_div(self.row_bytes).unwrap_or(0)
    }

    /// Rows `rows`' super-blocks as stored.
    pub(super) fn rows_bytes(&self, rows: std::ops::Range<usize>) -> &[u8] {
        &self.data[rows.start * self.row_bytes..rows.end * self.row_bytes]
    }

    /// Row `row`'s super-blocks as stored.
    pub(super) fn row(&self, row: usize) -> &[u8] {
        &self.data[row * self.row_bytes..(row + 1) * self.row_bytes]
    }

    /// Row `row` in f32, by GGML's dequantization.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        self.kind.ggml().dequantize(self.row(row), out);
    }
}

/// Activation rows quantized for K-quant products: per 32 values the scale `d_x` and the i8
/// values (natural order), per 16 values `d_x · Σ q_x`.
#[derive(Debug)]
pub struct KActivations {
    scales: Vec<f32>,
    sums: Vec<f32>,
    /// `32 Σ q_x` per 16 values, in integers: the `q6_K` tiles' offset of 32.
    #[cfg(target_arch = "x86_64")]
    x32: Vec<i32>,
    quants: Vec<i8>,
    /// The values in i16, each 16's even-indexed first, then the odd-indexed: what wasm's
    /// `i32x4.dot_i16x8` takes against weights unpacked into i16 lanes (`wasm_dot`).
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    wide: Vec<i16>,
    cols: usize,
}

/// One quantized activation row.
#[derive(Clone, Copy)]
pub(super) struct KRow<'a> {
    /// `d_x` per 32 values.
    pub(super) scales: &'a [f32],
    /// `d_x · Σ q_x` per 16 values.
    pub(super) sums: &'a [f32],
    /// `32 Σ q_x` per 16 values.
    #[cfg(target_arch = "x86_64")]
    pub(super) x32: &'a [i32],
    /// The i8 values.
    pub(super) quants: &'a [i8],
    /// The values in i16, each 16's even-indexed first, then the odd-indexed.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    pub(super) wide: &'a [i16],
}

impl KRow<'_> {
    /// Panics unless `row` is whole super-blocks of `block_bytes` and this activation row holds
    /// as many super-blocks' values, scales and sums: the SIMD products read within those lengths.
    #[cfg(any(target_arch = "x86_64", all(target_arch = "wasm32", target_feature = "simd128")))]
    pub(super) fn check(&self, row: &[u8], block_bytes: usize) {
        let n = row.len() / block_bytes;
        assert!(row.len() == n * block_bytes && self.quants.len() == n * QK_K);
        assert!(self.scales.len() == 8 * n && self.sums.len() == 16 * n);
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        assert!(self.wide.len() == n * QK_K);
    }
}

impl KActivations {
    /// Quantizes the rows of `x` (`cols`, a multiple of 256, per row); a prefill's rows in
    /// pieces over the pool.
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        let m = x.len().checked_div(cols).unwrap_or(0);
        if m < 2 * QUANTIZE_ROWS {
            return Self::quantize_rows(x, cols);
        }
        let pieces = map_ranges(m, QUANTIZE_ROWS, |r| {
            Self::quantize_rows(&x[r.start * cols..r.end * cols], cols)
        });
        KActivations {
            scales: pieces.iter().map(|p| &p.scales[..]).collect::<Vec<_>>().concat(),
            sums: pieces.iter().map(|p| &p.sums[..]).collect::<Vec<_>>().concat(),
            #[cfg(target_arch = "x86_64")]
            x32: pieces.iter().map(|p| &p.x32[..]).collect::<Vec<_>>().concat(),
            quants: pieces.iter().map(|p| &p.quants[..]).collect::<Vec<_>>().concat(),
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            wide: pieces.iter().map(|p| &p.wide[..]).collect::<Vec<_>>().concat(),
            cols,
        }
    }

    /// [`Self::quantize`] on the calling thread.
    fn quantize_rows(x: &[f32], cols: usize) -> Self {
        fastest!(avx2_fma => Self::quantize_rows_avx2(x, cols), _ => Self::quantize_rows_portable(x, cols))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn quantize_rows_avx2(x: &[f32], cols: usize) -> Self {
        Self::quantize_rows_portable(x, cols)
    }

    #[inline(always)]
    fn quantize_rows_portable(x: &[f32], cols: usize) -> Self {
        let blocks = x.len() / BLOCK;
        let mut acts = KActivations {
            scales: vec![0.0; blocks],
            sums: vec![0.0; 2 * blocks],
            #[cfg(target_arch = "x86_64")]
            x32: Vec::with_capacity(2 * blocks),
            quants: vec![0; blocks * BLOCK],
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            wide: Vec::new(),
            cols,
        };
        let pieces = x.chunks_exact(BLOCK).zip(acts.quants.chunks_exact_mut(BLOCK));
        for (b, (values, q)) in pieces.enumerate() {
            let d = quantize_q8_to_even(values, q);
            acts.scales[b] = d;
            for (h, half) in q.chunks_exact(BLOCK / 2).enumerate() {
                let sum = half.iter().map(|&v| v as i32).sum::<i32>();
                acts.sums[2 * b + h] = d * sum as f32;
                #[cfg(target_arch = "x86_64")]
                acts.x32.push(32 * sum);
            }
        }
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        {
            acts.wide = super::wasm_dot::even_odd(&acts.quants).collect();
        }
        acts
    }

    /// Activation row `i`, built in place where it is used (a tile's rows in
    /// `KTiles::group_products`: built by a call, each was read back whole behind every store).
    #[inline(always)]
    pub(super) fn row(&self, i: usize) -> KRow<'_> {
        let blocks = self.cols / BLOCK;
        KRow {
            scales: &self.scales[i * blocks..(i + 1) * blocks],
            sums: &self.sums[2 * i * blocks..2 * (i + 1) * blocks],
            #[cfg(target_arch = "x86_64")]
            x32: &self.x32[i * self.cols / 16..(i + 1) * self.cols / 16],
            quants: &self.quants[i * self.cols..(i + 1) * self.cols],
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            wide: &self.wide[i * self.cols..(i + 1) * self.cols],
        }
    }
}

/// Activation rows one weight row is multiplied with at once where a kernel shares its unpacked
/// weights between them (`q6_K` with AVX-512 VNNI: the head of a `Q4_0`/`Q4_K_M` file in a batch
/// of decodes).
const ROWS_AT_ONCE: usize = 4;

/// `out[i] = x_{first + i} · row` for row `row` of `w` and rows `x` of `acts`; `cold`: the first
/// row of a run (see [`prefetch_ahead`]).
pub fn dot_row(w: &KRows, row: usize, acts: &KActivations, first: usize, cold: bool, out: &mut [f32]) {
    prefetch_ahead(&w.data, row * w.row_bytes..(row + 1) * w.row_bytes, cold);
    let bytes = w.row(row);
    let mut i = 0;
    while i < out.len() {
        if out.len() - i >= ROWS_AT_ONCE {
            let rows: [KRow<'_>; ROWS_AT_ONCE] = std::array::from_fn(|t| acts.row(first + i + t));
            let xs = std::array::from_fn(|t| &rows[t]);
            out[i..i + ROWS_AT_ONCE].copy_from_slice(&dots_fastest(w.kind, bytes, &xs));
            i += ROWS_AT_ONCE;
        } else {
            out[i] = dot_fastest(w.kind, bytes, &acts.row(first + i));
            i += 1;
        }
    }
}

/// `q4_K`'s eight 6-bit scales (bytes 0–7 of the four little-endian words) and eight minimums
/// (bytes 8–15) from its 12 packed bytes, four at a time as llama.cpp unpacks them.
#[inline(always)]
pub(super) fn scales_mins(packed: &[u8]) -> [u32; 4] {
    const SIX: u32 = 0x3f3f_3f3f;
    const FOUR: u32 = 0x0f0f_0f0f;
    const TWO: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]]);
    let (a, b, c) = (word(0), word(1), word(2));
    [
        a & SIX,
        (c & FOUR) | (((a >> 6) & TWO) << 4),
        b & SIX,
        ((c >> 4) & FOUR) | (((b >> 6) & TWO) << 4),
    ]
}

/// [`scales_mins`] as 16 bytes.
#[inline(always)]
pub(super) fn scale_min_bytes(packed: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(scales_mins(packed)) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// [`scales_mins`] as 16 bytes in one register, with no trip through memory (a store of words
/// read back as one wider load stalls).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn scales_mins_register(packed: &[u8]) -> std::arch::x86_64::__m128i {
    let w = scales_mins(packed);
    // SAFETY: SSE2 is part of x86_64's baseline.
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm_setr_epi32(w[0] as i32, w[1] as i32, w[2] as i32, w[3] as i32)
    }
}

/// The f16 at byte `at` (lane 0) and, when `two`, the next (lane 1), widened with F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn halves_at<const TWO: bool>(block: &[u8], at: usize) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    let first = u16::from_le_bytes([block[at], block[at + 1]]) as u32;
    let bits = if TWO {
        first | (u16::from_le_bytes([block[at + 2], block[at + 3]]) as u32) << 16
    } else {
        first
    };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
}

/// `Σ w_i · x_i` over one run of unsigned weights and signed activations, written so the compiler
/// vectorises it (wasm simd128, NEON, SSE2).
#[inline(always)]
fn int_dot(w: &[u8], x: &[i8]) -> i32 {
    w.iter().zip(x).map(|(&a, &b)| a as i32 * b as i32).sum()
}

/// 32 unsigned 6-bit `q6_K` values: the nibbles of `ql` at `LOW`, the bit pairs of `qh` at `HIGH`.
#[inline(always)]
fn unpack_q6<const LOW: u32, const HIGH: u32>(ql: &[u8], qh: &[u8], out: &mut [u8; 32]) {
    for ((o, &l), &h) in out.iter_mut().zip(ql).zip(qh) {
        *o = ((l >> LOW) & 0x0F) | (((h >> HIGH) & 3) << 4);
    }
}

/// One row's product, in portable code: each run of 32 weights unpacked into an array, then
/// [`int_dot`] per sub-block (`q4_K`) or per 16 values (`q6_K`).
pub(super) fn dot_portable(kind: KQuant, row: &[u8], x: &KRow<'_>) -> f32 {
    let mut sum = 0f32;
    let mut q = [0u8; 32];
    match kind {
        KQuant::Q4K => {
            for (b, block) in row.chunks_exact(Q4K_BYTES).enumerate() {
                let sm = scale_min_bytes(&block[4..16]);
                let (d, dmin) = (half_at(block, 0), half_at(block, 2));
                let (xq, xs) = (&x.quants[b * QK_K..][..QK_K], &x.scales[8 * b..][..8]);
                let sums = &x.sums[16 * b..][..16];
                for pair in 0..4 {
                    let bytes = &block[16 + 32 * pair..][..32];
                    // Sub-block 2·pair in the low nibbles, 2·pair + 1 in the high (constant shifts,
                    // which vectorise where a variable one does not).
                    for (sub, high) in [(2 * pair, false), (2 * pair + 1, true)] {
                        for (o, &byte) in q.iter_mut().zip(bytes) {
                            *o = if high { byte >> 4 } else { byte & 0x0F };
                        }
                        let isum = int_dot(&q, &xq[32 * sub..][..32]);
                        let xsum = sums[2 * sub] + sums[2 * sub + 1];
                        sum += d * sm[sub] as f32 * xs[sub] * isum as f32 - dmin * sm[8 + sub] as f32 * xsum;
                    }
                }
            }
        }
        KQuant::Q6K => {
            for (b, block) in row.chunks_exact(Q6K_BYTES).enumerate() {
                let d = half_at(block, 208);
                let (xq, xs) = (&x.quants[b * QK_K..][..QK_K], &x.scales[8 * b..][..8]);
                let sums = &x.sums[16 * b..][..16];
                // 32 values at a time: run `t` of half `h` is values 128h + 32t.., its low nibbles
                // in bytes 32(t % 2).. of the half's 64 (the high nibbles for t ≥ 2), its high bit
                // pairs at bit 2t of the half's 32 bytes.
                for run in 0..8 {
                    let (h, t) = (run / 4, run % 4);
                    let (ql, qh) = (&block[64 * h + 32 * (t % 2)..][..32], &block[128 + 32 * h..][..32]);
                    match t {
                        0 => unpack_q6::<0, 0>(ql, qh, &mut q),
                        1 => unpack_q6::<0, 2>(ql, qh, &mut q),
                        2 => unpack_q6::<4, 4>(ql, qh, &mut q),
                        _ => unpack_q6::<4, 6>(ql, qh, &mut q),
                    }
                    for k in 2 * run..2 * run + 2 {
                        let isum = int_dot(&q[16 * (k % 2)..][..16], &xq[16 * k..][..16]);
                        let scale = d * block[192 + k] as i8 as f32;
                        sum += scale * (xs[k / 2] * isum as f32 - 32.0 * sums[k]);
                    }
                }
            }
        }
    }
    sum
}

/// `q4_K` with AVX-512 VNNI: per 32 bytes of nibbles (64 values, two sub-blocks) one `vpdpbusd`
/// into 16 i32 sums, 8 per sub-block, each scaled by its sub-block's `d · scale · d_x`; the
/// minimums' terms summed apart, 16 at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(unsafe_code)]
fn q4k_vnni(row: &[u8], x: &KRow<'_>) -> f32 {
    use std::arch::x86_64::*;
    // The reads below stay inside the lengths this checks.
    x.check(row, Q4K_BYTES);
    let low = _mm512_set1_epi8(0x0F);
    let nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    // Lanes 0–7 take sub-block 2c's scale, lanes 8–15 sub-block 2c + 1's.
    let pick: [__m512i; 4] = std::array::from_fn(|c| {
        let (a, b) = (2 * c as i32, 2 * c as i32 + 1);
        _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
    });
    // The minimums (lanes 8–15), each twice.
    let pairs = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut corr = _mm512_setzero_ps();
    // Lanes 0–7 d, lanes 8–15 dmin.
    let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (b, block) in row.chunks_exact(Q4K_BYTES).enumerate() {
        // SAFETY: block `b` has 8 scales, 16 sums and 256 quants (asserted), and 144 bytes
        // (16 + 4 · 32).
        unsafe {
            let dm = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(halves_at::<true>(block, 0)));
            // Lanes 0–7 d · scale, lanes 8–15 dmin · minimum.
            let v = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scales_mins_register(&block[4..16]))),
                dm,
            );
            let dx = _mm512_castps256_ps512(_mm256_loadu_ps(x.scales.as_ptr().add(8 * b)));
            let s = _mm512_mul_ps(v, dx);
            let sums = _mm512_loadu_ps(x.sums.as_ptr().add(16 * b));
            corr = _mm512_fmadd_ps(_mm512_permutexvar_ps(pairs, v), sums, corr);
            for (c, idx) in pick.iter().enumerate() {
                // The 32 bytes in both halves; the upper half shifted to its high nibbles.
                let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(block.as_ptr().add(16 + 32 * c) as *const __m256i));
                let w = _mm512_and_si512(_mm512_srlv_epi16(v, nibble_shift), low);
                let xq = _mm512_loadu_si512(x.quants.as_ptr().add(b * QK_K + 64 * c) as *const _);
                let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
                acc[c % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(*idx, s), acc[c % 2]);
            }
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) - _mm512_reduce_add_ps(corr)
}

/// `q6_K` with AVX-512 VNNI, one weight row against the `T` activation rows `xs`: per 64 values
/// (64 low nibbles and their bit pairs, unpacked once for all `T`) one `vpdpbusd` of the unsigned
/// 6-bit values per activation row into 16 i32 sums, 4 per scale, each scaled by
/// `d · scale · d_x`; the offset of 32 comes off through the activations' sums, 16 scales at a
/// time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(unsafe_code)]
fn q6k_vnni<const T: usize>(row: &[u8], xs: &[&KRow<'_>; T]) -> [f32; T] {
    use std::arch::x86_64::*;
    // The reads below stay inside the lengths this checks.
    for x in xs {
        x.check(row, Q6K_BYTES);
    }
    let (low, two_bits) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
    // Lane l of the 64 values from 64p holds values 64p + 4l ..: scale 4p + l / 4.
    let pick: [__m512i; 4] = std::array::from_fn(|p| {
        let lanes: [i32; 16] = std::array::from_fn(|l| (4 * p + l / 4) as i32);
        // SAFETY: 16 i32 in `lanes`.
        unsafe { _mm512_loadu_si512(lanes.as_ptr() as *const _) }
    });
    let pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let mut acc = [[_mm512_setzero_ps(); 2]; T];
    let mut corr = [_mm512_setzero_ps(); T];
    for (b, block) in row.chunks_exact(Q6K_BYTES).enumerate() {
        // SAFETY: 210 bytes in the block (scales at 192..208); block `b` has 8 scales, 16 sums and
        // 256 quants in every activation row (checked).
        unsafe {
            let scales = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                block.as_ptr().add(192) as *const _
            )));
            let scales = _mm512_mul_ps(scales, _mm512_broadcastss_ps(halves_at::<false>(block, 208)));
            let s: [__m512; T] = std::array::from_fn(|t| {
                corr[t] = _mm512_fmadd_ps(scales, _mm512_loadu_ps(xs[t].sums.as_ptr().add(16 * b)), corr[t]);
                let dx = _mm512_castps256_ps512(_mm256_loadu_ps(xs[t].scales.as_ptr().add(8 * b)));
                _mm512_mul_ps(scales, _mm512_permutexvar_ps(pairs, dx))
            });
            for h in 0..2 {
                let ql = _mm512_loadu_si512(block.as_ptr().add(64 * h) as *const _);
                let qh = _mm256_loadu_si256(block.as_ptr().add(128 + 32 * h) as *const __m256i);
                // Bit pairs 0 and 1 of each byte for values 0..64, pairs 2 and 3 for 64..128.
                let qh_a = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                let qh_b = _mm512_srli_epi16(qh_a, 4);
                let high = |q: __m512i| _mm512_slli_epi16(_mm512_and_si512(q, two_bits), 4);
                let pieces = [
                    _mm512_or_si512(_mm512_and_si512(ql, low), high(qh_a)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low), high(qh_b)),
                ];
                for (i, q) in pieces.into_iter().enumerate() {
                    let p = 2 * h + i;
                    for t in 0..T {
                        let xq = _mm512_loadu_si512(xs[t].quants.as_ptr().add(b * QK_K + 64 * p) as *const _);
                        let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xq);
                        let scale = _mm512_permutexvar_ps(pick[p], s[t]);
                        acc[t][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[t][i]);
                    }
                }
            }
        }
    }
    std::array::from_fn(|t| {
        _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1])) - 32.0 * _mm512_reduce_add_ps(corr[t])
    })
}

/// The sum of an AVX2 register's eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn horizontal_sum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1)))
}

/// `q4_K` with AVX2: per sub-block of 32 values one `vpmaddubsw` (pairs, at most 2 · 15 · 127:
/// no saturation) and one `vpmaddwd` into 8 i32 sums, scaled by the sub-block's
/// `d · scale · d_x`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(unsafe_code)]
fn q4k_avx2(row: &[u8], x: &KRow<'_>) -> f32 {
    use std::arch::x86_64::*;
    // The reads below stay inside the lengths this checks.
    x.check(row, Q4K_BYTES);
    let (low, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let lane: [__m256i; 8] = std::array::from_fn(|k| _mm256_set1_epi32(k as i32));
    let (pairs_lo, pairs_hi) = (
        _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
        _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7),
    );
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut corr = _mm256_setzero_ps();
    for (b, block) in row.chunks_exact(Q4K_BYTES).enumerate() {
        // SAFETY: as in `q4k_vnni`.
        unsafe {
            let dm = halves_at::<true>(block, 0);
            let sm = scales_mins_register(&block[4..16]);
            let widen = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
            let dx = _mm256_loadu_ps(x.scales.as_ptr().add(8 * b));
            let s = _mm256_mul_ps(_mm256_mul_ps(widen(sm), _mm256_broadcastss_ps(dm)), dx);
            let m = _mm256_mul_ps(
                widen(_mm_unpackhi_epi64(sm, sm)),
                _mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
            );
            let sums = x.sums.as_ptr().add(16 * b);
            corr = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(m, pairs_lo), _mm256_loadu_ps(sums), corr);
            corr = _mm256_fmadd_ps(
                _mm256_permutevar8x32_ps(m, pairs_hi),
                _mm256_loadu_ps(sums.add(8)),
                corr,
            );
            for c in 0..4 {
                let v = _mm256_loadu_si256(block.as_ptr().add(16 + 32 * c) as *const __m256i);
                let xq = x.quants.as_ptr().add(b * QK_K + 64 * c) as *const __m256i;
                for (h, w) in [_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)]
                    .into_iter()
                    .enumerate()
                {
                    let isum = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256(xq.add(h))), ones);
                    let scale = _mm256_permutevar8x32_ps(s, lane[2 * c + h]);
                    acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[h]);
                }
            }
        }
    }
    horizontal_sum(_mm256_sub_ps(_mm256_add_ps(acc[0], acc[1]), corr))
}

/// `q6_K` with AVX2: per 32 values one `vpmaddubsw` of the unsigned 6-bit values (pairs, at most
/// 2 · 63 · 127: no saturation) and one `vpmaddwd` into 8 i32 sums, 4 per scale, each scaled by
/// `d · scale · d_x`; the offset of 32 through the activations' sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(unsafe_code)]
fn q6k_avx2(row: &[u8], x: &KRow<'_>) -> f32 {
    use std::arch::x86_64::*;
    // The reads below stay inside the lengths this checks.
    x.check(row, Q6K_BYTES);
    let (low, two_bits, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3), _mm256_set1_epi16(1));
    // Lanes 0–3 take scale 2k, lanes 4–7 scale 2k + 1 (k within a register of eight).
    let pick: [__m256i; 4] = std::array::from_fn(|k| {
        let (a, b) = (2 * k as i32, 2 * k as i32 + 1);
        _mm256_setr_epi32(a, a, a, a, b, b, b, b)
    });
    let (pairs_lo, pairs_hi) = (
        _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
        _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7),
    );
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut corr = _mm256_setzero_ps();
    for (b, block) in row.chunks_exact(Q6K_BYTES).enumerate() {
        // SAFETY: as in `q6k_vnni`.
        unsafe {
            let d = _mm256_broadcastss_ps(halves_at::<false>(block, 208));
            let widen = |at: usize| {
                let bytes = _mm_loadl_epi64(block.as_ptr().add(192 + at) as *const _);
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d)
            };
            let scales = [widen(0), widen(8)];
            let sums = x.sums.as_ptr().add(16 * b);
            corr = _mm256_fmadd_ps(scales[0], _mm256_loadu_ps(sums), corr);
            corr = _mm256_fmadd_ps(scales[1], _mm256_loadu_ps(sums.add(8)), corr);
            let dx = _mm256_loadu_ps(x.scales.as_ptr().add(8 * b));
            let s = [
                _mm256_mul_ps(scales[0], _mm256_permutevar8x32_ps(dx, pairs_lo)),
                _mm256_mul_ps(scales[1], _mm256_permutevar8x32_ps(dx, pairs_hi)),
            ];
            for (h, s) in s.iter().enumerate() {
                let ql = block.as_ptr().add(64 * h) as *const __m256i;
                let (ql0, ql1) = (_mm256_loadu_si256(ql), _mm256_loadu_si256(ql.add(1)));
                let qh = _mm256_loadu_si256(block.as_ptr().add(128 + 32 * h) as *const __m256i);
                let high = |shift: i32| {
                    let bits = match shift {
                        0 => qh,
                        2 => _mm256_srli_epi16(qh, 2),
                        4 => _mm256_srli_epi16(qh, 4),
                        _ => _mm256_srli_epi16(qh, 6),
                    };
                    _mm256_slli_epi16(_mm256_and_si256(bits, two_bits), 4)
                };
                let pieces = [
                    _mm256_or_si256(_mm256_and_si256(ql0, low), high(0)),
                    _mm256_or_si256(_mm256_and_si256(ql1, low), high(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), high(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), high(6)),
                ];
                for (t, q) in pieces.into_iter().enumerate() {
                    let xq = x.quants.as_ptr().add(b * QK_K + 128 * h + 32 * t) as *const __m256i;
                    let isum = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256(xq)), ones);
                    let scale = _mm256_permutevar8x32_ps(*s, pick[t]);
                    acc[t % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[t % 2]);
                }
            }
        }
    }
    horizontal_sum(_mm256_fmadd_ps(
        corr,
        _mm256_set1_ps(-32.0),
        _mm256_add_ps(acc[0], acc[1]),
    ))
}

/// [`dot_portable`] with the widest instructions this CPU has.
fn dot_fastest(kind: KQuant, row: &[u8], x: &KRow<'_>) -> f32 {
    fastest!(
        avx512_vnni => match kind {
            KQuant::Q4K => q4k_vnni(row, x),
            KQuant::Q6K => q6k_vnni(row, &[x])[0],
        },
        avx2_fma => match kind {
            KQuant::Q4K => q4k_avx2(row, x),
            KQuant::Q6K => q6k_avx2(row, x),
        },
        _ => {
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            return match kind {
                KQuant::Q4K => super::wasm_dot::q4k(row, x),
                KQuant::Q6K => super::wasm_dot::q6k(row, x),
            };
            #[allow(unreachable_code)]
            dot_portable(kind, row, x)
        },
    )
}

/// [`dot_fastest`] for [`ROWS_AT_ONCE`] activation rows.
fn dots_fastest(kind: KQuant, row: &[u8], xs: &[&KRow<'_>; ROWS_AT_ONCE]) -> [f32; ROWS_AT_ONCE] {
    fastest!(
        avx512_vnni => match kind {
            KQuant::Q4K => xs.map(|x| q4k_vnni(row, x)),
            KQuant::Q6K => q6k_vnni(row, xs),
        },
        _ => xs.map(|x| dot_fastest(kind, row, x)),
    )
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::arch::blocks::tests::values;
    use half::f16;

    /// A prefill's activations, quantized in pieces over the pool, are each row's quantized alone.
    #[test]
    fn rows_quantized_in_pieces_are_each_row_s() {
        let (m, cols) = (3 * QUANTIZE_ROWS + 5, 2 * QK_K);
        let x = values(m * cols, 5);
        let all = KActivations::quantize(&x, cols);
        for i in [0, QUANTIZE_ROWS, m - 1] {
            let (one, got) = (KActivations::quantize(&x[i * cols..(i + 1) * cols], cols), all.row(i));
            let want = one.row(0);
            assert_eq!(
                (got.scales, got.sums, got.quants),
                (want.scales, want.sums, want.quants)
            );
            #[cfg(target_arch = "x86_64")]
            assert_eq!(got.x32, want.x32);
        }
    }

    /// The product by every path this CPU can run, named, whatever `KVLENS_CPU_ISA` asks for.
    #[allow(unsafe_code)]
    fn every_path(kind: KQuant, row: &[u8], x: &KRow<'_>) -> Vec<(&'static str, f32)> {
        // Only x86_64 adds its own paths.
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut got = vec![
            ("portable", dot_portable(kind, row, x)),
            ("fastest", dot_fastest(kind, row, x)),
        ];
        #[cfg(target_arch = "x86_64")]
        {
            /// One format's product, compiled for some instruction set.
            type Dot = unsafe fn(&[u8], &KRow<'_>) -> f32;
            let found = super::super::isa::detected();
            /// One activation row through the kernel of several.
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
            fn q6k_vnni_one(row: &[u8], x: &KRow<'_>) -> f32 {
                q6k_vnni(row, &[x])[0]
            }
            let paths: [(&str, bool, Dot, Dot); 2] = [
                ("avx2", found.avx2_fma, q4k_avx2, q6k_avx2),
                ("avx512-vnni", found.avx512_vnni, q4k_vnni, q6k_vnni_one),
            ];
            for (name, _, q4k, q6k) in paths.into_iter().filter(|p| p.1) {
                let dot = if kind == KQuant::Q4K { q4k } else { q6k };
                // SAFETY: the CPU has the instructions the function was compiled for.
                got.push((name, unsafe { dot(row, x) }));
            }
        }
        got
    }

    /// Rows of random super-blocks (every bit pattern of the quants, scales and minimums), with
    /// their f16 scales set to moderate values of either sign.
    pub(in crate::backend::cpu) fn random_rows(kind: KQuant, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut data: Vec<u8> = (0..rows * cols / QK_K * kind.block_bytes())
            .map(|_| next() as u8)
            .collect();
        for block in data.chunks_exact_mut(kind.block_bytes()) {
            let mut half = |at: usize| {
                let v = (next() % 2001) as f32 / 1000.0 - 1.0;
                block[at..at + 2].copy_from_slice(&f16::from_f32(v * 0.01).to_le_bytes());
            };
            match kind {
                KQuant::Q4K => (half(0), half(2)),
                KQuant::Q6K => (half(208), ()),
            };
        }
        data
    }

    /// `q4_K`'s unpacked scales and minimums are GGML's, sub-block by sub-block.
    #[test]
    fn scales_and_minimums_unpack_as_ggml_reads_them() {
        let data = random_rows(KQuant::Q4K, 1, 8 * QK_K, 5);
        for block in data.chunks_exact(Q4K_BYTES) {
            let sm = scale_min_bytes(&block[4..16]);
            let mut values = [0f32; QK_K];
            GgmlType::Q4K.dequantize(block, &mut values);
            let (d, dmin) = (half_at(block, 0), half_at(block, 2));
            for sub in 0..8 {
                let q = (block[16 + sub / 2 * 32] >> (4 * (sub % 2))) & 0x0F;
                let want = d * sm[sub] as f32 * q as f32 - dmin * sm[8 + sub] as f32;
                assert_eq!(values[32 * sub], want, "sub-block {sub}");
            }
        }
    }

    /// A weight row against several activation rows at once (a batch of decodes) gives each
    /// activation row's own product, for counts off the kernel's.
    #[test]
    fn several_activation_rows_get_their_own_products() {
        for kind in [KQuant::Q4K, KQuant::Q6K] {
            let (rows, cols, m) = (2, 3 * QK_K, ROWS_AT_ONCE + 2);
            let w = KRows::new(kind, &random_rows(kind, rows, cols, 9), rows, cols).unwrap();
            let acts = KActivations::quantize(&values(m * cols, 3), cols);
            for r in 0..rows {
                let mut out = vec![0f32; m];
                dot_row(&w, r, &acts, 0, true, &mut out);
                for (i, &got) in out.iter().enumerate() {
                    assert_eq!(got, dot_fastest(kind, w.row(r), &acts.row(i)), "{kind:?} ({r}, {i})");
                }
            }
        }
    }

    /// Every path gives the dequantized weights' product with the quantized activations.
    #[test]
    fn dot_products_are_the_dequantized_products() {
        for kind in [KQuant::Q4K, KQuant::Q6K] {
            for cols in [QK_K, 3 * QK_K, 11 * QK_K] {
                let rows = 3;
                let data = random_rows(kind, rows, cols, cols as u64);
                let w = KRows::new(kind, &data, rows, cols).unwrap();
                let x = values(2 * cols, 7);
                let acts = KActivations::quantize(&x, cols);
                for i in 0..2 {
                    let row = acts.row(i);
                    let xd: Vec<f32> = row
                        .quants
                        .iter()
                        .enumerate()
                        .map(|(e, &q)| q as f32 * row.scales[e / BLOCK])
                        .collect();
                    let mut wide = vec![0f32; cols];
                    for r in 0..rows {
                        w.dequantize_row(r, &mut wide);
                        let want: f64 = wide.iter().zip(&xd).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let scale: f64 = wide.iter().zip(&xd).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                        for (name, g) in every_path(kind, w.row(r), &row) {
                            assert!(
                                (g as f64 - want).abs() <= 1e-5 * scale.max(1e-3),
                                "{kind:?} {cols} {name}: {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Rows must be whole super-blocks and the bytes whole rows.
    #[test]
    fn rows_of_other_shapes_are_refused() {
        assert!(KRows::new(KQuant::Q4K, &[0; Q4K_BYTES], 1, QK_K).is_some());
        assert!(KRows::new(KQuant::Q4K, &[0; Q4K_BYTES], 2, QK_K).is_none());
        assert!(KRows::new(KQuant::Q6K, &[0; Q6K_BYTES], 1, QK_K / 2).is_none());
        assert_eq!(KQuant::from_ggml(GgmlType::Q5K), None);
    }
}
