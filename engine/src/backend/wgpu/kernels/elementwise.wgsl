// Element-wise activations and binary operations on f32.
struct Params {
    n: u32,
    op: u32,
    // Row width for op 7 (rows scaled by y[row]).
    cols: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

// erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7).
fn erf(v: f32) -> f32 {
    let s = sign(v);
    let a = abs(v);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    return s * (1.0 - poly * exp(-a * a));
}

fn gelu_tanh(v: f32) -> f32 {
    // tanh saturates long before |u| = 10; clamping keeps exp inside f32 on every driver.
    let u = clamp(0.7978845608028654 * (v + 0.044715 * v * v * v), -10.0, 10.0);
    return 0.5 * v * (1.0 + tanh(u));
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(gid, nwg);
    if (i >= p.n) {
        return;
    }
    let a = x[i];
    var r: f32;
    switch p.op {
        case 0u: { r = a * sigmoid(a); }
        case 1u: { r = gelu_tanh(a); }
        case 2u: { r = 0.5 * a * (1.0 + erf(a * 0.7071067811865476)); }
        case 3u: { r = a * sigmoid(1.702 * a); }
        case 4u: { r = a * sigmoid(a) * y[i]; }
        case 6u: { r = y[i] * sigmoid(a); }
        case 7u: { r = a * y[i / p.cols]; }
        default: { r = a + y[i]; }
    }
    out[i] = r;
}
