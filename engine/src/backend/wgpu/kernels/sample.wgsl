// Sampling on the device: one 256-thread workgroup per logits row picks the row's token as
// `sample::DeviceSampling::pick` does on the host and writes it (as f32) with its log-probability
// over the whole row.
//
// Greedy is the first maximum. A draw walks the candidates, each weighing exp((l - m) / T), and
// takes the first at which the running weight passes u · (the candidates' total weight). Without
// cut-offs the walk is in id order with the most likely id swapped to the front: a prefix sum over
// per-thread chunks finds it. With top-k, top-p or min-p it is in sampling order (logit descending
// by total order, ties by id), and the candidates are always a prefix of that order, the set
// "up to (key, id)". No sort: each cut-off and the draw is the element of the set where a running
// count or weight in sampling order crosses a target, found by a search on the logits'
// order-preserving u32 keys (8 ways per pass over the row, each a reduction), then by rank among
// the equal logits of the key found. Everything is f32 where the host sums in f64 (see
// DeviceSampling for when that can change the token).
struct Params {
    rows: u32,
    cols: u32,
}

// One row's settings, written by `WgpuBackend::sample`.
struct Row {
    // 0: greedy, 1: temperature without cut-offs, 2: with top-k, top-p or min-p.
    mode: u32,
    // 0: off.
    top_k: u32,
    allowed: u32,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    u: f32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> rows: array<Row>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> wf: array<f32, 256>;
var<workgroup> wu: array<u32, 256>;
var<workgroup> wb: array<array<f32, 8>, 256>;
var<workgroup> picked: u32;

// The row being sampled: its first element, the allowed ids, the largest allowed logit, the
// temperature.
struct Ctx {
    base: u32,
    n: u32,
    m: f32,
    t: f32,
}

// A set of candidates: every allowed element up to (key, id) in sampling order.
struct Set {
    key: u32,
    id: u32,
}

// What one pass over the row finds: the first id of the largest allowed logit, the largest logit
// of the whole row, and the smallest and largest keys of the allowed logits.
struct Scan {
    best: u32,
    row_max: f32,
    kmin: u32,
    kmax: u32,
}

const NONE: u32 = 0xffffffffu;
const LOWEST: f32 = -3.4028234e38;
// A scale for `crossing` that stands for the set's own total weight.
const TOTAL: f32 = -1.0;

// The u32 whose unsigned order is f32's total order (as Rust's `f32::total_cmp`).
fn key_of(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn value_of(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u));
}

// As the host computes it: the scaled difference in f32, then exp.
fn weight(c: Ctx, v: f32) -> f32 {
    return exp((v - c.m) / c.t);
}

fn in_set(s: Set, k: u32, i: u32) -> bool {
    return k > s.key || (k == s.key && i <= s.id);
}

// The upper 12 significant bits of `a` (its product with another such half is exact).
fn upper_half(a: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(a) & 0xfffff000u);
}

// `a · b` exactly, as the unevaluated sum hi + lo (Dekker's product, split by masking so that a
// compiler fusing multiply-adds keeps it exact), so that a running weight is compared with a share
// of a total as the host's f64 does: a sum of equal weights can equal `top_p · total` rounded to
// f32 where it falls just short of it exactly.
fn product(a: f32, b: f32) -> vec2<f32> {
    let hi = a * b;
    let a1 = upper_half(a);
    let b1 = upper_half(b);
    let a2 = a - a1;
    let b2 = b - b1;
    return vec2<f32>(hi, (((a1 * b1 - hi) + a1 * b2) + a2 * b1) + a2 * b2);
}

// Whether `w` passes the goal `aim.x + aim.y` (`inclusive`: reaches it).
fn reaches(w: f32, aim: vec2<f32>, inclusive: bool) -> bool {
    if (w != aim.x) {
        return w > aim.x;
    }
    return aim.y < 0.0 || (inclusive && aim.y == 0.0);
}

fn sum_all(tid: u32, v: f32) -> f32 {
    workgroupBarrier();
    wf[tid] = v;
    workgroupBarrier();
    for (var h = 128u; h > 0u; h = h >> 1u) {
        if (tid < h) {
            wf[tid] = wf[tid] + wf[tid + h];
        }
        workgroupBarrier();
    }
    return workgroupUniformLoad(&wf[0]);
}

