// GGML's block types read as a GGUF file stores them (q4_1, q5_0, q5_1, q4_K, q5_K, q6_K): a part
// holds its rows' blocks in the file's bytes, padded with zeros to a whole word. Blocks of 22 bytes
// (q5_0) or 210 (q6_K) are not word-aligned, so everything is read by byte offset. Read after
// half.wgsl; the type's file defines `eight(i)`: elements i..i+7 (i a multiple of 8, so one
// sub-block, whose scale is decoded once) as value n = a · (q_n − offset) + b, q_n byte n of the
// two words q. That is the order of GGML's own arithmetic, so the values are GGML's (ggml.rs), up
// to one rounding where a compiler fuses the multiply and add into an fma (lavapipe does not).
@group(0) @binding(9) var<storage, read> w: array<u32>;

struct Eight {
    a: f32,
    b: f32,
    offset: f32,
    q: vec2<u32>,
}

// Byte `at`.
fn wbyte(at: u32) -> u32 {
    return extractBits(w[at >> 2u], (at & 3u) * 8u, 8u);
}

// The f16 at byte `at` (even), widened.
fn whalf(at: u32) -> f32 {
    return half_bits(extractBits(w[at >> 2u], (at & 2u) * 8u, 16u));
}

// The two f16 of the word at byte `at` (a multiple of 4), widened: one load.
fn whalves(at: u32) -> vec2<f32> {
    let h = w[at >> 2u];
    return vec2<f32>(half_bits(h & 0xffffu), half_bits(h >> 16u));
}

// Bytes at..at+7 as two little-endian words, from the two or three words they span.
fn wbytes8(at: u32) -> vec2<u32> {
    let i = at >> 2u;
    let s = (at & 3u) * 8u;
    let x = w[i];
    let y = w[i + 1u];
    if (s == 0u) {
        return vec2<u32>(x, y);
    }
    let z = w[i + 2u];
    return vec2<u32>((x >> s) | (y << (32u - s)), (y >> s) | (z << (32u - s)));
}

// The low (hi = 0) or high (hi = 1) nibbles of eight bytes, one per byte.
fn nibbles(q: vec2<u32>, hi: u32) -> vec2<u32> {
    return (q >> vec2<u32>(4u * hi)) & vec2<u32>(0x0f0f0f0fu);
}

// Bit n of the byte h as bit 4 of byte n (q5_0's and q5_1's fifth bits of eight values).
fn fifth_bits(h: u32) -> vec2<u32> {
    // The four copies of a nibble that the product adds do not overlap: no carries.
    let spread = (vec2<u32>(h & 15u, h >> 4u) * 0x00204081u) & vec2<u32>(0x01010101u);
    return spread << vec2<u32>(4u);
}

// Sub-block j's 6-bit scale and minimum from the K-quants' 12 bytes at `at` (get_scale_min_k4).
fn k_scale_min(at: u32, j: u32) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(wbyte(at + j) & 63u), f32(wbyte(at + j + 4u) & 63u));
    }
    let b = wbyte(at + j + 4u);
    let sc = (b & 15u) | ((wbyte(at + j - 4u) >> 6u) << 4u);
    let m = (b >> 4u) | ((wbyte(at + j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Elements e..e+7 of the q4_K / q5_K super-block at byte `at` (d, dmin, 12 bytes of scales, the
// nibbles at `qs`: 32 bytes per pair of 32-value sub-blocks, low nibbles first): value =
// (d · sc) · q − dmin · m. q5_K adds its fifth bits to q.
fn k_eight(at: u32, e: u32, qs: u32) -> Eight {
    let j = e >> 5u;
    let sm = k_scale_min(at + 4u, j);
    let dm = whalves(at);
    let q = nibbles(wbytes8(at + qs + 32u * (e >> 6u) + (e & 31u)), j & 1u);
    return Eight(dm.x * sm.x, -(dm.y * sm.y), 0.0, q);
}

// Bytes of a word as f32.
fn bytes4(q: u32) -> vec4<f32> {
    return vec4<f32>(f32(q & 0xffu), f32((q >> 8u) & 0xffu), f32((q >> 16u) & 0xffu), f32(q >> 24u));
}

// Elements i..i+7 (i a multiple of 8).
fn wload8(i: u32) -> array<vec4<f32>, 2> {
    let s = eight(i);
    return array<vec4<f32>, 2>(
        s.a * (bytes4(s.q.x) - s.offset) + s.b,
        s.a * (bytes4(s.q.y) - s.offset) + s.b,
    );
}

fn wload(i: u32) -> f32 {
    let s = eight(i & ~7u);
    let q = extractBits(select(s.q.x, s.q.y, (i & 4u) != 0u), (i & 3u) * 8u, 8u);
    return s.a * (f32(q) - s.offset) + s.b;
}
