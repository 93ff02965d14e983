// CPU emulator of the CUDA features the IsoQuant kernels use, so their logic runs in CPU tests:
// one std::thread per GPU thread of a block (blocks run one after another), __shared__ arrays
// become function statics, barriers are std::barrier, warp shuffles and mma.sync exchange
// values through per-warp buffers. Correctness only: nothing here says anything about speed.
#pragma once
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __host__
#define __forceinline__ inline
#define __global__
#define __grid_constant__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct emu_uint3 {
  unsigned x, y, z;
};
inline thread_local emu_uint3 threadIdx, blockIdx, gridDim;
inline thread_local int emu_tid;

struct uint4 {
  uint32_t x, y, z, w;
};
struct alignas(8) uint2 {
  uint32_t x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(uint32_t x, uint32_t y) { return {x, y}; }

struct __half {
  uint16_t x;
  __half() = default;
  __half(float v) {
    _Float16 f = (_Float16)v;
    std::memcpy(&x, &f, 2);
  }
  operator float() const {
    _Float16 f;
    std::memcpy(&f, &x, 2);
    return (float)f;
  }
};
struct __half2 {
  __half x, y;
};
struct __nv_bfloat16 {
  uint16_t x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
    x = uint16_t(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

inline float __half2float(__half h) { return float(h); }
inline __half __float2half_rn(float v) { return __half(v); }
inline uint16_t __half_as_ushort(__half h) { return h.x; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline float __low2float(__half2 h) { return float(h.x); }
inline float __high2float(__half2 h) { return float(h.y); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// per 16-bit half: the unsigned maximum
inline uint32_t __vmaxu2(uint32_t a, uint32_t b) {
  const uint32_t lo = std::max(a & 0xFFFFu, b & 0xFFFFu), hi = std::max(a >> 16, b >> 16);
  return lo | (hi << 16);
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float min(float a, float b) { return a < b ? a : b; }
inline float max(float a, float b) { return a > b ? a : b; }

inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t pool = uint64_t(x) | (uint64_t(y) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (s >> (4 * i)) & 0xFu;
    uint32_t byte = uint32_t(pool >> (8 * (n & 7u))) & 0xFFu;
    if (n & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    r |= byte << (8 * i);
  }
  return r;
}

// the CUDA prologue's PTX helpers
inline int __float2int_rn(float x) { return int(std::nearbyint(x)); }  // default: to nearest even
inline uint32_t iq_prmt(uint32_t a, uint32_t b, uint32_t s) { return __byte_perm(a, b, s); }
template <uint32_t M>
inline uint32_t iq_and_or(uint32_t x, uint32_t c) { return (x & M) | c; }
template <uint32_t M>
inline uint32_t iq_bitsel(uint32_t a, uint32_t c) { return (a & M) | (c & ~M); }
inline uint32_t iq_shl4(uint32_t x) { return x << 4; }
// the f16x2 add of -0 returns the high half's bits in both halves; a NaN pattern would not
// come back unchanged on the GPU, so it fails here
inline uint32_t iq_hi16(uint32_t x, uint32_t nz) {
  const uint32_t h = x >> 16;
  if (((h >> 10) & 0x1Fu) == 0x1Fu || nz != 0x80008000u) std::abort();
  return h | (h << 16);
}
inline uint32_t iq_neg_zero2() { return 0x80008000u; }
inline float iq_ex2(float x) {
  const float r = std::exp2(x);
  return r < 1.17549435e-38f ? 0.0f : r;  // ftz
}

struct EmuBlock {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  uint64_t xbuf[32][32];
  uint32_t mbuf[32][32][10];
};
inline EmuBlock* emu_blk = nullptr;

inline void __syncthreads() { emu_blk->block->arrive_and_wait(); }
// Blocks run one after another and only one thread of a block touches a counter at a time.
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p += v;
  return old;
}
inline void __threadfence() {}
template <typename T>
inline T __ldcg(const T* p) { return *p; }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_blk->warps[emu_tid / 32]->arrive_and_wait(); }

template <typename T>
inline T emu_exchange(T v, int src) {
  const int w = emu_tid / 32, l = emu_tid % 32;
  std::memcpy(&emu_blk->xbuf[w][l], &v, sizeof(T));
  __syncwarp();
  T r;
  std::memcpy(&r, &emu_blk->xbuf[w][src & 31], sizeof(T));
  __syncwarp();
  return r;
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int m) { return emu_exchange(v, (emu_tid % 32) ^ m); }
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src); }
inline int __any_sync(unsigned, int pred) {
  const int w = emu_tid / 32, l = emu_tid % 32;
  emu_blk->xbuf[w][l] = pred ? 1 : 0;
  __syncwarp();
  int any = 0;
  for (int i = 0; i < 32; ++i) any |= int(emu_blk->xbuf[w][i]);
  __syncwarp();
  return any;
}

inline float emu_h(uint32_t reg, int hi) {
  __half h;
  h.x = uint16_t(hi ? reg >> 16 : reg & 0xFFFFu);
  return float(h);
}

// One warp's mma.sync.m16n8kK (row.col) with the PTX fragment layouts: each 32-bit register holds
// E = K/8 consecutive k of one row (A) or column (B), the lowest k in the low bits; a0: row g,
// k < K/2; a1: row g+8; a2, a3: the same at k >= K/2; b0: k < K/2, b1: k >= K/2, column g.
// elem(register, i) decodes element i of a register; Acc is the accumulator type.
template <int K, typename Acc, typename Elem>
inline void emu_mma(Acc c[4], const uint32_t r[6], Elem elem) {
  constexpr int E = K / 8;  // elements per register
  constexpr int H = K / 2;
  const int w = emu_tid / 32, l = emu_tid % 32;
  uint32_t* m = emu_blk->mbuf[w][l];
  for (int i = 0; i < 6; ++i) m[i] = r[i];
  __syncwarp();
  auto A = [&](int row, int k) {
    const int lane = (row % 8) * 4 + (k % H) / E;
    return elem(emu_blk->mbuf[w][lane][(row >= 8 ? 1 : 0) + (k >= H ? 2 : 0)], k % E);
  };
  auto B = [&](int k, int n) {
    return elem(emu_blk->mbuf[w][n * 4 + (k % H) / E][4 + (k >= H ? 1 : 0)], k % E);
  };
  const int gid = l / 4, tig = l % 4;
  Acc out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = gid + (i >= 2 ? 8 : 0);
    const int col = 2 * tig + (i % 2);
    Acc acc = c[i];
    for (int k = 0; k < K; ++k) acc += A(row, k) * B(k, col);
    out[i] = acc;
  }
  __syncwarp();
  for (int i = 0; i < 4; ++i) c[i] = out[i];
}

// mma.sync.m16n8k32.row.col.s32.s8.s8.s32
inline void iq_imma(int c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                    uint32_t b1) {
  const uint32_t r[6] = {a0, a1, a2, a3, b0, b1};
  emu_mma<32>(c, r, [](uint32_t x, int i) { return int(int8_t(uint8_t(x >> (8 * i)))); });
}

// mma.sync.m16n8k16.row.col.f32.f16.f16.f32
inline void iq_mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                   uint32_t b1) {
  const uint32_t r[6] = {a0, a1, a2, a3, b0, b1};
  emu_mma<16>(c, r, emu_h);
}

