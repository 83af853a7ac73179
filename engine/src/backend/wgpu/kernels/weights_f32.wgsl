// Weights stored as f32.
@group(0) @binding(9) var<storage, read> w: array<f32>;

fn wload(i: u32) -> f32 {
    return w[i];
}

// Elements i and i+1 (i even).
fn wload2(i: u32) -> vec2<f32> {
    return vec2<f32>(w[i], w[i + 1u]);
}
