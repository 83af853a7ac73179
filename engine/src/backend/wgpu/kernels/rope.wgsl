// Rotary embedding, rotate-half convention, with host-computed cos/sin rows (M-RoPE's sections
// are already folded into them): x [rows, heads·head], cos/sin [rows, d]; the first d values of
// each head rotate (d = head but for Qwen3.5's partial rotary), the rest pass unchanged. The
// `norm_rope` entries RMS-normalise each head by `gain` first where `norm` is 1 (Qwen3's q/k norm).
struct Params {
    rows: u32,
    cols: u32,
    d: u32,
    head: u32,
    eps: f32,
    norm: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> cos_t: array<f32>;
@group(0) @binding(3) var<storage, read> sin_t: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// norm_rope only: the norm's weights [head].
@group(0) @binding(5) var<storage, read> gain: array<f32>;

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
    if (j < p.d / 2u) {
        out[i] = turn(x[i], x[i + p.d / 2u], r, j);
    } else {
        out[i] = turn(x[i], x[i - p.d / 2u], r, j);
    }
}

// A head's values (at most 256) and the reduction of its sum of squares, for `norm_rope`.
var<workgroup> staged: array<f32, 256>;
var<workgroup> red: array<f32, 64>;

// norm_rope and rope give the same rotation of value `j` of row `r`'s head, given its (normed)
// value `v` and the value `other` half a rotation away.
fn turn(v: f32, other: f32, r: u32, j: u32) -> f32 {
    let half = p.d / 2u;
    var rotated = other;
    if (j < half) {
        rotated = -other;
    }
    return v * cos_t[r * p.d + j] + rotated * sin_t[r * p.d + j];
}

// One 64-thread workgroup per head of a row: the head staged in workgroup memory, normed, turned.
@compute @workgroup_size(64)
fn norm_rope(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let item = group_index(wid, nwg);
    if (item >= p.rows * (p.cols / p.head)) {
        return;
    }
    let tid = lid.x;
    let base = item * p.head;
    let r = item / (p.cols / p.head);
    var sq = 0.0;
    for (var c = tid; c < p.head; c = c + 64u) {
        let v = x[base + c];
        staged[c] = v;
        sq = sq + v * v;
    }
    red[tid] = sq;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            red[tid] = red[tid] + red[tid + s];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(p.head) + p.eps);
    if (p.norm == 1u) {
        for (var c = tid; c < p.head; c = c + 64u) {
            staged[c] = staged[c] * inv * gain[c];
        }
    }
    workgroupBarrier();
    let half = p.d / 2u;
    for (var c = tid; c < p.head; c = c + 64u) {
        var o = staged[c];
        if (c < half) {
            o = turn(o, staged[c + half], r, c);
        } else if (c < p.d) {
            o = turn(o, staged[c - half], r, c);
        }
        out[base + c] = o;
    }
}

// `norm_rope` with one thread per head, no barriers: for CPU adapters.
@compute @workgroup_size(64)
fn norm_rope_per_head(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let item = gid.x + gid.y * nwg.x * 64u;
    if (item >= p.rows * (p.cols / p.head)) {
        return;
    }
    let base = item * p.head;
    let r = item / (p.cols / p.head);
    var sq = 0.0;
    for (var c = 0u; c < p.head; c = c + 1u) {
        sq = sq + x[base + c] * x[base + c];
    }
    let inv = 1.0 / sqrt(sq / f32(p.head) + p.eps);
    let half = p.d / 2u;
    for (var c = 0u; c < p.head; c = c + 1u) {
        var o = normed(base, c, inv);
        if (c < half) {
            o = turn(o, normed(base, c + half, inv), r, c);
        } else if (c < p.d) {
            o = turn(o, normed(base, c - half, inv), r, c);
        }
        out[base + c] = o;
    }
}

// Value `c` of the head at `base`, normed where `norm` is 1.
fn normed(base: u32, c: u32, inv: f32) -> f32 {
    if (p.norm == 1u) {
        return x[base + c] * inv * gain[c];
    }
    return x[base + c];
}
