// Rows of a weight table (one part of a table split by rows): `gather` picks the rows of token ids
// that fall in this part, widened to f32.
struct Params {
    rows: u32,
    cols: u32,
    row0: u32,
    part_rows: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn gather(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(gid, nwg);
    if (i >= p.rows * p.cols) {
        return;
    }
    let r = i / p.cols;
    let id = ids[r];
    if (id < p.row0 || id >= p.row0 + p.part_rows) {
        return;
    }
    out[i] = wload((id - p.row0) * p.cols + i % p.cols);
}
