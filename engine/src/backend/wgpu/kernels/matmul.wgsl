// y = x · wᵀ (+ b) against stored weights, for one part of a weight split by rows: the part's rows
// are output columns [col0, col0 + out_rows) of y. f32 accumulation.
//
// `gemm` (prefill, the vision tower) tiles 128×128 outputs per workgroup, 8×8 per thread, through
// workgroup memory. `gemv` (decode: one row) and `gemv_rows` (up to GEMV_ROWS rows from row0)
// give a workgroup GEMV_COLS output columns: its threads stride over k eight elements at a time,
// then their partial sums are added up in workgroup memory; every x value read serves all the
// workgroup's columns.
//
// The per-thread work is written out (no arrays indexed in loops) so that every compiler keeps it
// in registers: lavapipe does not unroll the loops and otherwise runs 2× slower.
struct Params {
    // Rows of x and y this dispatch computes, from row0.
    n: u32,
    k: u32,
    out_rows: u32,
    out_stride: u32,
    col0: u32,
    has_bias: u32,
    // First row of x and y (the gemv kernels; 0 for gemm).
    row0: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// The same buffer as vectors (the gemv kernels and columns8, whose k is a multiple of 8; never with
// `x`).
@group(0) @binding(1) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// y[r][c..c+3] = v (+ bias), the columns that exist.
fn store4(r: u32, c: u32, v: vec4<f32>) {
    for (var j = 0u; j < 4u; j = j + 1u) {
        if (c + j < p.out_rows) {
            var o = v[j];
            if (p.has_bias == 1u) {
                o = o + bias[p.col0 + c + j];
            }
            y[r * p.out_stride + p.col0 + c + j] = o;
        }
    }
}

const TILE: u32 = 128u;
const KT: u32 = 8u;

// The k-slices of the x and w tiles, k-major: entry kk·32 + j holds rows 4j..4j+3 at column k0 + kk.
var<workgroup> xs: array<vec4<f32>, 256>;
var<workgroup> ws: array<vec4<f32>, 256>;

// x[r..r+3][gk], zero outside x.
fn xcol4(r: u32, gk: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (gk < p.k) {
        for (var j = 0u; j < 4u; j = j + 1u) {
            if (r + j < p.n) {
                v[j] = x[(r + j) * p.k + gk];
            }
        }
    }
    return v;
}

// w[c..c+3][gk], zero outside the part.
fn wcol4(c: u32, gk: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (gk < p.k) {
        for (var j = 0u; j < 4u; j = j + 1u) {
            if (c + j < p.out_rows) {
                v[j] = wload((c + j) * p.k + gk);
            }
        }
    }
    return v;
}

// Thread (tx, ty) owns rows {0, 64} + 4·ty + 0..3 and columns {0, 64} + 4·tx + 0..3 of the tile:
// accumulator r{i}c{h} holds row i (0–3 from the first group, 4–7 from the second) and column group h.
@compute @workgroup_size(16, 16)
fn gemm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let tid = lid.y * 16u + lid.x;
    let col_base = wid.x * TILE;
    let row_base = wid.y * TILE;
    var r0c0 = vec4<f32>(0.0);
    var r0c1 = vec4<f32>(0.0);
    var r1c0 = vec4<f32>(0.0);
    var r1c1 = vec4<f32>(0.0);
    var r2c0 = vec4<f32>(0.0);
    var r2c1 = vec4<f32>(0.0);
    var r3c0 = vec4<f32>(0.0);
    var r3c1 = vec4<f32>(0.0);
    var r4c0 = vec4<f32>(0.0);
    var r4c1 = vec4<f32>(0.0);
    var r5c0 = vec4<f32>(0.0);
    var r5c1 = vec4<f32>(0.0);
    var r6c0 = vec4<f32>(0.0);
    var r6c1 = vec4<f32>(0.0);
    var r7c0 = vec4<f32>(0.0);
    var r7c1 = vec4<f32>(0.0);
    // Each thread loads four rows of x and four of w at one k of the slice.
    let lk = tid % KT;
    let lr = (tid / KT) * 4u;
    for (var k0 = 0u; k0 < p.k; k0 = k0 + KT) {
        xs[lk * 32u + lr / 4u] = xcol4(row_base + lr, k0 + lk);
        ws[lk * 32u + lr / 4u] = wcol4(col_base + lr, k0 + lk);
        workgroupBarrier();
        for (var kk = 0u; kk < KT; kk = kk + 1u) {
            let xa = xs[kk * 32u + lid.y];
            let xb = xs[kk * 32u + 16u + lid.y];
            let wa = ws[kk * 32u + lid.x];
            let wb = ws[kk * 32u + 16u + lid.x];
            r0c0 = fma(vec4<f32>(xa.x), wa, r0c0);
            r0c1 = fma(vec4<f32>(xa.x), wb, r0c1);
            r1c0 = fma(vec4<f32>(xa.y), wa, r1c0);
            r1c1 = fma(vec4<f32>(xa.y), wb, r1c1);
            r2c0 = fma(vec4<f32>(xa.z), wa, r2c0);
            r2c1 = fma(vec4<f32>(xa.z), wb, r2c1);
            r3c0 = fma(vec4<f32>(xa.w), wa, r3c0);
            r3c1 = fma(vec4<f32>(xa.w), wb, r3c1);
            r4c0 = fma(vec4<f32>(xb.x), wa, r4c0);
            r4c1 = fma(vec4<f32>(xb.x), wb, r4c1);
            r5c0 = fma(vec4<f32>(xb.y), wa, r5c0);
            r5c1 = fma(vec4<f32>(xb.y), wb, r5c1);
            r6c0 = fma(vec4<f32>(xb.z), wa, r6c0);
            r6c1 = fma(vec4<f32>(xb.z), wb, r6c1);
            r7c0 = fma(vec4<f32>(xb.w), wa, r7c0);
            r7c1 = fma(vec4<f32>(xb.w), wb, r7c1);
        }
        workgroupBarrier();
    }
    let acc = array<vec4<f32>, 16>(
        r0c0, r0c1, r1c0, r1c1, r2c0, r2c1, r3c0, r3c1,
        r4c0, r4c1, r5c0, r5c1, r6c0, r6c1, r7c0, r7c1,
    );
    for (var i = 0u; i < 8u; i = i + 1u) {
        let r = row_base + (i / 4u) * 64u + lid.y * 4u + i % 4u;
        if (r < p.n) {
            store4(r, col_base + lid.x * 4u, acc[i * 2u]);
            store4(r, col_base + 64u + lid.x * 4u, acc[i * 2u + 1u]);
        }
    }
}

