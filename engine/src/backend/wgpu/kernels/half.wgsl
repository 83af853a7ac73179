// The f16 bit pattern h as f32, subnormals included (unpack2x16float may flush them to zero).
// Shared by the block formats' readers.
fn half_bits(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        // m · 2⁻²⁴, exact in f32.
        return bitcast<f32>(sign | 0x33800000u) * f32(m);
    }
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}
