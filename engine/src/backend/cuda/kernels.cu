// The CUDA backend's kernels, compiled by NVRTC once per process (see launch.rs for how each is
// launched). Activations and the KV cache are f32; weights are f32 or bf16 (raw u16 bits).
// Row-major 2-D tensors throughout. No headers: NVRTC compiles this without a CUDA toolkit.

#define WARP 32
#define ATTN_WARPS 4
#define MAX_LANE_DIMS 8 // head_dim ≤ 256 = 32 lanes × 8
#define ATTN_TILE_WARPS 8
#define ATTN_TILE_ROWS 4 // query rows per warp, at most
#define ATTN_TILE_KEYS 32 // keys per shared-memory tile: one per lane
#define NEG_INF (__int_as_float(0xff800000))
#define GEMV_WARPS 8 // weight rows per gemv_bf16 block: one a warp
#define GEMV_MAX_ROWS 4 // rows of x a gemv_bf16 launch takes, at most
#define GEMV_JOBS 4 // weight matrices a gemv_bf16 launch takes, at most
#define HEAD_WARPS 8 // heads per norm_rope block: one a warp
// The block's dynamic shared memory (emulate/cuda_on_cpu.h defines it for the CPU tests).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// Round to nearest even, as torch and half::bf16::from_f32 do (NaN stays NaN).
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float part[WARP];
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = lane < (int)(blockDim.x / WARP) ? part[lane] : 0.0f;
    return warp_sum(t);
}

extern "C" __global__ void to_bf16(const float* x, unsigned short* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void bf16_to_f32s(const unsigned short* x, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = bf16_to_f32(x[i]);
}

// y[r, c] += b[c]
extern "C" __global__ void add_bias(float* y, const float* b, unsigned int rows, unsigned int cols) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) y[i] += b[i % cols];
}

// One weight matrix of a gemv_bf16 launch: y [n, m] = x · wᵀ (+ b), w [m, k] bf16 (raw bits), b
// null or [m]; its rows are those of blocks first_block on (GEMV_WARPS a block). As launch.rs's
// GemvJob.
struct GemvJob {
    const unsigned short* w;
    const float* b;
    float* y;
    unsigned int m;
    unsigned int first_block;
};
struct GemvJobs {
    GemvJob job[GEMV_JOBS];
    unsigned int count;
};

// Adds row `w` of J bf16 weight matrices times each of the n rows of x [n, k] into this lane's
// acc[j][r]: the warp's lanes stride k eight values (16 bytes of weights) at a time where `wide`
// (k a multiple of 8, the rows 16-byte aligned), one value at a time otherwise; f32 x times bf16 w,
// summed in f32. The J rows are read in the same loop, so that their loads are in flight together.
template <int J>
__device__ __forceinline__ void gemv_dots(const float* x, unsigned int n, unsigned int k,
                                          const unsigned short* const (&w)[J], bool wide, unsigned int lane,
                                          float (&acc)[J][GEMV_MAX_ROWS]) {
    if (wide) {
#pragma unroll 4
        for (unsigned int i = lane; i < k / 8; i += WARP) {
            uint4 p[J];
#pragma unroll
            for (int j = 0; j < J; j++) p[j] = __ldg((const uint4*)w[j] + i); // read-only: the non-coherent cache
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; r++) {
                if (r >= (int)n) break;
                const float4* xr = (const float4*)(x + (unsigned long long)r * k) + 2 * i;
                float4 a = xr[0], b = xr[1];
#pragma unroll
                for (int j = 0; j < J; j++)
                    acc[j][r] += __uint_as_float(p[j].x << 16) * a.x + __uint_as_float(p[j].x & 0xffff0000u) * a.y +
                                 __uint_as_float(p[j].y << 16) * a.z + __uint_as_float(p[j].y & 0xffff0000u) * a.w +
                                 __uint_as_float(p[j].z << 16) * b.x + __uint_as_float(p[j].z & 0xffff0000u) * b.y +
                                 __uint_as_float(p[j].w << 16) * b.z + __uint_as_float(p[j].w & 0xffff0000u) * b.w;
            }
        }
    } else {
        for (unsigned int c = lane; c < k; c += WARP) {
#pragma unroll
            for (int j = 0; j < J; j++) {
                float wc = bf16_to_f32(w[j][c]);
#pragma unroll
                for (int r = 0; r < GEMV_MAX_ROWS; r++) {
                    if (r >= (int)n) break;
                    acc[j][r] += wc * x[(unsigned long long)r * k + c];
                }
            }
        }
    }
}

