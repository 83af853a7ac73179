// kernels.cu run on the CPU (cuda_on_cpu.h) against plain C++ references, so kernels can be
// checked on machines without a GPU: the Rust test `kernels_match_references_on_the_cpu` builds
// and runs this. Prints one line per check; exits 1 if any failed.

#include "cuda_on_cpu.h"

#include "../kernels.cu"

#include <cstdio>
#include <functional>

namespace {

int failures = 0;

struct Rng {
    unsigned long long s;
    float next() {  // uniform in [-1, 1)
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return (float)((s >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
    }
    std::vector<float> many(size_t n) {
        std::vector<float> v(n);
        for (auto& x : v) x = next();
        return v;
    }
};

void check(const char* what, const std::vector<float>& got, const std::vector<float>& want, float tol) {
    float worst = 0.0f;
    bool finite = got.size() == want.size();
    for (size_t i = 0; finite && i < got.size(); i++) {
        finite = std::isfinite(got[i]);
        worst = std::fmax(worst, std::fabs(got[i] - want[i]));
    }
    bool ok = finite && worst <= tol;
    std::printf("%s %s: largest difference %.3g (bound %.3g)\n", ok ? "ok  " : "FAIL", what, worst, tol);
    failures += !ok;
}

unsigned short bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// A paged KV cache of `kv_heads` heads of d values and its block tables: row r's keys (n[r] of
// them) sit in shuffled blocks of `block_size` slots.
struct Paged {
    unsigned int heads, kv_heads, d, block_size;
    std::vector<unsigned int> n, meta, tables;
    std::vector<float> q, kc, vc;

    Paged(unsigned int heads_, unsigned int kv_heads_, unsigned int d_, unsigned int block_size_,
          std::vector<unsigned int> n_, Rng& rng)
        : heads(heads_), kv_heads(kv_heads_), d(d_), block_size(block_size_), n(n_) {
        unsigned int blocks = 0;
        for (unsigned int keys : n) blocks += (keys + block_size - 1) / block_size;
        std::vector<unsigned int> order(blocks);
        for (unsigned int b = 0; b < blocks; b++) order[b] = (b * 7 + 3) % blocks;  // 7 is prime to the counts used
        unsigned int next = 0;
        for (unsigned int keys : n) {
            meta.push_back((unsigned int)tables.size());
            meta.push_back(keys);
            for (unsigned int b = 0; b < (keys + block_size - 1) / block_size; b++) tables.push_back(order[next++]);
        }
        q = rng.many(n.size() * heads * d);
        kc = rng.many(blocks * block_size * kv_heads * d);
        vc = rng.many(kc.size());
    }

    std::vector<float> reference(float scale) const {
        std::vector<float> out(q.size());
        for (unsigned int r = 0; r < n.size(); r++)
            for (unsigned int h = 0; h < heads; h++) {
                unsigned int kvh = h / (heads / kv_heads);
                std::vector<double> s(n[r]);
                double mx = -1e30, sum = 0.0;
                auto slot = [&](unsigned int j) {
                    return (size_t)tables[meta[2 * r] + j / block_size] * block_size + j % block_size;
                };
                for (unsigned int j = 0; j < n[r]; j++) {
                    double dot = 0.0;
                    for (unsigned int c = 0; c < d; c++)
                        dot += (double)q[(r * heads + h) * d + c] * kc[(slot(j) * kv_heads + kvh) * d + c];
                    s[j] = dot * scale;
                    mx = std::max(mx, s[j]);
                }
                for (auto& v : s) sum += (v = std::exp(v - mx));
                for (unsigned int c = 0; c < d; c++) {
                    double o = 0.0;
                    for (unsigned int j = 0; j < n[r]; j++) o += s[j] * vc[(slot(j) * kv_heads + kvh) * d + c];
                    out[(r * heads + h) * d + c] = (float)(o / sum);
                }
            }
        return out;
    }
};

void attention_checks() {
    Rng rng{1};
    // Heads of 40 values (not a multiple of 32) and of 128, grouped 2 and 4 query heads to a
    // key head; rows of 1 key, of fewer keys than parts, and of several blocks.
    struct Case {
        unsigned int heads, kv_heads, d, block_size;
        std::vector<unsigned int> n;
    };
    for (const Case& c : {Case{4, 2, 40, 4, {1, 2, 37}}, Case{4, 1, 128, 16, {70, 5}}}) {
        Paged p(c.heads, c.kv_heads, c.d, c.block_size, c.n, rng);
        float scale = 1.0f / std::sqrt((float)c.d);
        auto want = p.reference(scale);
        unsigned int rows = (unsigned int)c.n.size();
        std::vector<float> out(want.size(), NAN);
        emu::launch({rows, c.heads, 1}, {32 * ATTN_WARPS, 1, 1}, [&] {
            paged_attention(p.q.data(), p.kc.data(), p.vc.data(), p.meta.data(), p.tables.data(), out.data(), c.heads,
                            c.kv_heads, c.d, c.block_size, scale);
        });
        char name[128];
        std::snprintf(name, sizeof name, "paged_attention, heads of %u", c.d);
        check(name, out, want, 1e-5f);
        for (unsigned int parts : {1u, 3u, 8u}) {
            std::vector<float> part_out(rows * c.heads * parts * c.d, NAN), stats(2 * rows * c.heads * parts, NAN);
            emu::launch({rows, c.heads, parts}, {32 * ATTN_WARPS, 1, 1}, [&] {
                paged_attention_split(p.q.data(), p.kc.data(), p.vc.data(), p.meta.data(), p.tables.data(),
                                      part_out.data(), stats.data(), c.heads, c.kv_heads, c.d, c.block_size, scale);
            });
            std::vector<float> merged(want.size(), NAN);
            emu::launch({rows, c.heads, 1}, {64, 1, 1}, [&] {
                paged_attention_merge(part_out.data(), stats.data(), merged.data(), c.heads, c.d, parts);
            });
            std::snprintf(name, sizeof name, "paged_attention_split + merge, heads of %u, %u parts", c.d, parts);
            check(name, merged, want, 1e-5f);
        }
    }
}

// launch.rs's tile_rows_per_warp: the most query rows per warp (up to ATTN_TILE_ROWS) whose
// queries and one tile of keys and values fit in 48 KiB less 64 bytes.
unsigned int rows_per_warp(unsigned int d) {
    for (unsigned int r = ATTN_TILE_ROWS; r > 0; r--)
        if (4 * (ATTN_TILE_WARPS * r * d + ATTN_TILE_KEYS * (2 * d + 1)) <= (48 << 10) - 64) return r;
    return 0;
}

// A prefill of one sequence through paged_attention_tiled: row r sees keys 0..=r, every row the
// same block table, in tiles of ATTN_TILE_WARPS · rows_per_warp rows (launch.rs: causal_tiles).
void tiled_prefill_checks() {
    Rng rng{3};
    for (unsigned int d : {40u, 128u}) {
        unsigned int len = 70, heads = 4, kv_heads = 2;
        Paged p(heads, kv_heads, d, 16, {len}, rng);
        p.n.clear();
        p.meta.clear();
        for (unsigned int r = 0; r < len; r++) {
            p.n.push_back(r + 1);
            p.meta.push_back(0);
            p.meta.push_back(r + 1);
        }
        p.q = rng.many(len * heads * d);
        float scale = 1.0f / std::sqrt((float)d);
        auto want = p.reference(scale);
        unsigned int per_warp = rows_per_warp(d), block_rows = ATTN_TILE_WARPS * per_warp;
        std::vector<unsigned int> tiles;
        for (unsigned int at = 0; at < len; at += block_rows) {
            tiles.push_back(at);
            tiles.push_back(std::min(block_rows, len - at));
        }
        std::vector<float> out(want.size(), NAN);
        emu::launch({(unsigned int)tiles.size() / 2, heads, 1}, {32 * ATTN_TILE_WARPS, 1, 1}, [&] {
            paged_attention_tiled(p.q.data(), p.kc.data(), p.vc.data(), p.meta.data(), p.tables.data(), tiles.data(),
                                  out.data(), heads, kv_heads, d, p.block_size, scale, per_warp);
        });
        char name[128];
        std::snprintf(name, sizeof name, "paged_attention_tiled, %u rows of heads of %u, %u rows a warp", len, d,
                      per_warp);
        check(name, out, want, 1e-5f);
    }
}

// Bidirectional attention within segments (the vision tower's images and windows) through
// segment_attention_tiled (the row kernel, which the H200 ran, would take many more blocks here).
void segment_checks() {
    Rng rng{4};
    for (unsigned int d : {64u, 80u}) {
        unsigned int heads = 3, cols = heads * d;
        std::vector<std::pair<unsigned int, unsigned int>> segments = {{0, 50}, {50, 1}, {51, 30}};
        unsigned int rows = 81;
        std::vector<unsigned int> seg;
        for (auto [start, len] : segments)
            for (unsigned int i = 0; i < len; i++) {
                seg.push_back(start);
                seg.push_back(len);
            }
        auto q = rng.many(rows * cols), k = rng.many(rows * cols), v = rng.many(rows * cols);
        float scale = 1.0f / std::sqrt((float)d);
        std::vector<float> want(rows * cols);
        for (unsigned int r = 0; r < rows; r++)
            for (unsigned int h = 0; h < heads; h++) {
                unsigned int first = seg[2 * r], n = seg[2 * r + 1];
                std::vector<double> s(n);
                double mx = -1e30, sum = 0.0;
                for (unsigned int j = 0; j < n; j++) {
                    double dot = 0.0;
                    for (unsigned int c = 0; c < d; c++)
                        dot += (double)q[r * cols + h * d + c] * k[(first + j) * cols + h * d + c];
                    mx = std::max(mx, s[j] = dot * scale);
                }
                for (auto& x : s) sum += (x = std::exp(x - mx));
                for (unsigned int c = 0; c < d; c++) {
                    double o = 0.0;
                    for (unsigned int j = 0; j < n; j++) o += s[j] * v[(first + j) * cols + h * d + c];
                    want[r * cols + h * d + c] = (float)(o / sum);
                }
            }
        char name[128];
        unsigned int per_warp = rows_per_warp(d), block_rows = ATTN_TILE_WARPS * per_warp;
        std::vector<float> tiled(want.size(), NAN);
        emu::launch({(rows + block_rows - 1) / block_rows, heads, 1}, {32 * ATTN_TILE_WARPS, 1, 1}, [&] {
            segment_attention_tiled(q.data(), k.data(), v.data(), seg.data(), tiled.data(), rows, heads, d, scale,
                                    per_warp);
        });
        std::snprintf(name, sizeof name, "segment_attention_tiled, heads of %u, %u rows a warp", d, per_warp);
        check(name, tiled, want, 1e-5f);
    }
}

void gemv_checks() {
    Rng rng{2};
    // k a multiple of 8 (16-byte loads; 544: lanes take three loads, some two) and not (one value
    // at a time); 1 and GEMV_MAX_ROWS rows of x; three matrices of rows not a multiple of
    // GEMV_WARPS, one with a bias.
    for (unsigned int k : {64u, 544u, 130u})
        for (unsigned int n : {1u, (unsigned int)GEMV_MAX_ROWS})
            for (bool offset_x : {false, true}) {
                if (offset_x && k != 64) continue;
                std::vector<unsigned int> ms = {33, 8, 17};
                std::vector<float> xs = rng.many(n * k + 4);
                // 16 bytes into a 16-byte aligned buffer, or 4 (x not aligned: the narrow path).
                const float* x = xs.data() + (offset_x ? 1 : 4);
                std::vector<std::vector<unsigned short>> ws;
                std::vector<std::vector<float>> ys, wants;
                std::vector<float> bias = rng.many(ms[1]);
                GemvJobs jobs{};
                unsigned int blocks = 0;
                for (size_t j = 0; j < ms.size(); j++) {
                    unsigned int m = ms[j];
                    std::vector<unsigned short> w(m * k);
                    for (auto& b : w) b = bf16_bits(rng.next());
                    std::vector<float> want(n * m);
                    for (unsigned int r = 0; r < n; r++)
                        for (unsigned int o = 0; o < m; o++) {
                            double s = j == 1 ? bias[o] : 0.0;
                            for (unsigned int c = 0; c < k; c++)
                                s += (double)x[r * k + c] * __uint_as_float((unsigned int)w[o * k + c] << 16);
                            want[r * m + o] = (float)s;
                        }
                    ws.push_back(std::move(w));
                    wants.push_back(std::move(want));
                    ys.emplace_back(n * m, NAN);
                }
                for (size_t j = 0; j < ms.size(); j++) {
                    jobs.job[j] = {ws[j].data(), j == 1 ? bias.data() : nullptr, ys[j].data(), ms[j], blocks};
                    blocks += (ms[j] + GEMV_WARPS - 1) / GEMV_WARPS;
                }
                jobs.count = (unsigned int)ms.size();
                emu::launch({blocks, 1, 1}, {32 * GEMV_WARPS, 1, 1}, [&] { gemv_bf16(x, n, k, jobs); });
                for (size_t j = 0; j < ms.size(); j++) {
                    char name[128];
                    std::snprintf(name, sizeof name, "gemv_bf16, x [%u, %u]%s, matrix %zu of %u rows", n, k,
                                  offset_x ? " not 16-byte aligned" : "", j, ms[j]);
                    check(name, ys[j], wants[j], 1e-4f);
                }
            }
}

// The fused kernels of decode against references, and gemv_bf16_glu against its parts
// (gemv_bf16 of gate and up, then silu_mul): the same value to the bit.
void fused_checks() {
    Rng rng{3};
    {
        unsigned int rows = 3, cols = 300;  // not a multiple of the block's 256 threads
        auto a = rng.many(rows * cols), b = rng.many(rows * cols), w = rng.many(cols);
        std::vector<float> sum(a.size(), NAN), out(a.size(), NAN), want_sum(a.size()), want(a.size());
        for (unsigned int r = 0; r < rows; r++) {
            double ss = 0.0;
            for (unsigned int c = 0; c < cols; c++) {
                want_sum[r * cols + c] = a[r * cols + c] + b[r * cols + c];
                ss += (double)want_sum[r * cols + c] * want_sum[r * cols + c];
            }
            double inv = 1.0 / std::sqrt(ss / cols + 1e-6);
            for (unsigned int c = 0; c < cols; c++) want[r * cols + c] = (float)(want_sum[r * cols + c] * inv * w[c]);
        }
        emu::launch({rows, 1, 1}, {256, 1, 1},
                    [&] { add_rms_norm(a.data(), b.data(), w.data(), sum.data(), out.data(), cols, 1e-6f); });
        check("add_rms_norm: the sum", sum, want_sum, 0.0f);
        check("add_rms_norm: the normed sum", out, want, 1e-5f);
    }
    // Qwen3's heads of 128 (normed, all turning), Qwen3.5's of 256 (normed, the first 64
    // turning), heads of 80 (normed: lanes take two or three values) and of 40 without a norm;
    // 15 heads, so that the last block has idle warps.
    struct Case {
        unsigned int head, d;
        bool norm;
    };
    for (const Case& c : {Case{128, 128, true}, Case{256, 64, true}, Case{80, 80, true}, Case{40, 40, false}}) {
        unsigned int n = 3, heads = 5;
        auto x = rng.many(n * heads * c.head), w = rng.many(c.head), cs = rng.many(n * c.d), sn = rng.many(n * c.d);
        std::vector<float> out(x.size(), NAN), want(x.size());
        for (unsigned int r = 0; r < n; r++)
            for (unsigned int h = 0; h < heads; h++) {
                const float* xh = &x[(r * heads + h) * c.head];
                double ss = 0.0;
                for (unsigned int i = 0; i < c.head; i++) ss += (double)xh[i] * xh[i];
                double inv = 1.0 / std::sqrt(ss / c.head + 1e-6);
                std::vector<double> v(c.head);
                for (unsigned int i = 0; i < c.head; i++) v[i] = c.norm ? xh[i] * inv * w[i] : xh[i];
                for (unsigned int i = 0; i < c.head; i++) {
                    double o = v[i];
                    if (i < c.d) {
                        double rot = i < c.d / 2 ? -v[i + c.d / 2] : v[i - c.d / 2];
                        o = v[i] * cs[r * c.d + i] + rot * sn[r * c.d + i];
                    }
                    want[(r * heads + h) * c.head + i] = (float)o;
                }
            }
        unsigned int items = n * heads, norm = c.norm;
        emu::launch({(items + HEAD_WARPS - 1) / HEAD_WARPS, 1, 1}, {32 * HEAD_WARPS, 1, 1}, [&] {
            norm_rope(x.data(), w.data(), norm, cs.data(), sn.data(), out.data(), n, heads, c.head, c.d, 1e-6f);
        });
        char name[128];
        std::snprintf(name, sizeof name, "norm_rope, heads of %u, %u turning%s", c.head, c.d,
                      c.norm ? ", normed" : "");
        check(name, out, want, 1e-5f);
    }
    for (unsigned int k : {544u, 130u})
        for (unsigned int n : {1u, (unsigned int)GEMV_MAX_ROWS}) {
            unsigned int m = 17;
            std::vector<float> x = rng.many(n * k);
            std::vector<unsigned short> gate(m * k), up(m * k);
            for (auto& b : gate) b = bf16_bits(rng.next());
            for (auto& b : up) b = bf16_bits(rng.next());
            std::vector<float> want(n * m), y(n * m, NAN), g(n * m, NAN), u(n * m, NAN), parts(n * m, NAN);
            for (unsigned int r = 0; r < n; r++)
                for (unsigned int o = 0; o < m; o++) {
                    double sg = 0.0, su = 0.0;
                    for (unsigned int c = 0; c < k; c++) {
                        sg += (double)x[r * k + c] * __uint_as_float((unsigned int)gate[o * k + c] << 16);
                        su += (double)x[r * k + c] * __uint_as_float((unsigned int)up[o * k + c] << 16);
                    }
                    want[r * m + o] = (float)(sg / (1.0 + std::exp(-sg)) * su);
                }
            unsigned int blocks = (m + GEMV_WARPS - 1) / GEMV_WARPS;
            emu::launch({blocks, 1, 1}, {32 * GEMV_WARPS, 1, 1},
                        [&] { gemv_bf16_glu(x.data(), n, k, gate.data(), up.data(), y.data(), m); });
            GemvJobs jobs{};
            jobs.job[0] = {gate.data(), nullptr, g.data(), m, 0};
            jobs.job[1] = {up.data(), nullptr, u.data(), m, blocks};
            jobs.count = 2;
            emu::launch({2 * blocks, 1, 1}, {32 * GEMV_WARPS, 1, 1}, [&] { gemv_bf16(x.data(), n, k, jobs); });
            unsigned int len = n * m;
            emu::launch({1, 1, 1}, {256, 1, 1}, [&] { silu_mul(g.data(), u.data(), parts.data(), len); });
            char name[128];
            std::snprintf(name, sizeof name, "gemv_bf16_glu, x [%u, %u]", n, k);
            check(name, y, want, 1e-4f);
            std::snprintf(name, sizeof name, "gemv_bf16_glu, x [%u, %u], against gemv_bf16 and silu_mul", n, k);
            check(name, y, parts, 0.0f);
        }
}

}  // namespace

int main() {
    attention_checks();
    tiled_prefill_checks();
    segment_checks();
    gemv_checks();
    fused_checks();
    std::printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
