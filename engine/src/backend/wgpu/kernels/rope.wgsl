// Rotary embedding, rotate-half convention, with host-computed cos/sin rows (M-RoPE's sections
// are already folded into them): x [rows, heads·head], cos/sin [rows, d]; the first d values of
// each head rotate (d = head but for Qwen3.5's partial rotary), the rest pass unchanged.
struct Params {
    rows: u32,
    cols: u32,
    d: u32,
    head: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> cos_t: array<f32>;
@group(0) @binding(3) var<storage, read> sin_t: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(gid, nwg);
    if (i >= p.rows * p.cols) {
        return;
    }
    let r = i / p.cols;
    let j = (i % p.cols) % p.head;
    if (j >= p.d) {
        out[i] = x[i];
        return;
    }
    let half = p.d / 2u;
    var rotated: f32;
    if (j < half) {
        rotated = -x[i + half];
    } else {
        rotated = x[i - half];
    }
    out[i] = x[i] * cos_t[r * p.d + j] + rotated * sin_t[r * p.d + j];
}