// Runs fn() once per thread of every block of grid (gx, gy, gz) x block (nt threads).
inline void emu_launch(unsigned gx, unsigned gy, unsigned gz, int nt, const std::function<void()>& fn) {
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        EmuBlock blk;
        blk.block = std::make_unique<std::barrier<>>(nt);
        for (int w = 0; w < (nt + 31) / 32; ++w)
          blk.warps.push_back(std::make_unique<std::barrier<>>(std::min(32, nt - 32 * w)));
        emu_blk = &blk;
        std::vector<std::thread> ts;
        for (int t = 0; t < nt; ++t)
          ts.emplace_back([&, t] {
            threadIdx = {unsigned(t), 0, 0};
            blockIdx = {x, y, z};
            gridDim = {gx, gy, gz};
            emu_tid = t;
            fn();
          });
        for (auto& th : ts) th.join();
      }
}

namespace mlx::core::cu {
using Shape = std::array<int32_t, 10>;
using Strides = std::array<int64_t, 10>;
}  // namespace mlx::core::cu

// Shared addresses: 32-bit offsets from one static byte (the emulator's __shared__ arrays are
// statics of one binary, within +-2 GB of it).
inline char emu_smem_origin;
inline uint32_t iq_smem(const void* p) {
  return uint32_t(static_cast<const char*>(p) - &emu_smem_origin);
}
inline void iq_prefetch(const void*) {}
inline char* emu_smem_ptr(uint32_t s) { return &emu_smem_origin + int32_t(s); }
inline uint32_t iq_lds32(uint32_t s) {
  uint32_t v;
  std::memcpy(&v, emu_smem_ptr(s), 4);
  return v;
}
inline uint2 iq_lds64(uint32_t s) {
  if (s % 8) std::abort();  // ld.shared.v2 needs an 8-byte aligned address
  uint2 v;
  std::memcpy(&v.x, emu_smem_ptr(s), 4);
  std::memcpy(&v.y, emu_smem_ptr(s) + 4, 4);
  return v;
}
inline uint32_t iq_lds16(uint32_t s) {
  uint16_t v;
  std::memcpy(&v, emu_smem_ptr(s), 2);
  return v;
}
// cp.async: copied at once (the emulator has no asynchrony); bytes < 16 zero-fill the rest.
inline void iq_cp_async16s(uint32_t s, const void* src, int bytes) {
  char* dst = emu_smem_ptr(s);
  std::memset(dst, 0, 16);
  if (bytes > 0) std::memcpy(dst, src, bytes);
}
inline void iq_cp_commit() {}
template <int N>
inline void iq_cp_wait_all_but() {}
