// q5_1 (read after weights_ggml.wgsl): 32 values in 24 bytes, d and m (f16), q5_0's fifth bits,
// then q4_1's nibbles; value = d · q + m.
fn eight(i: u32) -> Eight {
    let at = (i >> 5u) * 24u;
    let e = i & 31u;
    let q = nibbles(wbytes8(at + 8u + (e & 15u)), e >> 4u) | fifth_bits(wbyte(at + 4u + (e >> 3u)));
    let dm = whalves(at);
    return Eight(dm.x, dm.y, 0.0, q);
}
