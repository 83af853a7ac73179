// q8_0 (read after weights_blocks.wgsl): value = d · q, q an i8 stored as q + 128 (the CPU
// backend's bytes), four per word in element order; a pair of blocks is a scale word and 16 words.
const PAIR_WORDS: u32 = 17u;

// Quant j (0..3) of a word, less the offset.
fn q_byte(word: u32, j: u32) -> f32 {
    return f32(extractBits(word, j * 8u, 8u)) - 128.0;
}

fn wload(i: u32) -> f32 {
    let at = q_block(i);
    return q_scale(at) * q_byte(w[at.x + 1u + ((i & 63u) >> 2u)], i & 3u);
}

// Elements i and i+1 (i even).
fn wload2(i: u32) -> vec2<f32> {
    let at = q_block(i);
    let word = w[at.x + 1u + ((i & 63u) >> 2u)];
    let j = i & 3u;
    return q_scale(at) * vec2<f32>(q_byte(word, j), q_byte(word, j + 1u));
}

// Elements i..i+7 (i a multiple of 8).
fn wload8(i: u32) -> array<vec4<f32>, 2> {
    let at = q_block(i);
    let d = q_scale(at);
    let q = at.x + 1u + ((i & 63u) >> 2u);
    let a = w[q];
    let b = w[q + 1u];
    return array<vec4<f32>, 2>(
        d * vec4<f32>(q_byte(a, 0u), q_byte(a, 1u), q_byte(a, 2u), q_byte(a, 3u)),
        d * vec4<f32>(q_byte(b, 0u), q_byte(b, 1u), q_byte(b, 2u), q_byte(b, 3u)),
    );
}
