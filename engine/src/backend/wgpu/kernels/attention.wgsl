// Attention of one query row and one head per 64-thread workgroup, over keys in tiles of 64 with an
// online softmax (running max and sum), f32 throughout. The same kernel serves the vision tower's
// bidirectional segments (mode 0: key p of a row is row meta.start + p of k and v) and the paged
// decoder attention (mode 1: key p sits in slot table[meta.start + p / block_size] · block_size +
// p % block_size of the layer's cache; a row's key count stops at its own position: causal).
struct Params {
    rows: u32,
    heads: u32,
    d: u32,
    // Heads per KV head (grouped-query attention).
    group: u32,
    // Floats per key row: kv_heads · d.
    kv_stride: u32,
    mode: u32,
    block_size: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
// Per query row: first key (segment start, or offset of the row's block table) and key count.
@group(0) @binding(4) var<storage, read> row_meta: array<u32>;
@group(0) @binding(5) var<storage, read> tables: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;
// Largest head width: each thread owns up to 4 output dimensions.
const MAX_D: u32 = 256u;

var<workgroup> qs: array<f32, 256>;
var<workgroup> pe: array<f32, 64>;
var<workgroup> kb: array<u32, 64>;

fn key_row(start: u32, pos: u32) -> u32 {
    if (p.mode == 0u) {
        return start + pos;
    }
    let block = tables[start + pos / p.block_size];
    return block * p.block_size + pos % p.block_size;
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let item = group_index(wid, nwg);
    if (item >= p.rows * p.heads) {
        return;
    }
    let tid = lid.x;
    let row = item / p.heads;
    let h = item % p.heads;
    let kvh = h / p.group;
    let qbase = row * p.heads * p.d + h * p.d;
    for (var c = tid; c < p.d; c = c + WG) {
        qs[c] = q[qbase + c];
    }
    let start = row_meta[row * 2u];
    let count = row_meta[row * 2u + 1u];
    var m = -3.0e38;
    var l = 0.0;
    var o: array<f32, 4>;
    for (var i = 0u; i < 4u; i = i + 1u) {
        o[i] = 0.0;
    }
    workgroupBarrier();
    for (var t0 = 0u; t0 < count; t0 = t0 + WG) {
        let pos = t0 + tid;
        var s = -3.0e38;
        var base = 0u;
        if (pos < count) {
            base = key_row(start, pos) * p.kv_stride + kvh * p.d;
            var dot = 0.0;
            for (var c = 0u; c < p.d; c = c + 1u) {
                dot = dot + qs[c] * k[base + c];
            }
            s = dot * p.scale;
        }
        pe[tid] = s;
        kb[tid] = base;
        workgroupBarrier();
        var tile_max = -3.0e38;
        let n = min(WG, count - t0);
        for (var j = 0u; j < n; j = j + 1u) {
            tile_max = max(tile_max, pe[j]);
        }
        let m_new = max(m, tile_max);
        let alpha = exp(m - m_new);
        workgroupBarrier();
        if (tid < n) {
            pe[tid] = exp(s - m_new);
        }
        workgroupBarrier();
        var sum = 0.0;
        for (var j = 0u; j < n; j = j + 1u) {
            sum = sum + pe[j];
        }
        l = l * alpha + sum;
        for (var i = 0u; i < 4u; i = i + 1u) {
            let c = tid + i * WG;
            if (c < p.d) {
                var acc = o[i] * alpha;
                for (var j = 0u; j < n; j = j + 1u) {
                    acc = acc + pe[j] * v[kb[j] + c];
                }
                o[i] = acc;
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    let obase = row * p.heads * p.d + h * p.d;
    for (var i = 0u; i < 4u; i = i + 1u) {
        let c = tid + i * WG;
        if (c < p.d) {
            out[obase + c] = o[i] / l;
        }
    }
}

// One thread per query row and head, keys one at a time with the same online softmax, no
// workgroup memory and no barriers: for CPU adapters (see matmul.wgsl `columns`).
@compute @workgroup_size(64)
fn per_thread(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let item = gid.x + gid.y * nwg.x * 64u;
    if (item >= p.rows * p.heads) {
        return;
    }
    let row = item / p.heads;
    let h = item % p.heads;
    let kvh = h / p.group;
    let qbase = row * p.heads * p.d + h * p.d;
    let start = row_meta[row * 2u];
    let count = row_meta[row * 2u + 1u];
    var o: array<f32, 256>;
    for (var c = 0u; c < p.d; c = c + 1u) {
        o[c] = 0.0;
    }
    var m = -3.0e38;
    var l = 0.0;
    for (var pos = 0u; pos < count; pos = pos + 1u) {
        let base = key_row(start, pos) * p.kv_stride + kvh * p.d;
        var dot = 0.0;
        for (var c = 0u; c < p.d; c = c + 1u) {
            dot = dot + q[qbase + c] * k[base + c];
        }
        let s = dot * p.scale;
        let m_new = max(m, s);
        let alpha = exp(m - m_new);
        let e = exp(s - m_new);
        l = l * alpha + e;
        for (var c = 0u; c < p.d; c = c + 1u) {
            o[c] = o[c] * alpha + e * v[base + c];
        }
        m = m_new;
    }
    for (var c = 0u; c < p.d; c = c + 1u) {
        out[qbase + c] = o[c] / l;
    }
}
