// Shared by every kernel: the flat index of a thread in a dispatch of 256-wide workgroups laid out
// over x and y (a dimension holds at most 65,535 workgroups).
fn flat_index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 256u;
}

// The flat index of a workgroup in a 2-D grid.
fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}