// Whether gemv_dots may take x and the weight rows 16 bytes at a time.
__device__ __forceinline__ bool gemv_wide(const float* x, unsigned int k, const void* w) {
    return k % 8 == 0 && (unsigned long long)w % 16 == 0 && (unsigned long long)x % 16 == 0;
}

// Products of few rows of x [n, k] (n ≤ GEMV_MAX_ROWS: decode) with up to GEMV_JOBS bf16 weight
// matrices in one launch (a layer's q/k/v or gate/up), without cuBLAS's per-call cost or a bf16
// copy of x: one warp per weight row (gemv_dots).
extern "C" __global__ void gemv_bf16(const float* x, unsigned int n, unsigned int k, GemvJobs jobs) {
    unsigned int lane = threadIdx.x % WARP;
    // Constant indices only, so that the jobs are read from the parameters, not copied to local memory.
    GemvJob job = jobs.job[0];
#pragma unroll
    for (unsigned int j = 1; j < GEMV_JOBS; j++)
        if (j < jobs.count && blockIdx.x >= jobs.job[j].first_block) job = jobs.job[j];
    unsigned int row = (blockIdx.x - job.first_block) * GEMV_WARPS + threadIdx.x / WARP;
    if (row >= job.m) return;
    const unsigned short* const w[1] = {job.w + (unsigned long long)row * k};
    float acc[1][GEMV_MAX_ROWS] = {};
    gemv_dots<1>(x, n, k, w, gemv_wide(x, k, job.w), lane, acc);
    float bias = job.b ? job.b[row] : 0.0f;
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r >= (int)n) break;
        float s = warp_sum(acc[0][r]);
        if (lane == 0) job.y[(unsigned long long)r * job.m + row] = s + bias;
    }
}

// SwiGLU's products of few rows of x [n, k]: y [n, m] = silu(x · gateᵀ) ⊙ (x · upᵀ), gate and up
// [m, k] bf16; one warp per row of both (the sums and the product as gemv_bf16 and silu_mul give
// them), so that neither product is written out.
extern "C" __global__ void gemv_bf16_glu(const float* x, unsigned int n, unsigned int k, const unsigned short* gate,
                                         const unsigned short* up, float* y, unsigned int m) {
    unsigned int lane = threadIdx.x % WARP, row = blockIdx.x * GEMV_WARPS + threadIdx.x / WARP;
    if (row >= m) return;
    const unsigned short* const w[2] = {gate + (unsigned long long)row * k, up + (unsigned long long)row * k};
    float acc[2][GEMV_MAX_ROWS] = {};
    gemv_dots<2>(x, n, k, w, gemv_wide(x, k, gate) && (unsigned long long)up % 16 == 0, lane, acc);
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r >= (int)n) break;
        float g = warp_sum(acc[0][r]), u = warp_sum(acc[1][r]);
        if (lane == 0) y[(unsigned long long)r * m + row] = g / (1.0f + expf(-g)) * u;
    }
}

// Holds the stream for about `cycles` clock cycles, one thread spinning: KVLENS_CUDA_PROFILE's
// gate at the start of a step, so that the step's kernels queue up behind it and then run back to
// back, each between its two timing events.
extern "C" __global__ void hold(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

extern "C" __global__ void embedding_f32(const float* table, const unsigned int* ids, float* out,
                                         unsigned int n, unsigned int dim) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * dim) out[i] = table[(unsigned long long)ids[i / dim] * dim + i % dim];
}

extern "C" __global__ void embedding_bf16(const unsigned short* table, const unsigned int* ids, float* out,
                                          unsigned int n, unsigned int dim) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * dim) out[i] = bf16_to_f32(table[(unsigned long long)ids[i / dim] * dim + i % dim]);
}

// out = row · w / √(mean(row²) + eps), given the row's sum of squares on this thread.
__device__ __forceinline__ void rms_scale(const float* row, const float* w, float* out, unsigned int cols, float squares,
                                          float eps) {
    float inv = rsqrtf(block_sum(squares) / cols + eps);
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = row[c] * inv * w[c];
}

// One block per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, unsigned int cols, float eps) {
    unsigned long long at = (unsigned long long)blockIdx.x * cols;
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x) s += x[at + c] * x[at + c];
    rms_scale(x + at, w, out + at, cols, s, eps);
}

// sum = a + b, out = rms_norm(sum): a residual add and the next norm in one pass. One block per row.
extern "C" __global__ void add_rms_norm(const float* a, const float* b, const float* w, float* sum, float* out,
                                        unsigned int cols, float eps) {
    unsigned long long at = (unsigned long long)blockIdx.x * cols;
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = a[at + c] + b[at + c];
        sum[at + c] = v; // read back below by this same thread
        s += v * v;
    }
    rms_scale(sum + at, w, out + at, cols, s, eps);
}

