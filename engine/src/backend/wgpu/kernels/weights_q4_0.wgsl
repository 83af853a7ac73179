// q4_0 (read after weights_blocks.wgsl): value = d · (q − 8), q in 0..15, eight per word in
// element order (element 8t + n of a block in nibble n of its word t; GGML's bytes hold values j
// and j + 16 in one byte); a pair of blocks is a scale word and 8 words.
const PAIR_WORDS: u32 = 9u;

// Quant n (0..7) of a word, less the offset.
fn q_nibble(word: u32, n: u32) -> f32 {
    return f32(extractBits(word, n * 4u, 4u)) - 8.0;
}

fn wload(i: u32) -> f32 {
    let at = q_block(i);
    return q_scale(at) * q_nibble(w[at.x + 1u + ((i & 63u) >> 3u)], i & 7u);
}

// Elements i and i+1 (i even).
fn wload2(i: u32) -> vec2<f32> {
    let at = q_block(i);
    let word = w[at.x + 1u + ((i & 63u) >> 3u)];
    let n = i & 7u;
    return q_scale(at) * vec2<f32>(q_nibble(word, n), q_nibble(word, n + 1u));
}

// Elements i..i+7 (i a multiple of 8).
fn wload8(i: u32) -> array<vec4<f32>, 2> {
    let at = q_block(i);
    let d = q_scale(at);
    let q = w[at.x + 1u + ((i & 63u) >> 3u)];
    return array<vec4<f32>, 2>(
        d * vec4<f32>(q_nibble(q, 0u), q_nibble(q, 1u), q_nibble(q, 2u), q_nibble(q, 3u)),
        d * vec4<f32>(q_nibble(q, 4u), q_nibble(q, 5u), q_nibble(q, 6u), q_nibble(q, 7u)),
    );
}
