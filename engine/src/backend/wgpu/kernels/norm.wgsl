// RMSNorm and LayerNorm over the last axis: one 256-thread workgroup per row, reductions in
// workgroup memory, f32 throughout; and a residual add with the RMSNorm after it (`add_rms`).
struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    // 0: RMSNorm, 1: LayerNorm.
    layer: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> gain: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// add_rms only: the addend, and the sum written out beside its norm.
@group(0) @binding(5) var<storage, read> addend: array<f32>;
@group(0) @binding(6) var<storage, read_write> sum: array<f32>;

var<workgroup> red: array<f32, 256>;

fn row_sum(tid: u32, v: f32) -> f32 {
    red[tid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            red[tid] = red[tid] + red[tid + s];
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = group_index(wid, nwg);
    // Every thread of the workgroup returns together, so the barriers stay uniform.
    if (row >= p.rows) {
        return;
    }
    let tid = lid.x;
    let base = row * p.cols;
    let n = f32(p.cols);
    var mean = 0.0;
    if (p.layer == 1u) {
        var s = 0.0;
        for (var c = tid; c < p.cols; c = c + 256u) {
            s = s + x[base + c];
        }
        mean = row_sum(tid, s) / n;
    }
    var sq = 0.0;
    for (var c = tid; c < p.cols; c = c + 256u) {
        let d = x[base + c] - mean;
        sq = sq + d * d;
    }
    let inv = 1.0 / sqrt(row_sum(tid, sq) / n + p.eps);
    for (var c = tid; c < p.cols; c = c + 256u) {
        var v = (x[base + c] - mean) * inv * gain[c];
        if (p.layer == 1u) {
            v = v + bias[c];
        }
        out[base + c] = v;
    }
}

// One thread per row, no barriers: for CPU adapters (see matmul.wgsl `columns`).
@compute @workgroup_size(64)
fn per_row(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = gid.x + gid.y * nwg.x * 64u;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.cols;
    let n = f32(p.cols);
    var mean = 0.0;
    if (p.layer == 1u) {
        var s = 0.0;
        for (var c = 0u; c < p.cols; c = c + 1u) {
            s = s + x[base + c];
        }
        mean = s / n;
    }
    var sq = 0.0;
    for (var c = 0u; c < p.cols; c = c + 1u) {
        let d = x[base + c] - mean;
        sq = sq + d * d;
    }
    let inv = 1.0 / sqrt(sq / n + p.eps);
    for (var c = 0u; c < p.cols; c = c + 1u) {
        var v = (x[base + c] - mean) * inv * gain[c];
        if (p.layer == 1u) {
            v = v + bias[c];
        }
        out[base + c] = v;
    }
}

// sum = x + addend, out = RMSNorm(sum): one workgroup per row, as `main`.
@compute @workgroup_size(256)
fn add_rms(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = group_index(wid, nwg);
    if (row >= p.rows) {
        return;
    }
    let tid = lid.x;
    let base = row * p.cols;
    var sq = 0.0;
    for (var c = tid; c < p.cols; c = c + 256u) {
        let v = x[base + c] + addend[base + c];
        sum[base + c] = v;
        sq = sq + v * v;
    }
    let inv = 1.0 / sqrt(row_sum(tid, sq) / f32(p.cols) + p.eps);
    for (var c = tid; c < p.cols; c = c + 256u) {
        out[base + c] = sum[base + c] * inv * gain[c];
    }
}

// `add_rms` with one thread per row, no barriers: for CPU adapters.
@compute @workgroup_size(64)
fn add_rms_per_row(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = gid.x + gid.y * nwg.x * 64u;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.cols;
    var sq = 0.0;
    for (var c = 0u; c < p.cols; c = c + 1u) {
        let v = x[base + c] + addend[base + c];
        sum[base + c] = v;
        sq = sq + v * v;
    }
    let inv = 1.0 / sqrt(sq / f32(p.cols) + p.eps);
    for (var c = 0u; c < p.cols; c = c + 1u) {
        out[base + c] = sum[base + c] * inv * gain[c];
    }
}
