// q5_0 (read after weights_ggml.wgsl): 32 values in 22 bytes, d (f16), the 32 fifth bits qh (bit j
// of the little-endian word for value j), then q4_1's nibbles; value = d · (q − 16).
fn eight(i: u32) -> Eight {
    let at = (i >> 5u) * 22u;
    let e = i & 31u;
    let q = nibbles(wbytes8(at + 6u + (e & 15u)), e >> 4u) | fifth_bits(wbyte(at + 2u + (e >> 3u)));
    return Eight(whalf(at), 0.0, 16.0, q);
}