// Output columns per gemv workgroup, and the most rows of x one gemv_rows dispatch takes.
const GEMV_COLS: u32 = 4u;
const GEMV_ROWS: u32 = 8u;
// Partial sums of the 64 threads, per (row, column) pair; rows padded to 65 so that neither the
// writes nor the sums hit one memory bank.
const PAD: u32 = 65u;
var<workgroup> partial: array<f32, 2080>;

// Elements i..i+7 of the workgroup's four weight rows (offsets in `rows`).
fn wload8x4(rows: vec4<u32>, i: u32) -> array<array<vec4<f32>, 2>, 4> {
    return array<array<vec4<f32>, 2>, 4>(wload8(rows.x + i), wload8(rows.y + i), wload8(rows.z + i), wload8(rows.w + i));
}

// x[i..i+7] of row r (a, b) dotted with each of the four weight slices.
fn dots(a: vec4<f32>, b: vec4<f32>, wv: array<array<vec4<f32>, 2>, 4>) -> vec4<f32> {
    return vec4<f32>(
        dot(a, wv[0][0]) + dot(b, wv[0][1]),
        dot(a, wv[1][0]) + dot(b, wv[1][1]),
        dot(a, wv[2][0]) + dot(b, wv[2][1]),
        dot(a, wv[3][0]) + dot(b, wv[3][1]),
    );
}

// Offsets of the workgroup's four weight rows (past the part's end: its last row, not stored).
fn gemv_rows_of(c0: u32) -> vec4<u32> {
    let last = p.out_rows - 1u;
    return vec4<u32>(min(c0, last), min(c0 + 1u, last), min(c0 + 2u, last), min(c0 + 3u, last)) * p.k;
}

// Adds up the threads' partial sums (row r's four columns in partial[(r·4 + c)·PAD + thread]) and
// stores rows row0..row0+rows of the workgroup's columns.
fn gemv_finish(tid: u32, c0: u32, rows: u32) {
    workgroupBarrier();
    if (tid < rows * GEMV_COLS) {
        var s = 0.0;
        for (var t = 0u; t < 64u; t = t + 1u) {
            s = s + partial[tid * PAD + t];
        }
        let c = c0 + tid % GEMV_COLS;
        if (c < p.out_rows) {
            if (p.has_bias == 1u) {
                s = s + bias[p.col0 + c];
            }
            y[(p.row0 + tid / GEMV_COLS) * p.out_stride + p.col0 + c] = s;
        }
    }
}

fn gemv_keep(tid: u32, r: u32, acc: vec4<f32>) {
    for (var c = 0u; c < GEMV_COLS; c = c + 1u) {
        partial[(r * GEMV_COLS + c) * PAD + tid] = acc[c];
    }
}

// One row of x (row0); k a multiple of 8.
@compute @workgroup_size(64)
fn gemv(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c0 = group_index(wid, nwg) * GEMV_COLS;
    let rows = gemv_rows_of(c0);
    let xrow = (p.row0 * p.k) >> 2u;
    var acc = vec4<f32>(0.0);
    for (var i = lid.x * 8u; i < p.k; i = i + 512u) {
        let xi = xrow + (i >> 2u);
        acc = acc + dots(x4[xi], x4[xi + 1u], wload8x4(rows, i));
    }
    gemv_keep(lid.x, 0u, acc);
    gemv_finish(lid.x, c0, 1u);
}

