// q4_0 (read after weights_blocks.wgsl): value = d · (q − 8), q in 0..15, eight per word in
// element order (element 8t + n of a block in nibble n of its word t; GGML's bytes hold values j
// and j + 16 in one byte); a pair of blocks is a scale word and 8 words.
const PAIR_WORDS: u32 = 9u;

fn q_word(at: vec2<u32>, i: u32) -> u32 {
    return at.x + 1u + ((i & 63u) >> 3u);
}

// Eight quants share a word.
fn q_words8(at: vec2<u32>, i: u32) -> vec2<u32> {
    let q = w[q_word(at, i)];
    return vec2<u32>(q, q);
}

fn q_at(word: u32, i: u32) -> f32 {
    return f32(extractBits(word, (i & 7u) * 4u, 4u)) - 8.0;
}