// One block per row; two passes (mean, then variance of the centred values) as the CPU does.
extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float* out,
                                      unsigned int cols, float eps) {
    const float* row = x + (unsigned long long)blockIdx.x * cols;
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x) s += row[c];
    float mean = block_sum(s) / cols;
    float v = 0.0f;
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x) v += (row[c] - mean) * (row[c] - mean);
    float inv = rsqrtf(block_sum(v) / cols + eps);
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(unsigned long long)blockIdx.x * cols + c] = (row[c] - mean) * inv * w[c] + b[c];
}

// kind: 0 silu, 1 gelu (tanh), 2 gelu (erf), 3 quick gelu; the numbering of launch.rs's Activation map.
extern "C" __global__ void activate(const float* x, float* out, unsigned int n, unsigned int kind) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i], r;
    if (kind == 0) {
        r = v / (1.0f + expf(-v));
    } else if (kind == 1) {
        r = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    } else if (kind == 2) {
        r = 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    } else {
        r = v / (1.0f + expf(-1.702f * v));
    }
    out[i] = r;
}

extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

extern "C" __global__ void add(const float* a, const float* b, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

extern "C" __global__ void sigmoid_mul(const float* g, const float* x, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] / (1.0f + expf(-g[i]));
}

// Rotate-half rotary embedding: x [n, cols] in heads of `head`, cos/sin [n, d]; the first d values
// of each head rotate (d = head but for Qwen3.5's partial rotary), the rest pass unchanged.
extern "C" __global__ void rope(const float* x, const float* cos_t, const float* sin_t, float* out,
                                unsigned int n, unsigned int cols, unsigned int d, unsigned int head) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * cols) return;
    unsigned int r = i / cols, c = i % cols, j = c % head, half = d / 2;
    if (j >= d) {
        out[i] = x[i];
        return;
    }
    float rot = j < half ? -x[i + half] : x[i - half];
    out[i] = x[i] * cos_t[r * d + j] + rot * sin_t[r * d + j];
}

// Per head of `head` values in x [n, heads·head]: RMSNorm by w [head] where `norm` (Qwen3's q/k
// norm), then the rotary embedding of its first d values as `rope` does it. One warp per head
// (HEAD_WARPS a block), the head staged in shared memory for the rotation's other half; head ≤
// WARP · MAX_LANE_DIMS.
extern "C" __global__ void norm_rope(const float* x, const float* w, unsigned int norm, const float* cos_t,
                                     const float* sin_t, float* out, unsigned int n, unsigned int heads,
                                     unsigned int head, unsigned int d, float eps) {
    __shared__ float staged[HEAD_WARPS][WARP * MAX_LANE_DIMS];
    unsigned int lane = threadIdx.x % WARP, item = blockIdx.x * HEAD_WARPS + threadIdx.x / WARP;
    if (item >= n * heads) return;
    unsigned int r = item / heads, half = d / 2;
    const float* xh = x + (unsigned long long)item * head;
    float* v = staged[threadIdx.x / WARP];
    float s = 0.0f;
    for (unsigned int c = lane; c < head; c += WARP) s += xh[c] * xh[c];
    float inv = norm ? rsqrtf(warp_sum(s) / head + eps) : 1.0f;
    for (unsigned int c = lane; c < head; c += WARP) v[c] = norm ? xh[c] * inv * w[c] : xh[c];
    __syncwarp();
    for (unsigned int c = lane; c < head; c += WARP) {
        float o = v[c];
        if (c < d) {
            float rot = c < half ? -v[c + half] : v[c - half];
            o = o * cos_t[r * d + c] + rot * sin_t[r * d + c];
        }
        out[(unsigned long long)item * head + c] = o;
    }
}

// Qwen3.5's Gated DeltaNet, recurrent form (as backend/cpu/delta_net.rs). `seqs` holds per
// sequence: first row, rows, slot, fresh. geo: conv_dim, conv_len, heads, key_heads, key_dim,
// value_dim. delta_conv: one thread per sequence and channel, over the rows in order.
extern "C" __global__ void delta_conv(const float* x, const float* w, float* window, float* out,
                                      const unsigned int* seqs, unsigned int n_seqs, unsigned int conv_dim,
                                      unsigned int conv_len) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_seqs * conv_dim) return;
    unsigned int s = i / conv_dim, c = i % conv_dim;
    unsigned int start = seqs[4 * s], rows = seqs[4 * s + 1];
    float* win = window + (size_t)seqs[4 * s + 2] * conv_len * conv_dim;
    unsigned int width = conv_len + 1;
    if (seqs[4 * s + 3]) {
        for (unsigned int j = 0; j < conv_len; j++) win[j * conv_dim + c] = 0.0f;
    }
    for (unsigned int t = start; t < start + rows; t++) {
        float v = x[(size_t)t * conv_dim + c];
        float acc = w[c * width + conv_len] * v;
        for (unsigned int j = 0; j < conv_len; j++) acc += w[c * width + j] * win[j * conv_dim + c];
        out[(size_t)t * conv_dim + c] = acc / (1.0f + expf(-acc));
        for (unsigned int j = 0; j + 1 < conv_len; j++) win[j * conv_dim + c] = win[(j + 1) * conv_dim + c];
        if (conv_len > 0) win[(conv_len - 1) * conv_dim + c] = v;
    }
}

