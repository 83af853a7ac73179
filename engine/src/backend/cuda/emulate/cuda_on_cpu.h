// kernels.cu on the CPU, for tests on machines without a GPU: the CUDA names the kernels use,
// defined in plain C++20. A launch runs its blocks one after another; each thread of a block is an
// OS thread, so __syncthreads is a barrier of the block's threads and the warp functions (shuffles,
// votes) exchange values through a barrier of the warp's 32 threads. A thread that returns leaves
// both barriers, as an exited thread does on a GPU since Volta. __shared__ variables are statics,
// which is right because one block runs at a time. Slow (thousands of threads a launch): for small
// shapes only. Not a model of the GPU's memory or timing, only of what the kernels compute.
#pragma once

#include <array>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu::dynamic_shared.data())

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};

namespace emu {
constexpr unsigned int WARP_LANES = 32;

struct BlockState {
    explicit BlockState(unsigned int threads) : block(threads) {
        for (unsigned int w = 0; w < (threads + WARP_LANES - 1) / WARP_LANES; w++) {
            unsigned int lanes = std::min(WARP_LANES, threads - w * WARP_LANES);
            warps.push_back(std::make_unique<std::barrier<>>(lanes));
            exchange.emplace_back();
        }
    }
    std::barrier<> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<std::array<unsigned long long, WARP_LANES>> exchange;
};

inline thread_local BlockState* state = nullptr;
inline thread_local unsigned int lane = 0, warp = 0;
// Dynamic shared memory: 64 KiB, more than any launch of launch.rs asks for.
inline std::array<float, 16384> dynamic_shared;

// Every lane of the warp puts `v` in, waits for the others, takes lane `src`'s, and waits again
// so that the next exchange cannot overwrite it early.
template <class T>
T exchange(T v, unsigned int src) {
    static_assert(sizeof(T) <= sizeof(unsigned long long));
    unsigned long long in = 0, out = 0;
    std::memcpy(&in, &v, sizeof(T));
    auto& slots = state->exchange[warp];
    slots[lane] = in;
    state->warps[warp]->arrive_and_wait();
    out = slots[src % WARP_LANES];
    state->warps[warp]->arrive_and_wait();
    T r;
    std::memcpy(&r, &out, sizeof(T));
    return r;
}

// Whether `p` holds in any lane of the warp.
inline bool any(bool p) {
    auto& slots = state->exchange[warp];
    slots[lane] = p;
    state->warps[warp]->arrive_and_wait();
    bool found = false;
    for (unsigned int l = 0; l < WARP_LANES; l++) found |= slots[l] != 0;
    state->warps[warp]->arrive_and_wait();
    return found;
}
}  // namespace emu

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

inline void __syncthreads() { emu::state->block.arrive_and_wait(); }
inline void __syncwarp(unsigned int = 0xffffffffu) { emu::state->warps[emu::warp]->arrive_and_wait(); }
template <class T>
T __shfl_sync(unsigned int, T v, int src) {
    return emu::exchange(v, (unsigned int)src);
}
template <class T>
T __shfl_xor_sync(unsigned int, T v, int mask) {
    return emu::exchange(v, emu::lane ^ (unsigned int)mask);
}
inline bool __any_sync(unsigned int, bool p) { return emu::any(p); }

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) { return __uint_as_float((unsigned int)i); }
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
template <class T>
T __ldg(const T* p) {
    return *p;
}
inline long long clock64() { return std::chrono::steady_clock::now().time_since_epoch().count(); }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }

namespace emu {
// Runs `kernel` (a callable that calls the kernel with its arguments) over `grid` blocks of
// `block` threads.
template <class F>
void launch(dim3 grid, dim3 block, F kernel) {
    unsigned int threads = block.x * block.y * block.z;
    for (unsigned int bz = 0; bz < grid.z; bz++)
        for (unsigned int by = 0; by < grid.y; by++)
            for (unsigned int bx = 0; bx < grid.x; bx++) {
                BlockState shared(threads);
                std::vector<std::thread> pool;
                for (unsigned int t = 0; t < threads; t++)
                    pool.emplace_back([&, t] {
                        state = &shared;
                        lane = t % WARP_LANES;
                        warp = t / WARP_LANES;
                        threadIdx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
                        blockIdx = {bx, by, bz};
                        blockDim = block;
                        gridDim = grid;
                        kernel();
                        shared.warps[warp]->arrive_and_drop();
                        shared.block.arrive_and_drop();
                    });
                for (auto& th : pool) th.join();
            }
}
}  // namespace emu
