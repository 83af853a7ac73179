// y = x · wᵀ (+ b) against stored weights, for one part of a weight split by rows: the part's rows
// are output columns [col0, col0 + out_rows) of y. `gemm` tiles 64×64 outputs per workgroup (4×4
// per thread) for prefill and the vision tower; `gemv` reduces one output column per workgroup for
// a few rows (decode). f32 accumulation.
struct Params {
    n: u32,
    k: u32,
    out_rows: u32,
    out_stride: u32,
    col0: u32,
    has_bias: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const TILE: u32 = 64u;
const KT: u32 = 16u;

var<workgroup> xs: array<f32, 1024>;
var<workgroup> ws: array<f32, 1024>;

@compute @workgroup_size(16, 16)
fn gemm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let tid = lid.y * 16u + lid.x;
    let col_base = wid.x * TILE;
    let row_base = wid.y * TILE;
    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i = i + 1u) {
        acc[i] = 0.0;
    }
    for (var k0 = 0u; k0 < p.k; k0 = k0 + KT) {
        // 64 rows × 16 k of x and of w: four elements per thread each.
        for (var e = 0u; e < 4u; e = e + 1u) {
            let li = tid * 4u + e;
            let r = li / KT;
            let kk = li % KT;
            let gk = k0 + kk;
            let xr = row_base + r;
            var xv = 0.0;
            if (xr < p.n && gk < p.k) {
                xv = x[xr * p.k + gk];
            }
            xs[kk * TILE + r] = xv;
            let wr = col_base + r;
            var wv = 0.0;
            if (wr < p.out_rows && gk < p.k) {
                wv = wload(wr * p.k + gk);
            }
            ws[kk * TILE + r] = wv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KT; kk = kk + 1u) {
            var xv: array<f32, 4>;
            var wv: array<f32, 4>;
            for (var i = 0u; i < 4u; i = i + 1u) {
                xv[i] = xs[kk * TILE + lid.y * 4u + i];
                wv[i] = ws[kk * TILE + lid.x * 4u + i];
            }
            for (var i = 0u; i < 4u; i = i + 1u) {
                for (var j = 0u; j < 4u; j = j + 1u) {
                    acc[i * 4u + j] = acc[i * 4u + j] + xv[i] * wv[j];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i = i + 1u) {
        let r = row_base + lid.y * 4u + i;
        for (var j = 0u; j < 4u; j = j + 1u) {
            let c = col_base + lid.x * 4u + j;
            if (r < p.n && c < p.out_rows) {
                var v = acc[i * 4u + j];
                if (p.has_bias == 1u) {
                    v = v + bias[p.col0 + c];
                }
                y[r * p.out_stride + p.col0 + c] = v;
            }
        }
    }
}

// Rows handled by one gemv workgroup.
const GEMV_ROWS: u32 = 4u;

var<workgroup> red: array<f32, 256>;

// One output column (a weight row) per workgroup of 64 threads, for up to GEMV_ROWS rows of x;
// k is even so weights are read two at a time.
@compute @workgroup_size(64)
fn gemv(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = group_index(wid, nwg);
    if (c >= p.out_rows) {
        return;
    }
    let tid = lid.x;
    var acc: array<f32, 4>;
    for (var r = 0u; r < GEMV_ROWS; r = r + 1u) {
        acc[r] = 0.0;
    }
    let wbase = c * p.k;
    for (var i = tid * 2u; i < p.k; i = i + 128u) {
        let wv = wload2(wbase + i);
        for (var r = 0u; r < GEMV_ROWS; r = r + 1u) {
            if (r < p.n) {
                acc[r] = acc[r] + x[r * p.k + i] * wv.x + x[r * p.k + i + 1u] * wv.y;
            }
        }
    }
    for (var r = 0u; r < GEMV_ROWS; r = r + 1u) {
        red[r * 64u + tid] = acc[r];
    }
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            for (var r = 0u; r < GEMV_ROWS; r = r + 1u) {
                red[r * 64u + tid] = red[r * 64u + tid] + red[r * 64u + tid + s];
            }
        }
        workgroupBarrier();
    }
    if (tid < p.n) {
        var v = red[tid * 64u];
        if (p.has_bias == 1u) {
            v = v + bias[p.col0 + c];
        }
        y[tid * p.out_stride + p.col0 + c] = v;
    }
}

// One thread per output column and block of 4 rows, no workgroup memory and no barriers: for
// CPU adapters (lavapipe, SwiftShader), where a barrier costs a context switch per invocation and
// the tiled kernels above run an order of magnitude slower. Grid: x over columns (64 per
// workgroup, wrapped into y beyond 65,535 workgroups), z over blocks of 4 rows.
@compute @workgroup_size(64)
fn columns(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = gid.x + gid.y * nwg.x * 64u;
    let r0 = gid.z * 4u;
    if (c >= p.out_rows) {
        return;
    }
    var acc: array<f32, 4>;
    for (var r = 0u; r < 4u; r = r + 1u) {
        acc[r] = 0.0;
    }
    let wbase = c * p.k;
    let rows = min(4u, p.n - r0);
    for (var i = 0u; i < p.k; i = i + 1u) {
        let wv = wload(wbase + i);
        for (var r = 0u; r < rows; r = r + 1u) {
            acc[r] = acc[r] + x[(r0 + r) * p.k + i] * wv;
        }
    }
    for (var r = 0u; r < rows; r = r + 1u) {
        var v = acc[r];
        if (p.has_bias == 1u) {
            v = v + bias[p.col0 + c];
        }
        y[(r0 + r) * p.out_stride + p.col0 + c] = v;
    }
}