// `largest`: the largest value, else the smallest.
fn extreme_f(tid: u32, v: f32, largest: bool) -> f32 {
    workgroupBarrier();
    wf[tid] = v;
    workgroupBarrier();
    for (var h = 128u; h > 0u; h = h >> 1u) {
        if (tid < h) {
            let o = wf[tid + h];
            wf[tid] = select(min(wf[tid], o), max(wf[tid], o), largest);
        }
        workgroupBarrier();
    }
    return workgroupUniformLoad(&wf[0]);
}

fn extreme_u(tid: u32, v: u32, largest: bool) -> u32 {
    workgroupBarrier();
    wu[tid] = v;
    workgroupBarrier();
    for (var h = 128u; h > 0u; h = h >> 1u) {
        if (tid < h) {
            let o = wu[tid + h];
            wu[tid] = select(min(wu[tid], o), max(wu[tid], o), largest);
        }
        workgroupBarrier();
    }
    return workgroupUniformLoad(&wu[0]);
}

// The lowest id holding `value`, among the threads' candidates (NONE: no candidate).
fn first_holding(tid: u32, v: f32, at: u32, value: f32) -> u32 {
    return extreme_u(tid, select(NONE, at, at != NONE && v == value), false);
}

fn scan_row(tid: u32, base: u32, n: u32) -> Scan {
    var best = LOWEST;
    var at = NONE;
    var row_max = LOWEST;
    var lowest = NONE;
    var highest = 0u;
    for (var i = tid; i < p.cols; i = i + 256u) {
        let v = logits[base + i];
        row_max = max(row_max, v);
        if (i < n) {
            // Ids rise along a thread's walk: its first maximum is kept (as `sample::argmax`).
            if (at == NONE || v > best) {
                best = v;
                at = i;
            }
            lowest = min(lowest, key_of(v));
            highest = max(highest, key_of(v));
        }
    }
    let top = extreme_f(tid, select(LOWEST, best, at != NONE), true);
    // None holds it when every allowed logit is -inf: the host's argmax is then id 0.
    let first = first_holding(tid, best, at, top);
    return Scan(
        select(first, 0u, first == NONE),
        extreme_f(tid, row_max, true),
        extreme_u(tid, lowest, false),
        extreme_u(tid, highest, true),
    );
}

// The count (`mass` false) or weight of the set's elements with a key at least `lo + (j << sh)`
// for j = 0..=steps (entry j; steps < 8), in one pass: each element adds to the bucket of the last
// threshold it reaches, and the buckets' suffix sums are the answers.
fn above_steps(tid: u32, c: Ctx, s: Set, lo: u32, sh: u32, steps: u32, mass: bool) -> array<f32, 8> {
    var acc: array<f32, 8>;
    for (var i = tid; i < c.n; i = i + 256u) {
        let v = logits[c.base + i];
        let k = key_of(v);
        if (k >= lo && in_set(s, k, i)) {
            let b = min((k - lo) >> sh, steps);
            acc[b] = acc[b] + select(1.0, weight(c, v), mass);
        }
    }
    workgroupBarrier();
    wb[tid] = acc;
    workgroupBarrier();
    for (var h = 128u; h > 0u; h = h >> 1u) {
        if (tid < h) {
            for (var j = 0u; j < 8u; j = j + 1u) {
                wb[tid][j] = wb[tid][j] + wb[tid + h][j];
            }
        }
        workgroupBarrier();
    }
    var w = workgroupUniformLoad(&wb[0]);
    for (var j = 7u; j > 0u; j = j - 1u) {
        w[j - 1u] = w[j - 1u] + w[j];
    }
    return w;
}

// How many of the set's elements of key `key` have an id at most `last`.
fn count_equal(tid: u32, c: Ctx, s: Set, key: u32, last: u32) -> u32 {
    var n = 0u;
    for (var i = tid; i <= min(last, c.n - 1u); i = i + 256u) {
        if (key_of(logits[c.base + i]) == key && in_set(s, key, i)) {
            n = n + 1u;
        }
    }
    return u32(sum_all(tid, f32(n)));
}

