// q4_1 (read after weights_ggml.wgsl): 32 values in 20 bytes, d and m (f16) then 16 bytes of
// nibbles (value j the low nibble of byte j, value j + 16 its high nibble); value = d · q + m.
fn eight(i: u32) -> Eight {
    let at = (i >> 5u) * 20u;
    let e = i & 31u;
    let dm = whalves(at);
    return Eight(dm.x, dm.y, 0.0, nibbles(wbytes8(at + 4u + (e & 15u)), e >> 4u));
}