#define DELTA_MAX_KEY_DIM 256
// delta_rule: one block per sequence (grid x) and value head (grid y), threads over value columns.
extern "C" __global__ void delta_rule(const float* y, const float* a, const float* b, const float* a_log,
                                      const float* dt_bias, float* state, float* out, const unsigned int* seqs,
                                      unsigned int conv_dim, unsigned int heads, unsigned int key_heads,
                                      unsigned int dk, unsigned int dv) {
    __shared__ float qs[DELTA_MAX_KEY_DIM];
    __shared__ float ks[DELTA_MAX_KEY_DIM];
    unsigned int s = blockIdx.x, h = blockIdx.y;
    unsigned int start = seqs[4 * s], rows = seqs[4 * s + 1];
    float* st = state + ((size_t)seqs[4 * s + 2] * heads + h) * dk * dv;
    unsigned int kh = h / (heads / key_heads), key_width = key_heads * dk;
    if (seqs[4 * s + 3]) {
        for (unsigned int e = threadIdx.x; e < dk * dv; e += blockDim.x) st[e] = 0.0f;
    }
    float rate = expf(a_log[h]), scale = rsqrtf((float)dk);
    for (unsigned int t = start; t < start + rows; t++) {
        __syncthreads();
        const float* row = y + (size_t)t * conv_dim;
        for (unsigned int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = row[kh * dk + i];
            ks[i] = row[key_width + kh * dk + i];
        }
        __syncthreads();
        float qq = 0.0f, kk = 0.0f;
        for (unsigned int i = 0; i < dk; i++) {
            qq += qs[i] * qs[i];
            kk += ks[i] * ks[i];
        }
        float qn = scale / sqrtf(qq + 1e-6f), kn = 1.0f / sqrtf(kk + 1e-6f);
        float z = a[(size_t)t * heads + h] + dt_bias[h];
        float decay = expf(-rate * (z > 20.0f ? z : log1pf(expf(z))));
        float beta = 1.0f / (1.0f + expf(-b[(size_t)t * heads + h]));
        for (unsigned int j = threadIdx.x; j < dv; j += blockDim.x) {
            float mem = 0.0f;
            for (unsigned int i = 0; i < dk; i++) {
                float v = st[i * dv + j] * decay;
                st[i * dv + j] = v;
                mem += v * ks[i] * kn;
            }
            float d = (row[2 * key_width + h * dv + j] - mem) * beta;
            float o = 0.0f;
            for (unsigned int i = 0; i < dk; i++) {
                float v = st[i * dv + j] + ks[i] * kn * d;
                st[i * dv + j] = v;
                o += v * qs[i] * qn;
            }
            out[(size_t)t * heads * dv + h * dv + j] = o;
        }
    }
}

extern "C" __global__ void narrow_cols(const float* x, float* out, unsigned int rows, unsigned int cols,
                                       unsigned int start, unsigned int len) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * len) out[i] = x[(unsigned long long)(i / len) * cols + start + i % len];
}

extern "C" __global__ void gather_rows(const float* x, const unsigned int* idx, float* out, unsigned int n,
                                       unsigned int cols) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * cols) out[i] = x[(unsigned long long)idx[i / cols] * cols + i % cols];
}

// out = x [n / cols, cols] with each row multiplied by its scale.
extern "C" __global__ void scale_rows(const float* x, const float* scales, float* out, unsigned int n,
                                      unsigned int cols) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * scales[i / cols];
}

// out already holds x; rows idx[i] get row i of src (added when add != 0). Indices are distinct
// or, when repeated, written by one launch in an unspecified order (as the CPU's last-wins for
// copies; additions of repeated indices are not used by the model).
extern "C" __global__ void scatter_rows(float* out, const unsigned int* idx, const float* src, unsigned int n,
                                        unsigned int cols, unsigned int add) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * cols) return;
    unsigned long long dst = (unsigned long long)idx[i / cols] * cols + i % cols;
    out[dst] = add ? out[dst] + src[i] : src[i];
}