// x[row0 + r] · w for r < min(n, GEMV_ROWS), one weight read for all of them; k a multiple of 8.
@compute @workgroup_size(64)
fn gemv_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c0 = group_index(wid, nwg) * GEMV_COLS;
    let rows = gemv_rows_of(c0);
    let n = min(p.n, GEMV_ROWS);
    // Row r of x starts at x4[x0 + r·kq]; rows from n on are neither read nor stored.
    let x0 = (p.row0 * p.k) >> 2u;
    let kq = p.k >> 2u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    for (var i = lid.x * 8u; i < p.k; i = i + 512u) {
        let wv = wload8x4(rows, i);
        let xq = x0 + (i >> 2u);
        a0 = a0 + dots(x4[xq], x4[xq + 1u], wv);
        if (n > 1u) {
            a1 = a1 + dots(x4[xq + 1u * kq], x4[xq + 1u * kq + 1u], wv);
        }
        if (n > 2u) {
            a2 = a2 + dots(x4[xq + 2u * kq], x4[xq + 2u * kq + 1u], wv);
        }
        if (n > 3u) {
            a3 = a3 + dots(x4[xq + 3u * kq], x4[xq + 3u * kq + 1u], wv);
        }
        if (n > 4u) {
            a4 = a4 + dots(x4[xq + 4u * kq], x4[xq + 4u * kq + 1u], wv);
        }
        if (n > 5u) {
            a5 = a5 + dots(x4[xq + 5u * kq], x4[xq + 5u * kq + 1u], wv);
        }
        if (n > 6u) {
            a6 = a6 + dots(x4[xq + 6u * kq], x4[xq + 6u * kq + 1u], wv);
        }
        if (n > 7u) {
            a7 = a7 + dots(x4[xq + 7u * kq], x4[xq + 7u * kq + 1u], wv);
        }
    }
    let acc = array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7);
    for (var r = 0u; r < n; r = r + 1u) {
        gemv_keep(lid.x, r, acc[r]);
    }
    gemv_finish(lid.x, c0, n);
}

// One thread per output column and block of 4 rows, no workgroup memory and no barriers: for
// CPU adapters (lavapipe, SwiftShader), where a barrier costs a context switch per invocation and
// the tiled kernels above run an order of magnitude slower. Grid: x over columns (64 per
// workgroup, wrapped into y beyond 65,535 workgroups), z over blocks of 4 rows. `columns8` (k a
// multiple of 8) loads eight weights and vectors of x at a time: such an adapter pays per load
// more than per byte, and a block format decodes its scale once per eight weights.

// The thread's column, or past the part's end.
fn columns_col(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 64u;
}

// y[r0 + r][c] = acc[r] (+ bias) for the rows < rows.
fn columns_store(c: u32, r0: u32, rows: u32, acc: vec4<f32>) {
    for (var r = 0u; r < rows; r = r + 1u) {
        var v = acc[r];
        if (p.has_bias == 1u) {
            v = v + bias[p.col0 + c];
        }
        y[(r0 + r) * p.out_stride + p.col0 + c] = v;
    }
}

@compute @workgroup_size(64)
fn columns(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = columns_col(gid, nwg);
    let r0 = gid.z * 4u;
    if (c >= p.out_rows) {
        return;
    }
    var acc = vec4<f32>(0.0);
    let wbase = c * p.k;
    let rows = min(4u, p.n - r0);
    for (var i = 0u; i < p.k; i = i + 1u) {
        let wv = wload(wbase + i);
        for (var r = 0u; r < rows; r = r + 1u) {
            acc[r] = acc[r] + x[(r0 + r) * p.k + i] * wv;
        }
    }
    columns_store(c, r0, rows, acc);
}

// x[row][i..i+7] (as x4 index xi, xi + 1) dotted with eight weights.
fn dot8(xi: u32, wv: array<vec4<f32>, 2>) -> f32 {
    return dot(x4[xi], wv[0]) + dot(x4[xi + 1u], wv[1]);
}

@compute @workgroup_size(64)
fn columns8(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = columns_col(gid, nwg);
    let r0 = gid.z * 4u;
    if (c >= p.out_rows) {
        return;
    }
    let wbase = c * p.k;
    let rows = min(4u, p.n - r0);
    // Row r0 + r of x starts at x4[x0 + r·kq].
    let kq = p.k >> 2u;
    let x0 = r0 * kq;
    var a0 = 0.0;
    var a1 = 0.0;
    var a2 = 0.0;
    var a3 = 0.0;
    for (var i = 0u; i < p.k; i = i + 8u) {
        let wv = wload8(wbase + i);
        let xi = x0 + (i >> 2u);
        a0 = a0 + dot8(xi, wv);
        if (rows > 1u) {
            a1 = a1 + dot8(xi + kq, wv);
        }
        if (rows > 2u) {
            a2 = a2 + dot8(xi + 2u * kq, wv);
        }
        if (rows > 3u) {
            a3 = a3 + dot8(xi + 3u * kq, wv);
        }
    }
    columns_store(c, r0, rows, vec4<f32>(a0, a1, a2, a3));
}
