// GGML's block formats (q8_0, q4_0; 32 values and one f16 scale d per block), laid out for
// aligned 32-bit reads: pairs of blocks in PAIR_WORDS words, first a word with the two scales (the
// first block's in the low half), then the two blocks' quants. A part with an odd count of blocks
// ends with a half pair. The dequantized values are GGML's. Read after half.wgsl; the format's
// file defines PAIR_WORDS, `q_word(at, i)` (the word holding element i's quant), `q_words8(at, i)`
// (the words holding elements i..i+3 and i+4..i+7, read once) and `q_at(word, i)` (element i's
// quant, less its offset).
@group(0) @binding(9) var<storage, read> w: array<u32>;

// The word where the pair of blocks holding element i starts, and which of the two it is in.
fn q_block(i: u32) -> vec2<u32> {
    return vec2<u32>((i >> 6u) * PAIR_WORDS, (i >> 5u) & 1u);
}

// The scale of that block.
fn q_scale(at: vec2<u32>) -> f32 {
    return half_bits(extractBits(w[at.x], at.y * 16u, 16u));
}

fn wload(i: u32) -> f32 {
    let at = q_block(i);
    return q_scale(at) * q_at(w[q_word(at, i)], i);
}

// Elements i..i+7 (i a multiple of 8, so one block): one scale, the words of i and i + 4.
fn wload8(i: u32) -> array<vec4<f32>, 2> {
    let at = q_block(i);
    let d = q_scale(at);
    let words = q_words8(at, i);
    let a = words.x;
    let b = words.y;
    return array<vec4<f32>, 2>(
        d * vec4<f32>(q_at(a, i), q_at(a, i + 1u), q_at(a, i + 2u), q_at(a, i + 3u)),
        d * vec4<f32>(q_at(b, i + 4u), q_at(b, i + 5u), q_at(b, i + 6u), q_at(b, i + 7u)),
    );
}