// K and V rows into their slots: cache [slots, width] per layer.
extern "C" __global__ void write_kv(float* kc, float* vc, const float* k, const float* v, const unsigned int* slots,
                                    unsigned int n, unsigned int width) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * width) return;
    unsigned long long dst = (unsigned long long)slots[i / width] * width + i % width;
    kc[dst] = k[i];
    vc[dst] = v[i];
}

// One query row and head: ATTN_WARPS warps split the keys (key j goes to warp j % ATTN_WARPS), each
// with its own online softmax over its keys; lanes split the head's d values. The warps' partial
// results are merged through shared memory. `key_row(j)` is the row of key j in keys/values.
// Where `stats` is not null it receives the largest score and the sum of exp(score − largest),
// which `paged_attention_merge` needs; no keys give NEG_INF, 0 and an output of zeros.
template <class KeyRow>
__device__ void attend(const float* q, const float* keys, const float* values, unsigned int stride,
                       unsigned int n_keys, KeyRow key_row, float scale, unsigned int d, float* out,
                       float* stats = nullptr) {
    __shared__ float s_max[ATTN_WARPS], s_sum[ATTN_WARPS];
    __shared__ float s_acc[ATTN_WARPS][WARP * MAX_LANE_DIMS];
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float qv[MAX_LANE_DIMS], acc[MAX_LANE_DIMS];
    for (int e = 0; e < MAX_LANE_DIMS; e++) {
        unsigned int c = lane + e * WARP;
        qv[e] = c < d ? q[c] * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (unsigned int j = warp; j < n_keys; j += ATTN_WARPS) {
        const float* k = keys + (unsigned long long)key_row(j) * stride;
        const float* v = values + (unsigned long long)key_row(j) * stride;
        float s = 0.0f;
        for (int e = 0; e < MAX_LANE_DIMS; e++) {
            unsigned int c = lane + e * WARP;
            if (c < d) s += qv[e] * k[c];
        }
        s = warp_sum(s);
        float m2 = fmaxf(m, s);
        float correction = expf(m - m2), p = expf(s - m2);
        l = l * correction + p;
        for (int e = 0; e < MAX_LANE_DIMS; e++) {
            unsigned int c = lane + e * WARP;
            if (c < d) acc[e] = acc[e] * correction + p * v[c];
        }
        m = m2;
    }
    if (lane == 0) {
        s_max[warp] = m;
        s_sum[warp] = l;
    }
    for (int e = 0; e < MAX_LANE_DIMS; e++) s_acc[warp][lane + e * WARP] = acc[e];
    __syncthreads();
    if (warp != 0) return;
    float gm = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; w++) gm = fmaxf(gm, s_max[w]);
    float total = 0.0f;
    for (int w = 0; w < ATTN_WARPS; w++) total += s_max[w] == NEG_INF ? 0.0f : s_sum[w] * expf(s_max[w] - gm);
    if (stats && lane == 0) {
        stats[0] = gm;
        stats[1] = total;
    }
    for (int e = 0; e < MAX_LANE_DIMS; e++) {
        unsigned int c = lane + e * WARP;
        if (c >= d) continue;
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (s_max[w] != NEG_INF) o += s_acc[w][lane + e * WARP] * expf(s_max[w] - gm);
        out[c] = total > 0.0f ? o / total : 0.0f;
    }
}

struct SegmentRow {
    unsigned int start;
    __device__ unsigned int operator()(unsigned int j) const { return start + j; }
};

// Bidirectional attention within segments: grid (rows, heads); seg[2r], seg[2r+1] are the start
// and length of row r's segment.
extern "C" __global__ void segment_attention(const float* q, const float* k, const float* v, const unsigned int* seg,
                                             float* out, unsigned int heads, unsigned int d, float scale) {
    unsigned int r = blockIdx.x, h = blockIdx.y, cols = heads * d;
    SegmentRow key_row = {seg[2 * r]};
    attend(q + (unsigned long long)r * cols + h * d, k + h * d, v + h * d, cols, seg[2 * r + 1], key_row, scale, d,
           out + (unsigned long long)r * cols + h * d);
}

