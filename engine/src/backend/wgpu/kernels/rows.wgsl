// Copies a block of rows × cols between two row-major f32 tensors, optionally through a row index
// list on either side and optionally adding: gathers, scatters, column slices and concatenation.
struct Params {
    rows: u32,
    cols: u32,
    src_stride: u32,
    src_col0: u32,
    dst_stride: u32,
    dst_col0: u32,
    // 0: rows in order, 1: source row idx[r], 2: destination row idx[r].
    mode: u32,
    add: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> idx: array<u32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(gid, nwg);
    if (i >= p.rows * p.cols) {
        return;
    }
    let r = i / p.cols;
    let c = i % p.cols;
    let sr = select(r, idx[r], p.mode == 1u);
    let dr = select(r, idx[r], p.mode == 2u);
    let v = src[sr * p.src_stride + p.src_col0 + c];
    let d = dr * p.dst_stride + p.dst_col0 + c;
    if (p.add == 1u) {
        dst[d] = dst[d] + v;
    } else {
        dst[d] = v;
    }
}