// The set's elements of key `key`: their count, first and last id.
fn equal_ids(tid: u32, c: Ctx, s: Set, key: u32) -> vec3<u32> {
    var first = NONE;
    var last = 0u;
    var n = 0u;
    for (var i = tid; i < c.n; i = i + 256u) {
        if (key_of(logits[c.base + i]) == key && in_set(s, key, i)) {
            first = min(first, i);
            last = i;
            n = n + 1u;
        }
    }
    let count = u32(sum_all(tid, f32(n)));
    return vec3<u32>(count, extreme_u(tid, first, false), extreme_u(tid, last, true));
}

// The element of the set's elements of key `key` (whose running weight starts at `w_above`, each
// adding `each`) where it passes `aim`, in id order; the last of them when none does.
fn within_key(tid: u32, c: Ctx, s: Set, key: u32, w_above: f32, each: f32, aim: vec2<f32>, inclusive: bool) -> Set {
    let ids = equal_ids(tid, c, s, key);
    // The rank of the element, by bisection on the running weight.
    var r_lo = 1u;
    var r_hi = max(ids.x, 1u);
    while (r_lo < r_hi) {
        let mid = (r_lo + r_hi) / 2u;
        if (reaches(w_above + f32(mid) * each, aim, inclusive)) {
            r_hi = mid;
        } else {
            r_lo = mid + 1u;
        }
    }
    if (r_lo == 1u) {
        return Set(key, ids.y);
    }
    if (r_lo >= ids.x) {
        return Set(key, ids.z);
    }
    // Its id, by bisection on the count of equal elements up to an id.
    var i_lo = ids.y;
    var i_hi = ids.z;
    while (i_lo < i_hi) {
        let mid = i_lo + (i_hi - i_lo) / 2u;
        if (count_equal(tid, c, s, key, mid) >= r_lo) {
            i_hi = mid;
        } else {
            i_lo = mid + 1u;
        }
    }
    return Set(key, i_lo);
}

// The first element of the set, in sampling order, at which the running count (`mass` false) or
// weight passes `share · scale` (`inclusive`: reaches it; the scale may be TOTAL); the set's last
// element when none does.
fn crossing(tid: u32, c: Ctx, s: Set, kmax: u32, mass: bool, share: f32, scale: f32, inclusive: bool) -> Set {
    // The largest key whose elements and those above pass the goal, and the weight above that
    // key: each pass splits the keys [lo, hi] at up to 7 thresholds, 8 ways.
    var lo = s.key;
    var hi = kmax;
    var w_hi = 0.0;
    var aim = product(share, scale);
    var measured = scale >= 0.0;
    while (lo < hi || !measured) {
        let d = hi - lo;
        let sh = select(0u, firstLeadingBit(d) - 2u, d >= 8u);
        let steps = d >> sh;
        let w = above_steps(tid, c, s, lo, sh, steps, mass);
        if (!measured) {
            aim = product(share, w[0]);
            measured = true;
        }
        var j = steps;
        while (j > 0u && !reaches(w[j], aim, inclusive)) {
            j = j - 1u;
        }
        if (j < steps) {
            hi = lo + ((j + 1u) << sh) - 1u;
            w_hi = w[j + 1u];
        }
        lo = lo + (j << sh);
    }
    let each = select(1.0, weight(c, value_of(lo)), mass);
    return within_key(tid, c, s, lo, w_hi, each, aim, inclusive);
}

// A set after min-p, and its total weight before.
struct Cut {
    kept: Set,
    z: f32,
}

// The set without the elements whose weight is below `min_p` (the largest weight is 1).
fn cut_min_p(tid: u32, c: Ctx, s: Set, min_p: f32) -> Cut {
    var lowest = NONE;
    var z = 0.0;
    for (var i = tid; i < c.n; i = i + 256u) {
        let v = logits[c.base + i];
        let k = key_of(v);
        if (in_set(s, k, i)) {
            let w = weight(c, v);
            z = z + w;
            if (w >= min_p) {
                lowest = min(lowest, k);
            }
        }
    }
    let total = sum_all(tid, z);
    let k = extreme_u(tid, lowest, false);
    if (k > s.key) {
        return Cut(Set(k, NONE), total);
    }
    return Cut(s, total);
}

