// q4_K (read after weights_ggml.wgsl): 256 values in 144 bytes, the nibbles at byte 16.
fn eight(i: u32) -> Eight {
    return k_eight((i >> 8u) * 144u, i & 255u, 16u);
}
