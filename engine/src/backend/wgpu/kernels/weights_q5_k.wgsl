// q5_K (read after weights_ggml.wgsl): 256 values in 176 bytes, the fifth bits at byte 16 (bit j
// of byte l for value l of sub-block j), the nibbles at byte 48.
fn eight(i: u32) -> Eight {
    let at = (i >> 8u) * 176u;
    let e = i & 255u;
    var s = k_eight(at, e, 48u);
    let high = (wbytes8(at + 16u + (e & 31u)) >> vec2<u32>(e >> 5u)) & vec2<u32>(0x01010101u);
    s.q = s.q | (high << vec2<u32>(4u));
    return s;
}
