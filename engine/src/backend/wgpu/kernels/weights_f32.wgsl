// Weights stored as f32.
@group(0) @binding(9) var<storage, read> w: array<f32>;

fn wload(i: u32) -> f32 {
    return w[i];
}

// The same buffer as vectors, for kernels that read eight consecutive weights at a time (a kernel
// uses `w` or `w4`, never both). The buffer holds whole vectors when rows have a multiple of 8
// elements.
@group(0) @binding(9) var<storage, read> w4: array<vec4<f32>>;

// Elements i..i+7 (i a multiple of 8).
fn wload8(i: u32) -> array<vec4<f32>, 2> {
    let j = i >> 2u;
    return array<vec4<f32>, 2>(w4[j], w4[j + 1u]);
}