// Attention in tiles, for many query rows over the same keys (an image's patches, a prompt's
// tokens): the block holds ATTN_TILE_WARPS warps of `rows_per_warp` (1 to 4) query rows each, n
// rows from r0 on. The keys any of them sees pass through shared memory ATTN_TILE_KEYS at a time
// and serve every row of the block: a key is read from global memory once per block, not once
// per row as in `attend`. Lane j scores key j of the tile; then each lane adds the tile's values
// for its slice of the head (values c = lane + 32e). Online softmax per row, as `attend`.
// Row r (of q and out) is at r · q_cols; it sees keys span.first(r) ≤ j < span.end(r), key j
// being row key_row(j) of keys and values (stride kv_cols). Dynamic shared memory: q [rows][d]
// (scaled), k [ATTN_TILE_KEYS][d + 1] (padded: lanes read different keys), v [ATTN_TILE_KEYS][d];
// launch.rs sizes it (`tile_rows_per_warp`).
template <class Span, class KeyRow>
__device__ void attend_tiled(const float* q, const float* keys, const float* values, unsigned int q_cols,
                             unsigned int kv_cols, unsigned int r0, unsigned int n, Span span, KeyRow key_row,
                             float scale, unsigned int d, unsigned int rows_per_warp, float* out) {
    DYNAMIC_SHARED(float, tile);
    __shared__ unsigned int s_lo, s_hi;
    unsigned int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float* sq = tile;
    float* sk = sq + ATTN_TILE_WARPS * rows_per_warp * d;
    float* sv = sk + ATTN_TILE_KEYS * (d + 1);
    if (threadIdx.x == 0) {
        unsigned int lo = 0xffffffffu, hi = 0;
        for (unsigned int i = 0; i < n; i++) {
            lo = min(lo, span.first(r0 + i));
            hi = max(hi, span.end(r0 + i));
        }
        s_lo = lo;
        s_hi = hi;
    }
    for (unsigned int i = threadIdx.x; i < n * d; i += blockDim.x)
        sq[i] = q[(unsigned long long)(r0 + i / d) * q_cols + i % d] * scale;
    float m[ATTN_TILE_ROWS], l[ATTN_TILE_ROWS], acc[ATTN_TILE_ROWS][MAX_LANE_DIMS];
    unsigned int first[ATTN_TILE_ROWS], end[ATTN_TILE_ROWS];
#pragma unroll
    for (unsigned int i = 0; i < ATTN_TILE_ROWS; i++) {
        unsigned int at = warp * rows_per_warp + i;
        bool mine = i < rows_per_warp && at < n;
        first[i] = mine ? span.first(r0 + at) : 0;
        end[i] = mine ? span.end(r0 + at) : 0;
        m[i] = NEG_INF;
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_LANE_DIMS; e++) acc[i][e] = 0.0f;
    }
    __syncthreads();
    unsigned int lo = s_lo, hi = s_hi;
    for (unsigned int t = lo; t < hi; t += ATTN_TILE_KEYS) {
        __syncthreads(); // every warp is done with the previous tile
        for (unsigned int i = threadIdx.x; i < ATTN_TILE_KEYS * d; i += blockDim.x) {
            unsigned int j = i / d, c = i % d;
            bool in = t + j < hi;
            unsigned long long at = in ? (unsigned long long)key_row(t + j) * kv_cols + c : 0;
            sk[j * (d + 1) + c] = in ? keys[at] : 0.0f;
            sv[i] = in ? values[at] : 0.0f;
        }
        __syncthreads();
        unsigned int key = t + lane;
#pragma unroll
        for (unsigned int i = 0; i < ATTN_TILE_ROWS; i++) {
            bool sees = key >= first[i] && key < end[i];
            if (!__any_sync(0xffffffffu, sees)) continue; // the same for every lane of the warp
            const float* qi = sq + (warp * rows_per_warp + i) * d;
            const float* kj = sk + lane * (d + 1);
            float s = 0.0f;
            for (unsigned int c = 0; c < d; c++) s += qi[c] * kj[c];
            s = sees ? s : NEG_INF;
            float m2 = fmaxf(m[i], warp_max(s));
            float p = sees ? expf(s - m2) : 0.0f;
            float correction = expf(m[i] - m2);
            l[i] = l[i] * correction + warp_sum(p);
#pragma unroll
            for (int e = 0; e < MAX_LANE_DIMS; e++) acc[i][e] *= correction;
            for (unsigned int j = 0; j < ATTN_TILE_KEYS; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
                const float* vj = sv + j * d;
#pragma unroll
                for (int e = 0; e < MAX_LANE_DIMS; e++) {
                    unsigned int c = lane + e * WARP;
                    if (c < d) acc[i][e] += pj * vj[c];
                }
            }
            m[i] = m2;
        }
    }
