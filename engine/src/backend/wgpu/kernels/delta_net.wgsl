// Qwen3.5's Gated DeltaNet in its recurrent form, as the CPU backend computes it
// (backend/cpu/delta_net.rs): `conv` runs the depthwise causal conv1d and SiLU over each sequence's
// rows, continuing the slot's window; `delta` runs the delta rule, one workgroup per sequence and
// value head, each thread owning columns of the head's state `[key_dim, value_dim]`.
struct Params {
    seqs: u32,
    conv_dim: u32,
    conv_len: u32,
    heads: u32,
    key_heads: u32,
    key_dim: u32,
    value_dim: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// Per sequence: first row, rows, slot, fresh (1: zero the slot first).
@group(0) @binding(1) var<storage, read> seqs: array<u32>;
// conv: the projection `[rows, conv_dim]` / delta: the conv's output.
@group(0) @binding(2) var<storage, read> x: array<f32>;
// conv: the kernel `[conv_dim, conv_len + 1]` / delta: `a [rows, heads]`.
@group(0) @binding(3) var<storage, read> w: array<f32>;
// conv: the windows `[slots, conv_len, conv_dim]` / delta: the states `[slots, heads, key_dim, value_dim]`.
@group(0) @binding(4) var<storage, read_write> state: array<f32>;
// conv: `[rows, conv_dim]` after SiLU / delta: `[rows, heads · value_dim]`.
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
// delta only: `b [rows, heads]`, `A_log [heads]`, `dt_bias [heads]`.
@group(0) @binding(6) var<storage, read> b: array<f32>;
@group(0) @binding(7) var<storage, read> a_log: array<f32>;
@group(0) @binding(8) var<storage, read> dt_bias: array<f32>;

// One thread per sequence and channel, over the sequence's rows in order.
@compute @workgroup_size(256)
fn conv(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(gid, nwg);
    if (i >= p.seqs * p.conv_dim) {
        return;
    }
    let s = i / p.conv_dim;
    let c = i % p.conv_dim;
    let start = seqs[4u * s];
    let rows = seqs[4u * s + 1u];
    let window = seqs[4u * s + 2u] * p.conv_len * p.conv_dim;
    let width = p.conv_len + 1u;
    if (seqs[4u * s + 3u] == 1u) {
        for (var j = 0u; j < p.conv_len; j++) {
            state[window + j * p.conv_dim + c] = 0.0;
        }
    }
    for (var t = start; t < start + rows; t++) {
        let v = x[t * p.conv_dim + c];
        var acc = w[c * width + p.conv_len] * v;
        for (var j = 0u; j < p.conv_len; j++) {
            acc += w[c * width + j] * state[window + j * p.conv_dim + c];
        }
        out[t * p.conv_dim + c] = acc / (1.0 + exp(-acc));
        for (var j = 0u; j + 1u < p.conv_len; j++) {
            state[window + j * p.conv_dim + c] = state[window + (j + 1u) * p.conv_dim + c];
        }
        if (p.conv_len > 0u) {
            state[window + (p.conv_len - 1u) * p.conv_dim + c] = v;
        }
    }
}

const WG: u32 = 64u;
const MAX_KEY_DIM: u32 = 256u;
var<workgroup> qs: array<f32, MAX_KEY_DIM>;
var<workgroup> ks: array<f32, MAX_KEY_DIM>;

fn softplus(v: f32) -> f32 {
    if (v > 20.0) {
        return v;
    }
    return log(1.0 + exp(v));
}

@compute @workgroup_size(64)
fn delta(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = group_index(wid, nwg);
    let s = g / p.heads;
    let h = g % p.heads;
    // uniform control flow: every thread of the workgroup takes the same branches.
    if (s >= p.seqs) {
        return;
    }
    let start = seqs[4u * s];
    let rows = seqs[4u * s + 1u];
    let dk = p.key_dim;
    let dv = p.value_dim;
    let base = (seqs[4u * s + 2u] * p.heads + h) * dk * dv;
    let kh = h / (p.heads / p.key_heads);
    let key_width = p.key_heads * dk;
    if (seqs[4u * s + 3u] == 1u) {
        for (var e = lid.x; e < dk * dv; e += WG) {
            state[base + e] = 0.0;
        }
    }
    let decay_rate = exp(a_log[h]);
    let scale = 1.0 / sqrt(f32(dk));
    for (var t = start; t < start + rows; t++) {
        workgroupBarrier();
        let row = t * p.conv_dim;
        for (var i = lid.x; i < dk; i += WG) {
            qs[i] = x[row + kh * dk + i];
            ks[i] = x[row + key_width + kh * dk + i];
        }
        workgroupBarrier();
        var qq = 0.0;
        var kk = 0.0;
        for (var i = 0u; i < dk; i++) {
            qq += qs[i] * qs[i];
            kk += ks[i] * ks[i];
        }
        let q_norm = scale / sqrt(qq + 1e-6);
        let k_norm = 1.0 / sqrt(kk + 1e-6);
        let decay = exp(-decay_rate * softplus(w[t * p.heads + h] + dt_bias[h]));
        let beta = 1.0 / (1.0 + exp(-b[t * p.heads + h]));
        for (var j = lid.x; j < dv; j += WG) {
            var mem = 0.0;
            for (var i = 0u; i < dk; i++) {
                let e = base + i * dv + j;
                let sv = state[e] * decay;
                state[e] = sv;
                mem += sv * ks[i] * k_norm;
            }
            let v = x[row + 2u * key_width + h * dv + j];
            let d = (v - mem) * beta;
            var o = 0.0;
            for (var i = 0u; i < dk; i++) {
                let e = base + i * dv + j;
                let sv = state[e] + ks[i] * k_norm * d;
                state[e] = sv;
                o += sv * qs[i] * q_norm;
            }
            out[t * p.heads * dv + h * dv + j] = o;
        }
    }
}
