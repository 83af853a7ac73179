// Weights stored as f16, two per u32 (low half first): no shader-f16 feature needed.
@group(0) @binding(9) var<storage, read> w: array<u32>;

fn wload(i: u32) -> f32 {
    let pair = unpack2x16float(w[i >> 1u]);
    return select(pair.x, pair.y, (i & 1u) == 1u);
}

// Elements i and i+1 (i even).
fn wload2(i: u32) -> vec2<f32> {
    return unpack2x16float(w[i >> 1u]);
}