#pragma unroll
    for (unsigned int i = 0; i < ATTN_TILE_ROWS; i++) {
        unsigned int at = warp * rows_per_warp + i;
        if (i >= rows_per_warp || at >= n) continue;
#pragma unroll
        for (int e = 0; e < MAX_LANE_DIMS; e++) {
            unsigned int c = lane + e * WARP;
            if (c < d) out[(unsigned long long)(r0 + at) * q_cols + c] = acc[i][e] / l[i];
        }
    }
}

// Row r's segment: seg[2r] is its start, seg[2r+1] its length.
struct SegmentSpan {
    const unsigned int* seg;
    __device__ unsigned int first(unsigned int r) const { return seg[2 * r]; }
    __device__ unsigned int end(unsigned int r) const { return seg[2 * r] + seg[2 * r + 1]; }
};

// `segment_attention` in tiles (attend_tiled): grid (row tiles of ATTN_TILE_WARPS · rows_per_warp
// rows, heads).
extern "C" __global__ void segment_attention_tiled(const float* q, const float* k, const float* v,
                                                   const unsigned int* seg, float* out, unsigned int rows,
                                                   unsigned int heads, unsigned int d, float scale,
                                                   unsigned int rows_per_warp) {
    unsigned int block_rows = ATTN_TILE_WARPS * rows_per_warp, r0 = blockIdx.x * block_rows;
    unsigned int h = blockIdx.y, cols = heads * d;
    attend_tiled(q + h * d, k + h * d, v + h * d, cols, cols, r0, min(block_rows, rows - r0), SegmentSpan{seg},
                 SegmentRow{0}, scale, d, rows_per_warp, out + h * d);
}

struct PagedRow {
    const unsigned int* table;
    unsigned int block_size;
    __device__ unsigned int operator()(unsigned int j) const { return table[j / block_size] * block_size + j % block_size; }
};

// Causal attention over the paged cache: grid (rows, heads). meta[2r] is the offset of row r's
// block table in `tables`, meta[2r+1] the number of keys it sees (its position + 1).
extern "C" __global__ void paged_attention(const float* q, const float* kc, const float* vc, const unsigned int* meta,
                                           const unsigned int* tables, float* out, unsigned int heads,
                                           unsigned int kv_heads, unsigned int d, unsigned int block_size,
                                           float scale) {
    unsigned int r = blockIdx.x, h = blockIdx.y, cols = heads * d, kv_width = kv_heads * d;
    unsigned int kvh = h / (heads / kv_heads);
    PagedRow key_row = {tables + meta[2 * r], block_size};
    attend(q + (unsigned long long)r * cols + h * d, kc + kvh * d, vc + kvh * d, kv_width, meta[2 * r + 1], key_row, scale, d,
           out + (unsigned long long)r * cols + h * d);
}

// Key j of a part of a row's keys: key first + j of the row.
template <class KeyRow>
struct KeysFrom {
    KeyRow row;
    unsigned int first;
    __device__ unsigned int operator()(unsigned int j) const { return row(first + j); }
};

// `paged_attention` with each row's keys split into gridDim.z parts (split-K, as flash-decoding
// does), for few rows over many keys, where one block per row and head would leave most of the
// GPU idle and walk the keys one after another: grid (rows, heads, parts). Part z of row r and
// head h attends to its share of the row's keys (a ceil(n / parts) run; the last ones may be
// short or empty) and writes its output, normalised over its own keys, to
// parts[(r · heads + h) · gridDim.z + z] (d values) and its largest score and sum to stats (two
// values at the same index); `paged_attention_merge` combines them.
extern "C" __global__ void paged_attention_split(const float* q, const float* kc, const float* vc,
                                                 const unsigned int* meta, const unsigned int* tables, float* parts,
                                                 float* stats, unsigned int heads, unsigned int kv_heads,
                                                 unsigned int d, unsigned int block_size, float scale) {
    unsigned int r = blockIdx.x, h = blockIdx.y, z = blockIdx.z, cols = heads * d;
    unsigned int kvh = h / (heads / kv_heads), n = meta[2 * r + 1];
    unsigned int chunk = (n + gridDim.z - 1) / gridDim.z, first = min(z * chunk, n);
    KeysFrom<PagedRow> key_row = {{tables + meta[2 * r], block_size}, first};
    unsigned long long part = ((unsigned long long)r * heads + h) * gridDim.z + z;
    attend(q + (unsigned long long)r * cols + h * d, kc + kvh * d, vc + kvh * d, kv_heads * d, min(chunk, n - first),
           key_row, scale, d, parts + part * d, stats + 2 * part);
}

