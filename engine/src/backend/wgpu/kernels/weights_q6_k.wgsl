// q6_K (read after weights_ggml.wgsl): 256 values in 210 bytes, 128 bytes of low nibbles, 64 of
// high bit pairs, 16 i8 scales (one per 16 values), d (f16). Value e = 128h + 32k + l takes the
// nibble k / 2 of byte 64h + 32(k % 2) + l, the bit pair k of byte 128 + 32h + l and scale
// 8h + 2k + l / 16; value = (d · scale) · (q − 32).
fn eight(i: u32) -> Eight {
    let at = (i >> 8u) * 210u;
    let e = i & 255u;
    let h = e >> 7u;
    let k = (e >> 5u) & 3u;
    let l = e & 31u;
    let low = nibbles(wbytes8(at + 64u * h + 32u * (k & 1u) + l), k >> 1u);
    let high = (wbytes8(at + 128u + 32u * h + l) >> vec2<u32>(2u * k)) & vec2<u32>(0x03030303u);
    let scale = extractBits(bitcast<i32>(wbyte(at + 192u + 8u * h + 2u * k + (l >> 4u))), 0u, 8u);
    return Eight(whalf(at + 208u) * f32(scale), 0.0, 32.0, low | (high << vec2<u32>(4u)));
}
