// q8_0 (read after weights_blocks.wgsl): value = d · q, q an i8 stored as q + 128 (the CPU
// backend's bytes), four per word in element order; a pair of blocks is a scale word and 16 words.
const PAIR_WORDS: u32 = 17u;

fn q_word(at: vec2<u32>, i: u32) -> u32 {
    return at.x + 1u + ((i & 63u) >> 2u);
}

fn q_words8(at: vec2<u32>, i: u32) -> vec2<u32> {
    let q = q_word(at, i);
    return vec2<u32>(w[q], w[q + 1u]);
}

fn q_at(word: u32, i: u32) -> f32 {
    return f32(extractBits(word, (i & 3u) * 8u, 8u)) - 128.0;
}