// Combines `paged_attention_split`'s parts: grid (rows, heads), threads over the d values. Each
// part's output weighs its sum rescaled to the largest score of all parts; empty parts weigh
// nothing (every row has at least one key, so some part is not empty).
extern "C" __global__ void paged_attention_merge(const float* parts, const float* stats, float* out,
                                                 unsigned int heads, unsigned int d, unsigned int n_parts) {
    unsigned int r = blockIdx.x, h = blockIdx.y;
    unsigned long long first = ((unsigned long long)r * heads + h) * n_parts;
    const float* st = stats + 2 * first;
    float gm = NEG_INF, total = 0.0f;
    for (unsigned int z = 0; z < n_parts; z++) gm = fmaxf(gm, st[2 * z]);
    for (unsigned int z = 0; z < n_parts; z++)
        if (st[2 * z] != NEG_INF) total += st[2 * z + 1] * expf(st[2 * z] - gm);
    for (unsigned int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = 0.0f;
        for (unsigned int z = 0; z < n_parts; z++)
            if (st[2 * z] != NEG_INF) o += parts[(first + z) * d + c] * st[2 * z + 1] * expf(st[2 * z] - gm);
        out[(unsigned long long)r * heads * d + h * d + c] = o / total;
    }
}

// Row r sees the keys before its position: meta[2r+1] of them (as `paged_attention`).
struct CausalSpan {
    const unsigned int* meta;
    __device__ unsigned int first(unsigned int) const { return 0; }
    __device__ unsigned int end(unsigned int r) const { return meta[2 * r + 1]; }
};

// `paged_attention` in tiles (attend_tiled), for prefill: grid (tiles, heads). tiles[2b] is the
// first row of tile b and tiles[2b+1] its number of rows (at most ATTN_TILE_WARPS · rows_per_warp),
// all of one sequence, so they share its block table (launch.rs: `causal_tiles`).
extern "C" __global__ void paged_attention_tiled(const float* q, const float* kc, const float* vc,
                                                 const unsigned int* meta, const unsigned int* tables,
                                                 const unsigned int* tiles, float* out, unsigned int heads,
                                                 unsigned int kv_heads, unsigned int d, unsigned int block_size,
                                                 float scale, unsigned int rows_per_warp) {
    unsigned int r0 = tiles[2 * blockIdx.x], n = tiles[2 * blockIdx.x + 1];
    unsigned int h = blockIdx.y, kvh = h / (heads / kv_heads);
    PagedRow key_row = {tables + meta[2 * r0], block_size};
    attend_tiled(q + h * d, kc + kvh * d, vc + kvh * d, heads * d, kv_heads * d, r0, n, CausalSpan{meta}, key_row,
                 scale, d, rows_per_warp, out + h * d);
}

// Greedy sampling, one block per row: the first largest of the allowed ids and its log-probability
// under the whole row (as DeviceSampling::pick). out[2r] = id (as f32), out[2r+1] = log-probability.
extern "C" __global__ void greedy(const float* logits, const unsigned int* allowed, float* out, unsigned int width) {
    __shared__ float s_val[1024];
    __shared__ unsigned int s_idx[1024];
    const float* row = logits + (unsigned long long)blockIdx.x * width;
    unsigned int limit = allowed[blockIdx.x];
    float best = NEG_INF, mx = NEG_INF;
    unsigned int bi = 0xffffffffu;
    for (unsigned int c = threadIdx.x; c < width; c += blockDim.x) {
        float v = row[c];
        mx = fmaxf(mx, v);
        if (c < limit && (v > best || bi == 0xffffffffu)) {
            best = v;
            bi = c;
        }
    }
    s_val[threadIdx.x] = best;
    s_idx[threadIdx.x] = bi;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            float ov = s_val[threadIdx.x + o];
            unsigned int oi = s_idx[threadIdx.x + o];
            float mv = s_val[threadIdx.x];
            unsigned int mi = s_idx[threadIdx.x];
            bool take = oi != 0xffffffffu && (mi == 0xffffffffu || ov > mv || (ov == mv && oi < mi));
            if (take) {
                s_val[threadIdx.x] = ov;
                s_idx[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    float token_logit = s_val[0];
    unsigned int token = s_idx[0];
    __syncthreads();
    // The row's maximum, then the sum of exponentials (as log_normaliser: shifted by the maximum).
    s_val[threadIdx.x] = mx;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) s_val[threadIdx.x] = fmaxf(s_val[threadIdx.x], s_val[threadIdx.x + o]);
        __syncthreads();
    }
    mx = s_val[0];
    __syncthreads();
    float z = 0.0f;
    for (unsigned int c = threadIdx.x; c < width; c += blockDim.x) z += expf(row[c] - mx);
    z = block_sum(z);
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x] = (float)token;
        out[2 * blockIdx.x + 1] = token_logit - (logf(z) + mx);
    }
}
