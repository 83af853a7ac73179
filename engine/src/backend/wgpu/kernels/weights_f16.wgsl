// Weights stored as f16, two per u32 (low half first): no shader-f16 feature needed.
@group(0) @binding(9) var<storage, read> w: array<u32>;

fn wload(i: u32) -> f32 {
    let pair = unpack2x16float(w[i >> 1u]);
    return select(pair.x, pair.y, (i & 1u) == 1u);
}

// The same buffer as vectors of eight f16, for kernels that read eight consecutive weights at a time
// (a kernel uses `w` or `w4`, never both). The buffer holds whole vectors when rows have a multiple
// of 8 elements.
@group(0) @binding(9) var<storage, read> w4: array<vec4<u32>>;

// Elements i..i+7 (i a multiple of 8).
fn wload8(i: u32) -> array<vec4<f32>, 2> {
    let q = w4[i >> 3u];
    return array<vec4<f32>, 2>(
        vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
        vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)),
    );
}