// A draw with top-k, top-p or min-p: the cut-offs in the host's order, then the draw.
fn draw_sorted(tid: u32, c: Ctx, r: Row, kmin: u32, kmax: u32) -> u32 {
    var s = Set(kmin, NONE);
    if (r.top_k > 0u && r.top_k < c.n) {
        s = crossing(tid, c, s, kmax, false, f32(r.top_k - 1u), 1.0, false);
    }
    // Top-p's shares are of the top-k candidates' weight, before min-p.
    var z = TOTAL;
    if (r.min_p > 0.0) {
        let cut = cut_min_p(tid, c, s, r.min_p);
        s = cut.kept;
        z = cut.z;
    }
    if (r.top_p < 1.0) {
        s = crossing(tid, c, s, kmax, true, r.top_p, z, true);
    }
    return crossing(tid, c, s, kmax, true, r.u, TOTAL, false).id;
}

// Position `q` of the walk without cut-offs: ids in order, `best` and 0 swapped.
fn walk_id(q: u32, best: u32) -> u32 {
    if (q == 0u) {
        return best;
    }
    return select(q, 0u, q == best);
}

// A draw without cut-offs: each thread sums a contiguous chunk of the walk, a prefix sum over the
// chunks finds the one the draw falls in, and its thread walks it.
fn draw_plain(tid: u32, c: Ctx, best: u32, u: f32) -> u32 {
    let chunk = (c.n + 255u) / 256u;
    let first = min(tid * chunk, c.n);
    let end = min(first + chunk, c.n);
    var part = 0.0;
    for (var q = first; q < end; q = q + 1u) {
        part = part + weight(c, logits[c.base + walk_id(q, best)]);
    }
    // Inclusive prefix sums of the chunks (Hillis-Steele).
    workgroupBarrier();
    wf[tid] = part;
    workgroupBarrier();
    for (var h = 1u; h < 256u; h = h << 1u) {
        var v = wf[tid];
        if (tid >= h) {
            v = v + wf[tid - h];
        }
        workgroupBarrier();
        wf[tid] = v;
        workgroupBarrier();
    }
    let total = workgroupUniformLoad(&wf[255]);
    let before = select(0.0, wf[max(tid, 1u) - 1u], tid > 0u);
    let d = u * total - before;
    // The first chunk that the draw does not pass; none: the walk's last position.
    let hit = end > first && d < part;
    let owner = extreme_u(tid, select(NONE, tid, hit), false);
    if (owner == NONE) {
        return walk_id(c.n - 1u, best);
    }
    if (tid == owner) {
        var acc = 0.0;
        var at = end - 1u;
        for (var q = first; q < end; q = q + 1u) {
            acc = acc + weight(c, logits[c.base + walk_id(q, best)]);
            if (d < acc) {
                at = q;
                break;
            }
        }
        picked = walk_id(at, best);
    }
    return workgroupUniformLoad(&picked);
}

// log Σ exp over the whole row (padding past the allowed ids included, as on the host).
fn log_normaliser(tid: u32, base: u32, row_max: f32) -> f32 {
    var z = 0.0;
    for (var i = tid; i < p.cols; i = i + 256u) {
        z = z + exp(logits[base + i] - row_max);
    }
    return log(sum_all(tid, z)) + row_max;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = group_index(wid, nwg);
    // Every thread of the workgroup returns together, so the barriers stay uniform.
    if (row >= p.rows) {
        return;
    }
    let tid = lid.x;
    let r = rows[row];
    let base = row * p.cols;
    let n = clamp(r.allowed, 1u, p.cols);
    let scan = scan_row(tid, base, n);
    let c = Ctx(base, n, logits[base + scan.best], r.temperature);
    var token = scan.best;
    if (r.mode == 1u) {
        token = draw_plain(tid, c, scan.best, r.u);
    } else if (r.mode == 2u) {
        token = draw_sorted(tid, c, r, scan.kmin, scan.kmax);
    }
    // Never an id past the allowed ones, whatever the arithmetic did (NaN logits included).
    token = select(token, scan.best, token >= n);
    let lz = log_normaliser(tid, base, scan.row_max);
    if (tid == 0u) {
        out[row * 2u] = f32(token);
        out[row * 2u + 1u] = logits[base + token] - lz;
    }
}
