"""ZipFusion CUDA kernels: page compression and decode attention that reads compressed pages.

Five parts (STYLE): source strings -> kernels built once at import (only where MLX has its CUDA
backend) -> pure-array references -> launchers -> public functions with `use_kernel=` that fall
back to the reference elsewhere.

Layouts (see `app/engine/kvcache/zipfusion/codec.py`):
  pool:       [rows, 128] uint16, rows of 256 bytes; compressed blocks are 768 B, raw 1024 B
  meta:       [L * n_ids, Hkv, 2, MW] uint32; word 0 = offset of the first block in rows,
              then one byte per block: b/2, or 0xFF for a raw block
  page_table: [B, maxp] int32 page ids (the last page of a sequence may be raw and partly full)
  seq_len:    [B] int32 tokens in the pool; the token of this step arrives as k_new / v_new
The attention kernel runs one CTA per (split, KV head, sequence); each warp walks pages, decodes
each lane's 8 values straight into `mma.m16n8k16` B fragments (nothing is written back but the
output), keeps an online softmax for the G query heads of the group (rows of the A operand), and
writes a partial (m, l, O) per warp; the reduce kernel merges partials with the new token.
Two variants share that page step: "simple" loads a page's blocks from global memory into
registers; "pipe" streams each warp's next pages into shared memory with cp.async (STAGES deep)
so several pages per warp are in flight and the kernel stays bandwidth-bound. The default,
"ring" (G <= 8), turns the mma around (KV tokens / dims as the 16 rows, query heads as the 8
columns: half the mma and accumulators) and streams pages into a byte-packed shared-memory ring,
so a compressed page puts only its real bytes in the ring and more pages are in flight.
"""

from __future__ import annotations

import functools
import math
import os

import mlx.core as mx

from .. import jit
from . import codec

# -- sources -------------------------------------------------------------------------------

# The few device primitives written in PTX (a CPU emulator in the tests supplies its own).
HEADER_PTX = r"""
__device__ __forceinline__ void zf_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t zf_pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t zf_smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void zf_cp16(uint32_t smem_addr, const void* gptr) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gptr));
}

__device__ __forceinline__ void zf_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void zf_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

#define ZF_DYN_SMEM(name) extern __shared__ __align__(16) uint8_t name[]

// 2^x on the MUFU unit without exp2f's subnormal fix-up (flushes results below 2^-126 to 0).
__device__ __forceinline__ float zf_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""

HEADER_COMMON = r"""
#define ZF_RAW 0xFFu

// N consecutive floats from p (16-byte aligned where N % 4 == 0, 8-byte where N % 2 == 0).
template <int N>
__device__ __forceinline__ void zf_load_f(const float* p, float v[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 4) {
      const float4 x = *reinterpret_cast<const float4*>(p + j);
      v[j] = x.x; v[j + 1] = x.y; v[j + 2] = x.z; v[j + 3] = x.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      const float2 x = *reinterpret_cast<const float2*>(p + j);
      v[j] = x.x; v[j + 1] = x.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = p[j];
  }
}

// One lane's 8 values of a compressed block -> 4 bf16x2 registers (values 0-1, 2-3, 4-5, 6-7).
// High byte = sign*128 + b/2 + d for four values at once; no carries since b/2 + d <= 127.
__device__ __forceinline__ void zf_decode8(
    uint32_t w, uint32_t lo0, uint32_t lo1, uint32_t half_base, uint32_t r[4]) {
  const uint32_t rep = half_base * 0x01010101u;
  const uint32_t hi_a = (w & 0x87878787u) + rep;
  const uint32_t hi_b = (((w << 1) & 0x80808080u) | ((w >> 3) & 0x07070707u)) + rep;
  r[0] = __byte_perm(lo0, hi_a, 0x5140);
  r[1] = __byte_perm(lo0, hi_a, 0x7362);
  r[2] = __byte_perm(lo1, hi_b, 0x5140);
  r[3] = __byte_perm(lo1, hi_b, 0x7362);
}

__device__ __forceinline__ uint32_t zf_meta_flag(const uint32_t* m, int j) {
  return (m[1 + (j >> 2)] >> (8 * (j & 3))) & 0xFFu;
}

// Load one lane's two groups of a block (group g of lane l is group 32g+l of the block): raw ->
// 2 x 16 bytes; compressed -> 2 x 4 code bytes and 2 x 8 low bytes. Works on global or shared.
__device__ __forceinline__ void zf_load_block(
    const uint8_t* blk, bool raw, int lane, uint32_t r[8]) {
  if (raw) {
    const uint4 x0 = *reinterpret_cast<const uint4*>(blk + 16 * lane);
    const uint4 x1 = *reinterpret_cast<const uint4*>(blk + 512 + 16 * lane);
    r[0] = x0.x; r[1] = x0.y; r[2] = x0.z; r[3] = x0.w;
    r[4] = x1.x; r[5] = x1.y; r[6] = x1.z; r[7] = x1.w;
  } else {
    const uint32_t c0 = *reinterpret_cast<const uint32_t*>(blk + 4 * lane);
    const uint32_t c1 = *reinterpret_cast<const uint32_t*>(blk + 128 + 4 * lane);
    const uint2 l0 = *reinterpret_cast<const uint2*>(blk + 256 + 8 * lane);
    const uint2 l1 = *reinterpret_cast<const uint2*>(blk + 512 + 8 * lane);
    r[0] = c0; r[1] = c1; r[2] = l0.x; r[3] = l0.y; r[4] = l1.x; r[5] = l1.y;
    r[6] = 0u; r[7] = 0u;
  }
}

// Group g (0 or 1) of a loaded block -> 4 bf16x2 registers.
__device__ __forceinline__ void zf_group(const uint32_t r[8], uint32_t flag, int g, uint32_t out[4]) {
  if (flag == ZF_RAW) {
    out[0] = r[4 * g + 0]; out[1] = r[4 * g + 1]; out[2] = r[4 * g + 2]; out[3] = r[4 * g + 3];
  } else {
    zf_decode8(r[g], r[2 + 2 * g], r[3 + 2 * g], flag, out);
  }
}

// Q as the A operand: rows = the G query heads of KV head h (rows >= G are zero).
template <int D, int G>
__device__ __forceinline__ void zf_load_q(
    const __nv_bfloat16* q, int b, int h, int n_kv, int lane, uint32_t qa[D / 16][4]) {
  const int gid = lane >> 2, tig = lane & 3;
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q + ((size_t)b * n_kv + h) * G * D);
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) {
    const int c = (kt * 16 + 2 * tig) >> 1;
    qa[kt][0] = gid < G ? qw[gid * (D / 2) + c] : 0u;
    qa[kt][1] = gid + 8 < G ? qw[(gid + 8) * (D / 2) + c] : 0u;
    qa[kt][2] = gid < G ? qw[gid * (D / 2) + c + 4] : 0u;
    qa[kt][3] = gid + 8 < G ? qw[(gid + 8) * (D / 2) + c + 4] : 0u;
  }
}

// One page: S = Q K^T on the page's two 8-token tiles, online softmax, O += P V. kblk / vblk
// point at each block of the page (global or shared memory); `valid` tokens are real. EAGER
// issues every block's loads first (global memory: hide latency); otherwise each block is
// loaded when used (shared memory: fewer registers). Accumulation order is the same either way.
template <int D, int MW, bool EAGER>
__device__ __forceinline__ void zf_attend_page(
    const uint8_t* const kblk[D / 32], const uint8_t* const vblk[D / 32],
    const uint32_t km[MW], const uint32_t vm[MW], int valid, int lane, float sl2,
    const uint32_t qa[D / 16][4], float o[D / 8][4], float& m0, float& m1, float& l0, float& l1) {
  constexpr int NB = D / 32;
  constexpr int NT = D / 8;
  const int tig = lane & 3;
  const float NEG_INF = __int_as_float(0xff800000);
  constexpr int NR = EAGER ? NB : 1;
  uint32_t kr[NR][8], vr[NR][8];
  if (EAGER) {
#pragma unroll
    for (int j = 0; j < NR; ++j) {
      zf_load_block(kblk[j], zf_meta_flag(km, j) == ZF_RAW, lane, kr[j]);
      zf_load_block(vblk[j], zf_meta_flag(vm, j) == ZF_RAW, lane, vr[j]);
    }
  }
  // s[g]: rows (gid, gid + 8), tokens 8g + 2tig + {0, 1}
  float s[2][4];
#pragma unroll
  for (int g = 0; g < 2; ++g) { s[g][0] = 0.f; s[g][1] = 0.f; s[g][2] = 0.f; s[g][3] = 0.f; }
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    uint32_t* r = kr[EAGER ? j : 0];
    if (!EAGER) zf_load_block(kblk[j], zf_meta_flag(km, j) == ZF_RAW, lane, r);
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      uint32_t kb[4];
      zf_group(r, zf_meta_flag(km, j), g, kb);
      zf_mma(s[g], qa[2 * j], kb[0], kb[1]);
      zf_mma(s[g], qa[2 * j + 1], kb[2], kb[3]);
    }
  }
  float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
  for (int g = 0; g < 2; ++g) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool ok = 8 * g + 2 * tig + e < valid;
      s[g][e] = ok ? s[g][e] * sl2 : NEG_INF;
      s[g][2 + e] = ok ? s[g][2 + e] * sl2 : NEG_INF;
      mx0 = fmaxf(mx0, s[g][e]);
      mx1 = fmaxf(mx1, s[g][2 + e]);
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
  const float a0 = exp2f(m0 - n0), a1 = exp2f(m1 - n1);
  m0 = n0;
  m1 = n1;
  float ps[2][4];
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    ps[g][0] = exp2f(s[g][0] - n0); ps[g][1] = exp2f(s[g][1] - n0);
    ps[g][2] = exp2f(s[g][2] - n1); ps[g][3] = exp2f(s[g][3] - n1);
  }
  l0 = l0 * a0 + ((ps[0][0] + ps[0][1]) + (ps[1][0] + ps[1][1]));
  l1 = l1 * a1 + ((ps[0][2] + ps[0][3]) + (ps[1][2] + ps[1][3]));
#pragma unroll
  // Rescale O only when some row's max moved (rare after the first pages; x1.0 is exact).
  if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) { o[nt][0] *= a0; o[nt][1] *= a0; o[nt][2] *= a1; o[nt][3] *= a1; }
  }
  // The C fragments of S are the A fragment of P.V (rows = heads, k = the page's 16 tokens).
  // P goes in as bf16 hi + bf16 lo (P - hi): the P.V product keeps ~16 bits of P, close to an
  // fp32 softmax, at the cost of one more mma per tile (the tensor cores have room).
  uint32_t pa[4], pl[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float x0 = ps[i >> 1][2 * (i & 1)], x1 = ps[i >> 1][2 * (i & 1) + 1];
    pa[i] = zf_pack_bf16(x0, x1);
    pl[i] = zf_pack_bf16(x0 - __uint_as_float(pa[i] << 16), x1 - __uint_as_float(pa[i] & 0xffff0000u));
  }
  // Tokens past the end of a partly written page hold stale bytes: zero them so 0 * NaN can't leak.
  const bool partial = valid < 16;
  const uint32_t keep_lo = (2 * tig < valid ? 0x0000ffffu : 0u) | (2 * tig + 1 < valid ? 0xffff0000u : 0u);
  const uint32_t keep_hi = (2 * tig + 8 < valid ? 0x0000ffffu : 0u) | (2 * tig + 9 < valid ? 0xffff0000u : 0u);
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    uint32_t* r = vr[EAGER ? j : 0];
    if (!EAGER) zf_load_block(vblk[j], zf_meta_flag(vm, j) == ZF_RAW, lane, r);
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      uint32_t vb[4];
      zf_group(r, zf_meta_flag(vm, j), g, vb);
      if (partial) { vb[0] &= keep_lo; vb[1] &= keep_hi; vb[2] &= keep_lo; vb[3] &= keep_hi; }
      zf_mma(o[4 * j + 2 * g], pa, vb[0], vb[1]);
      zf_mma(o[4 * j + 2 * g], pl, vb[0], vb[1]);
      zf_mma(o[4 * j + 2 * g + 1], pa, vb[2], vb[3]);
      zf_mma(o[4 * j + 2 * g + 1], pl, vb[2], vb[3]);
    }
  }
}

// One partial per warp: o_part [B, Hkv, parts, G, D], ml_part [B, Hkv, parts, G, 2].
template <int D, int G>
__device__ __forceinline__ void zf_store_partial(
    float* o_part, float* ml_part, size_t part, int lane, const float o[D / 8][4],
    float m0, float m1, float l0, float l1) {
  const int gid = lane >> 2, tig = lane & 3;
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  float* op = o_part + part * G * D;
  float* mp = ml_part + part * G * 2;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int d = 8 * nt + 2 * tig;
    if (gid < G) { op[gid * D + d] = o[nt][0]; op[gid * D + d + 1] = o[nt][1]; }
    if (gid + 8 < G) { op[(gid + 8) * D + d] = o[nt][2]; op[(gid + 8) * D + d + 1] = o[nt][3]; }
  }
  if (tig == 0) {
    if (gid < G) { mp[gid * 2] = m0; mp[gid * 2 + 1] = l0; }
    if (gid + 8 < G) { mp[(gid + 8) * 2] = m1; mp[(gid + 8) * 2 + 1] = l1; }
  }
}


// ---- "ring" variant: S^T = K Q^T and O^T = V^T P^T, i.e. the KV tokens / dims are the 16 rows
// of the mma and the <= 8 query heads its 8 columns: half the mma of Q-as-rows for G <= 8, half
// the accumulator registers. The B fragments decoded above double as A fragments (see below).

// Q^T as the B operand of S^T = K Q^T: column n = query head n of the group (n >= G: zero).
template <int D, int G>
__device__ __forceinline__ void zf_load_qt(
    const __nv_bfloat16* q, int b, int h, int n_kv, int lane, uint32_t qb[D / 16][2]) {
  const int gid = lane >> 2, tig = lane & 3;
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q + ((size_t)b * n_kv + h) * G * D);
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) {
    qb[kt][0] = gid < G ? qw[gid * (D / 2) + kt * 8 + tig] : 0u;
    qb[kt][1] = gid < G ? qw[gid * (D / 2) + kt * 8 + tig + 4] : 0u;
  }
}

// Bytes of one page's K (or V) span of one head: its blocks back to back, 768 or 1024 each.
// Raw blocks of a span: flag bytes equal to 0xFF, counted four at a time (x = ~flags has a
// zero byte there; the high bit of ((x & 0x7f..) + 0x7f..) | x is set exactly for nonzero bytes).
template <int NB>
__device__ __forceinline__ int zf_span_raw(const uint32_t* m) {
  int n = 0;
#pragma unroll
  for (int i = 0; i < (NB + 3) / 4; ++i) {
    const int k = NB - 4 * i < 4 ? NB - 4 * i : 4;
    const uint32_t x = ~m[1 + i] | (k == 4 ? 0u : 0xffffffffu << (8 * k));
    n += 4 - __popc((((x & 0x7f7f7f7fu) + 0x7f7f7f7fu) | x) & 0x80808080u);
  }
  return n;
}

template <int NB>
__device__ __forceinline__ int zf_span_bytes(const uint32_t* m) {
  return NB * 768 + 256 * zf_span_raw<NB>(m);
}

// cp.async.wait_group takes an immediate: wait until at most n groups are pending (n >= 7:
// at most 7, which is more waiting than asked and so still correct).
__device__ __forceinline__ void zf_cp_wait_n(int n) {
  switch (n) {
    case 0: zf_cp_wait<0>(); break;
    case 1: zf_cp_wait<1>(); break;
    case 2: zf_cp_wait<2>(); break;
    case 3: zf_cp_wait<3>(); break;
    case 4: zf_cp_wait<4>(); break;
    case 5: zf_cp_wait<5>(); break;
    case 6: zf_cp_wait<6>(); break;
    default: zf_cp_wait<7>(); break;
  }
}

// One page, transposed: kb / vb point at the page's K / V span (blocks back to back, in shared
// memory). Lane (gid, tig) scores tokens gid and gid + 8 for heads 2tig and 2tig + 1; o[mt]
// holds dims 16mt + gid (+ 8) of those heads. m / l are per head; l is a per-lane partial
// (summed over the 8 lanes of a head in zf_store_partial_t).
// FAST: every block of the page compressed and all 16 tokens valid (no branches, no masks).
template <int D, int MW, bool FAST>
__device__ __forceinline__ void zf_attend_page_t(
    const uint8_t* kb, const uint8_t* vb, const uint32_t km[MW], const uint32_t vm[MW],
    int valid, int lane, float sl2, const uint32_t qb[D / 16][2], float o[D / 16][4],
    float& m0, float& m1, float& l0, float& l1) {
  constexpr int NB = D / 32;
  const int gid = lane >> 2, tig = lane & 3;
  const float NEG_INF = __int_as_float(0xff800000);
  // Two accumulators (even / odd 16-dim tiles) halve the dependent mma chain.
  float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
  int off = 0;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const uint32_t flag = zf_meta_flag(km, j);
    uint32_t r[8], k0[4], k1[4];
    zf_load_block(kb + off, !FAST && flag == ZF_RAW, lane, r);
    off += !FAST && flag == ZF_RAW ? 1024 : 768;
    if (FAST) {
      zf_decode8(r[0], r[2], r[3], flag, k0);
      zf_decode8(r[1], r[4], r[5], flag, k1);
    } else {
      zf_group(r, flag, 0, k0);  // tokens 0-7: rows gid of A
      zf_group(r, flag, 1, k1);  // tokens 8-15: rows gid + 8
    }
    const uint32_t a0[4] = {k0[0], k1[0], k0[1], k1[1]};
    const uint32_t a1[4] = {k0[2], k1[2], k0[3], k1[3]};
    zf_mma(sa, a0, qb[2 * j][0], qb[2 * j][1]);
    zf_mma(sb, a1, qb[2 * j + 1][0], qb[2 * j + 1][1]);
  }
  // s: [token gid, head 2tig], [gid, 2tig+1], [gid+8, 2tig], [gid+8, 2tig+1]
  float s[4];
  const bool ok_a = FAST || gid < valid, ok_b = FAST || gid + 8 < valid;
  s[0] = ok_a ? (sa[0] + sb[0]) * sl2 : NEG_INF;
  s[1] = ok_a ? (sa[1] + sb[1]) * sl2 : NEG_INF;
  s[2] = ok_b ? (sa[2] + sb[2]) * sl2 : NEG_INF;
  s[3] = ok_b ? (sa[3] + sb[3]) * sl2 : NEG_INF;
  float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
  }
  const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
  const float c0 = zf_exp2(m0 - n0), c1 = zf_exp2(m1 - n1);
  m0 = n0;
  m1 = n1;
  const float p0 = zf_exp2(s[0] - n0), p1 = zf_exp2(s[1] - n1);
  const float p2 = zf_exp2(s[2] - n0), p3 = zf_exp2(s[3] - n1);
  l0 = l0 * c0 + (p0 + p2);
  l1 = l1 * c1 + (p1 + p3);
  // Rescale O only when some head's max moved (rare after the first pages; x1.0 is exact).
  if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) { o[mt][0] *= c0; o[mt][1] *= c1; o[mt][2] *= c0; o[mt][3] *= c1; }
  }
  // P^T as the B operand (k = tokens, n = head): lane (gid, tig) needs head gid's tokens 2tig,
  // 2tig+1 (b0) and 2tig+8, 2tig+9 (b1). P is packed to bf16 pairs (tokens t, t+8) per head;
  // lanes of tokens 2u and 2u+1 swap one pair so that one holds all four tokens of head 2tig,
  // the other of head 2tig+1; one shuffle per register then delivers them. P goes as hi + lo
  // (P - hi) so that P.V keeps ~16 bits of P.
  const uint32_t eh = zf_pack_bf16(p0, p2), oh = zf_pack_bf16(p1, p3);
  const uint32_t el = zf_pack_bf16(p0 - __uint_as_float(eh << 16), p2 - __uint_as_float(eh & 0xffff0000u));
  const uint32_t ol = zf_pack_bf16(p1 - __uint_as_float(oh << 16), p3 - __uint_as_float(oh & 0xffff0000u));
  const bool even = !(gid & 1);
  const uint32_t rh = __shfl_xor_sync(0xffffffffu, even ? oh : eh, 4);
  const uint32_t rl = __shfl_xor_sync(0xffffffffu, even ? ol : el, 4);
  const int src = 4 * (2 * tig + (gid & 1)) + (gid >> 1);
  const uint32_t h0 = __shfl_sync(0xffffffffu, even ? eh : rh, src);  // tokens 2tig, 2tig+8
  const uint32_t h1 = __shfl_sync(0xffffffffu, even ? rh : oh, src);  // tokens 2tig+1, 2tig+9
  const uint32_t g0 = __shfl_sync(0xffffffffu, even ? el : rl, src);
  const uint32_t g1 = __shfl_sync(0xffffffffu, even ? rl : ol, src);
  const uint32_t ph0 = __byte_perm(h0, h1, 0x5410), ph1 = __byte_perm(h0, h1, 0x7632);
  const uint32_t pl0 = __byte_perm(g0, g1, 0x5410), pl1 = __byte_perm(g0, g1, 0x7632);
  // Tokens past the end of a partly written page hold stale bytes: zero them so 0 * NaN can't leak.
  const bool partial = !FAST && valid < 16;
  const uint32_t keep_lo = (2 * tig < valid ? 0x0000ffffu : 0u) | (2 * tig + 1 < valid ? 0xffff0000u : 0u);
  const uint32_t keep_hi = (2 * tig + 8 < valid ? 0x0000ffffu : 0u) | (2 * tig + 9 < valid ? 0xffff0000u : 0u);
  off = 0;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const uint32_t flag = zf_meta_flag(vm, j);
    uint32_t r[8];
    zf_load_block(vb + off, !FAST && flag == ZF_RAW, lane, r);
    off += !FAST && flag == ZF_RAW ? 1024 : 768;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      uint32_t v[4];
      if (FAST) zf_decode8(r[g], r[2 + 2 * g], r[3 + 2 * g], flag, v);
      else zf_group(r, flag, g, v);
      if (partial) { v[0] &= keep_lo; v[1] &= keep_hi; v[2] &= keep_lo; v[3] &= keep_hi; }
      // V^T tile of dims 32j + 16g .. +15: rows gid (v[0], v[1]) and gid + 8 (v[2], v[3]).
      const uint32_t a[4] = {v[0], v[2], v[1], v[3]};
      zf_mma(o[2 * j + g], a, ph0, ph1);
      zf_mma(o[2 * j + g], a, pl0, pl1);
    }
  }
}

// One partial per warp from the transposed layout (same [.., G, D] / [.., G, 2] as above).
template <int D, int G>
__device__ __forceinline__ void zf_store_partial_t(
    float* o_part, float* ml_part, size_t part, int lane, const float o[D / 16][4],
    float m0, float m1, float l0, float l1) {
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, x);
    l1 += __shfl_xor_sync(0xffffffffu, l1, x);
  }
  float* op = o_part + part * G * D;
  float* mp = ml_part + part * G * 2;
  const int ha = 2 * tig, hb = 2 * tig + 1;
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
    const int d = 16 * mt + gid;
    if (ha < G) { op[ha * D + d] = o[mt][0]; op[ha * D + d + 8] = o[mt][2]; }
    if (hb < G) { op[hb * D + d] = o[mt][1]; op[hb * D + d + 8] = o[mt][3]; }
  }
  if (gid == 0) {
    if (ha < G) { mp[ha * 2] = m0; mp[ha * 2 + 1] = l0; }
    if (hb < G) { mp[hb * 2] = m1; mp[hb * 2 + 1] = l1; }
  }
}

"""

HEADER = HEADER_PTX + HEADER_COMMON

# Shared prologue of both attention variants. Template constants: D (head dim), G (query heads
# per KV head, <= 16), NW (warps per CTA), MW (metadata words per page/head/K-or-V).
# Runtime params: layer, n_ids, maxp, n_splits.
# Which split, head and sequence this CTA is, its parameters and its range of pages.
_SPLIT_PROLOGUE = r"""
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int split = blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int n_kv = gridDim.y;
  const int layer = params[0];
  const int n_ids = params[1];
  const int maxp = params[2];
  const int n_splits = params[3];
  const float sl2 = scale[0];
  const float NEG_INF = __int_as_float(0xff800000);
  const int len = seq_len[b];
  const int n_pages = (len + 15) >> 4;
  const int per = (n_pages + n_splits - 1) / n_splits;
  const int p_begin = split * per;
  const int p_end = min(n_pages, p_begin + per);
"""

_ATTN_PROLOGUE = (
    r"""
  constexpr int NB = D / 32;
"""
    + _SPLIT_PROLOGUE
    + r"""
  uint32_t qa[D / 16][4];
  zf_load_q<D, G>(q, b, h, n_kv, lane, qa);
  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) { o[nt][0] = 0.f; o[nt][1] = 0.f; o[nt][2] = 0.f; o[nt][3] = 0.f; }
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  const uint8_t* pool_b = reinterpret_cast<const uint8_t*>(pool);
  const size_t part = ((size_t)b * n_kv + h) * n_splits * NW + (size_t)split * NW + warp;
"""
)

ATTN_SOURCE = (
    _ATTN_PROLOGUE
    + r"""
  for (int p = p_begin + warp; p < p_end; p += NW) {
    const int pid = page_table[(size_t)b * maxp + p];
    const uint32_t* mrow = meta + (((size_t)layer * n_ids + pid) * n_kv + h) * (2 * MW);
    uint32_t km[MW], vm[MW];
#pragma unroll
    for (int i = 0; i < MW; ++i) { km[i] = mrow[i]; vm[i] = mrow[MW + i]; }
    const uint8_t* kblk[NB];
    const uint8_t* vblk[NB];
    size_t ko = (size_t)km[0] * 256, vo = (size_t)vm[0] * 256;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      kblk[j] = pool_b + ko;
      vblk[j] = pool_b + vo;
      ko += zf_meta_flag(km, j) == ZF_RAW ? 1024 : 768;
      vo += zf_meta_flag(vm, j) == ZF_RAW ? 1024 : 768;
    }
    const int valid = (p == n_pages - 1) ? len - 16 * p : 16;
    zf_attend_page<D, MW, true>(kblk, vblk, km, vm, valid, lane, sl2, qa, o, m0, m1, l0, l1);
  }
  zf_store_partial<D, G>(o_part, ml_part, part, lane, o, m0, m1, l0, l1);
"""
)

# Pipelined variant: each warp owns STAGES slots of shared memory (one page of one KV head: K
# blocks then V blocks at a 1024-byte stride) and keeps STAGES-1 pages in flight with cp.async.
# Lane i holds the metadata of the warp's page (win + i), so a page's copy starts without a
# dependent load; the window is refilled every 32 pages.
PIPE_SOURCE = (
    _ATTN_PROLOGUE
    + r"""
  constexpr int SLOT = 2 * NB * 1024;
  ZF_DYN_SMEM(zf_dyn);
  uint8_t* ring = zf_dyn + (size_t)warp * STAGES * SLOT;
  uint32_t* smeta = reinterpret_cast<uint32_t*>(zf_dyn + (size_t)NW * STAGES * SLOT)
      + warp * STAGES * (2 * MW);
  const uint32_t ring_s = zf_smem_addr(ring);
  const int first = p_begin + warp;
  const int n_mine = p_end > first ? (p_end - first + NW - 1) / NW : 0;
  int win = -64;
  uint32_t wm[2 * MW];
#pragma unroll
  for (int i = 0; i < 2 * MW; ++i) wm[i] = 0u;

  for (int k = 0; k < n_mine + STAGES - 1; ++k) {
    // Issue the copy of page k (if any) into slot k % STAGES; always commit a group.
    if (k < n_mine) {
      if (k >= win + 32) {
        win = k;
        const int kk = win + lane;
#pragma unroll
        for (int i = 0; i < 2 * MW; ++i) wm[i] = 0u;
        if (kk < n_mine) {
          const int pid = page_table[(size_t)b * maxp + first + kk * NW];
          const uint32_t* mrow = meta + (((size_t)layer * n_ids + pid) * n_kv + h) * (2 * MW);
#pragma unroll
          for (int i = 0; i < 2 * MW; ++i) wm[i] = mrow[i];
        }
      }
      uint32_t m[2 * MW];
#pragma unroll
      for (int i = 0; i < 2 * MW; ++i) m[i] = __shfl_sync(0xffffffffu, wm[i], k - win);
      const int slot = k % STAGES;
      if (lane == 0) {
#pragma unroll
        for (int i = 0; i < 2 * MW; ++i) smeta[slot * 2 * MW + i] = m[i];
      }
      const uint32_t dst = ring_s + slot * SLOT;
      size_t ko = (size_t)m[0] * 256, vo = (size_t)m[MW] * 256;
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const int kn = zf_meta_flag(m, j) == ZF_RAW ? 64 : 48;
        const int vn = zf_meta_flag(m + MW, j) == ZF_RAW ? 64 : 48;
        for (int c = lane; c < kn; c += 32) zf_cp16(dst + j * 1024 + c * 16, pool_b + ko + c * 16);
        for (int c = lane; c < vn; c += 32)
          zf_cp16(dst + (NB + j) * 1024 + c * 16, pool_b + vo + c * 16);
        ko += kn * 16;
        vo += vn * 16;
      }
    }
    zf_cp_commit();
    // Consume page c = k - (STAGES - 1): its group is complete once at most STAGES-1 are pending.
    const int c = k - (STAGES - 1);
    if (c >= 0) {
      zf_cp_wait<STAGES - 1>();
      __syncwarp();
      const int slot = c % STAGES;
      uint32_t km[MW], vm[MW];
#pragma unroll
      for (int i = 0; i < MW; ++i) { km[i] = smeta[slot * 2 * MW + i]; vm[i] = smeta[slot * 2 * MW + MW + i]; }
      const uint8_t* base = ring + slot * SLOT;
      const uint8_t* kblk[NB];
      const uint8_t* vblk[NB];
#pragma unroll
      for (int j = 0; j < NB; ++j) { kblk[j] = base + j * 1024; vblk[j] = base + (NB + j) * 1024; }
      const int p = first + c * NW;
      const int valid = (p == n_pages - 1) ? len - 16 * p : 16;
      zf_attend_page<D, MW, false>(kblk, vblk, km, vm, valid, lane, sl2, qa, o, m0, m1, l0, l1);
      __syncwarp();  // every lane is done with this slot before it is refilled
    }
  }
  zf_cp_wait<0>();
  zf_store_partial<D, G>(o_part, ml_part, part, lane, o, m0, m1, l0, l1);
"""
)

# Ring variant (G <= 8): the transposed page step above, fed by a byte-packed ring of RING bytes
# per warp in shared memory. A compressed page takes 75% of a raw page's bytes in the ring, so
# more pages (bytes) are in flight per warp than with the pipe variant's raw-sized slots, and
# the copy of a page is two contiguous spans (no per-block loop). MAXQ bounds the queued pages.
RING_SOURCE = (
    r"""
  constexpr int NB = D / 32;
  constexpr int MS = 2 * MW + 1;  // words per queued page in the table: K meta, V meta, ring pos
"""
    + _SPLIT_PROLOGUE
    + r"""
  uint32_t qb[D / 16][2];
  zf_load_qt<D, G>(q, b, h, n_kv, lane, qb);
  float o[D / 16][4];
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) { o[mt][0] = 0.f; o[mt][1] = 0.f; o[mt][2] = 0.f; o[mt][3] = 0.f; }
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  const uint8_t* pool_b = reinterpret_cast<const uint8_t*>(pool);
  const size_t part = ((size_t)b * n_kv + h) * n_splits * NW + (size_t)split * NW + warp;

  ZF_DYN_SMEM(zf_dyn);
  uint8_t* ring = zf_dyn + (size_t)warp * RING;
  uint32_t* table = reinterpret_cast<uint32_t*>(zf_dyn + (size_t)NW * RING) + warp * MAXQ * MS;
  const uint32_t ring_s = zf_smem_addr(ring);
  const int first = p_begin + warp;
  const int n_mine = p_end > first ? (p_end - first + NW - 1) / NW : 0;
  int win = -64;  // lane i holds the metadata of the warp's page win + i
  uint32_t wm[2 * MW];
#pragma unroll
  for (int i = 0; i < 2 * MW; ++i) wm[i] = 0u;
  // Byte-packed ring: a queued page takes its real size (K span then V span, never wrapping);
  // positions count bytes from the start of the kernel, `head` is where the oldest queued page
  // starts and `tail` where the newest ends. Each page is one cp.async group.
  int issued = 0, head = 0, tail = 0;

  for (int done = 0; done < n_mine; ++done) {
    while (issued < n_mine && issued - done < MAXQ) {
      if (issued >= win + 32) {
        win = issued;
        const int kk = win + lane;
#pragma unroll
        for (int i = 0; i < 2 * MW; ++i) wm[i] = 0u;
        if (kk < n_mine) {
          const int pid = page_table[(size_t)b * maxp + first + kk * NW];
          const uint32_t* mrow = meta + (((size_t)layer * n_ids + pid) * n_kv + h) * (2 * MW);
#pragma unroll
          for (int i = 0; i < 2 * MW; ++i) wm[i] = mrow[i];
        }
      }
      uint32_t m[2 * MW];
#pragma unroll
      for (int i = 0; i < 2 * MW; ++i) m[i] = __shfl_sync(0xffffffffu, wm[i], issued - win);
      const int kbytes = zf_span_bytes<NB>(m), vbytes = zf_span_bytes<NB>(m + MW);
      int pos = tail;
      if (pos % RING + kbytes + vbytes > RING) pos += RING - pos % RING;
      if (issued > done && pos + kbytes + vbytes - head > RING) break;  // ring full
      if (issued == done) head = pos;
      // 16 bytes per lane per step; the first 3NB/2 steps lie inside an all-compressed span.
      const uint32_t kdst = ring_s + pos % RING + 16 * lane, vdst = kdst + kbytes;
      const uint8_t* ksrc = pool_b + (size_t)m[0] * 256 + 16 * lane;
      const uint8_t* vsrc = pool_b + (size_t)m[MW] * 256 + 16 * lane;
#pragma unroll
      for (int i = 0; i < 2 * NB; ++i) {
        if (2 * i < 3 * NB || 16 * lane + 512 * i < kbytes) zf_cp16(kdst + 512 * i, ksrc + 512 * i);
      }
#pragma unroll
      for (int i = 0; i < 2 * NB; ++i) {
        if (2 * i < 3 * NB || 16 * lane + 512 * i < vbytes) zf_cp16(vdst + 512 * i, vsrc + 512 * i);
      }
      zf_cp_commit();
      if (lane == 0) {
        uint32_t* t = table + (issued % MAXQ) * MS;
#pragma unroll
        for (int i = 0; i < 2 * MW; ++i) t[i] = m[i];
        t[2 * MW] = (uint32_t)pos;
      }
      tail = pos + kbytes + vbytes;
      ++issued;
    }
    // Page `done` is the oldest of issued - done groups: let the newer ones stay in flight.
    zf_cp_wait_n(issued - done - 1);
    __syncwarp();
    const uint32_t* t = table + (done % MAXQ) * MS;
    uint32_t km[MW], vm[MW];
#pragma unroll
    for (int i = 0; i < MW; ++i) { km[i] = t[i]; vm[i] = t[MW + i]; }
    const int n_raw = zf_span_raw<NB>(km) + zf_span_raw<NB>(vm);
    const uint8_t* kb = ring + (int)t[2 * MW] % RING;
    const uint8_t* vb = kb + NB * 768 + 256 * zf_span_raw<NB>(km);
    const int p = first + done * NW;
    const int valid = (p == n_pages - 1) ? len - 16 * p : 16;
    if (n_raw == 0 && valid == 16)
      zf_attend_page_t<D, MW, true>(kb, vb, km, vm, valid, lane, sl2, qb, o, m0, m1, l0, l1);
    else
      zf_attend_page_t<D, MW, false>(kb, vb, km, vm, valid, lane, sl2, qb, o, m0, m1, l0, l1);
    __syncwarp();  // every lane is done with this page's bytes before they are refilled
    if (done + 1 < issued) head = (int)table[((done + 1) % MAXQ) * MS + 2 * MW];
  }
  zf_cp_wait<0>();
  zf_store_partial_t<D, G>(o_part, ml_part, part, lane, o, m0, m1, l0, l1);
"""
)

# Merge the partials of one (sequence, query head) with the token of this step. Template D, G,
# RW (warps). Each warp merges every RW-th partial (lane: D/32 consecutive coordinates, vector
# loads, several partials' loads in flight), the warps' states meet in shared memory and warp 0
# adds the new token. params: n_parts (= n_splits * NW).
REDUCE_SOURCE = r"""
  constexpr int VPL = D / 32;
  const int lane = threadIdx.x & 31;
  const int w = threadIdx.x >> 5;
  const int hq = blockIdx.y;
  const int b = blockIdx.z;
  const int n_q = gridDim.y;
  const int n_kv = n_q / G;
  const int h = hq / G;
  const int r = hq - h * G;
  const int n_parts = params[0];
  const float sl2 = scale[0];
  const float NEG_INF = __int_as_float(0xff800000);
  __shared__ float red_m[RW], red_l[RW];
  __shared__ __align__(16) float red_o[RW][D];

  const size_t base = ((size_t)b * n_kv + h) * n_parts;
  // Two passes without branches, so each pass's loads are independent and in flight together
  // (a skip of empty partials between the loads made every partial two dependent round trips):
  // this warp's maximum, then its partials weighted against it (an empty partial, m = -inf
  // with o = 0 and l = 0, weighs 0).
  float m = NEG_INF, l = 0.f, acc[VPL];
#pragma unroll 4
  for (int i = w; i < n_parts; i += RW) m = fmaxf(m, ml_part[((base + i) * G + r) * 2]);
  const float mb = m == NEG_INF ? 0.f : m;
#pragma unroll
  for (int j = 0; j < VPL; ++j) acc[j] = 0.f;
#pragma unroll 4
  for (int i = w; i < n_parts; i += RW) {
    const size_t pi = (base + i) * G + r;
    float oi[VPL];
    zf_load_f<VPL>(o_part + pi * D + lane * VPL, oi);
    const float c = exp2f(ml_part[pi * 2] - mb);
    l += c * ml_part[pi * 2 + 1];
#pragma unroll
    for (int j = 0; j < VPL; ++j) acc[j] += c * oi[j];
  }
  if (RW > 1) {
    if (lane == 0) { red_m[w] = m; red_l[w] = l; }
#pragma unroll
    for (int j = 0; j < VPL; ++j) red_o[w][lane * VPL + j] = acc[j];
    __syncthreads();
    if (w != 0) return;
    for (int x = 1; x < RW; ++x) {
      const float mi = red_m[x];
      if (mi == NEG_INF) continue;
      const float mn = fmaxf(m, mi);
      const float a = exp2f(m - mn), c = exp2f(mi - mn);
      l = l * a + red_l[x] * c;
#pragma unroll
      for (int j = 0; j < VPL; ++j) acc[j] = acc[j] * a + red_o[x][lane * VPL + j] * c;
      m = mn;
    }
  }
  const size_t qi = ((size_t)b * n_q + hq) * D + lane * VPL;
  const size_t ki = ((size_t)b * n_kv + h) * D + lane * VPL;
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < VPL; ++j) dot += __bfloat162float(q[qi + j]) * __bfloat162float(k_new[ki + j]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
  const float s_new = dot * sl2;
  const float mn = fmaxf(m, s_new);
  const float a = exp2f(m - mn), c = exp2f(s_new - mn);
  l = l * a + c;
#pragma unroll
  for (int j = 0; j < VPL; ++j)
    out[qi + j] = __float2bfloat16((acc[j] * a + c * __bfloat162float(v_new[ki + j])) / l);
"""
REDUCE_WARPS = 4

# Compress blocks of 512 values (fragment order): one thread per group of 8, 64 per block.
COMPRESS_SOURCE = r"""
  const int t = threadIdx.x;
  const int blk = blockIdx.x;
  __shared__ uint32_t red_min[2], red_max[2];
  const uint4 x = reinterpret_cast<const uint4*>(blocks)[(size_t)blk * 64 + t];
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t e[8], sgn[8], lo[8];
  uint32_t emin = 255u, emax = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t v = (w[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
    e[i] = (v >> 7) & 0xFFu;
    sgn[i] = v >> 15;
    lo[i] = v & 0xFFu;
    emin = min(emin, e[i]);
    emax = max(emax, e[i]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    emin = min(emin, __shfl_xor_sync(0xffffffffu, emin, off));
    emax = max(emax, __shfl_xor_sync(0xffffffffu, emax, off));
  }
  if ((t & 31) == 0) { red_min[t >> 5] = emin; red_max[t >> 5] = emax; }
  __syncthreads();
  emin = min(red_min[0], red_min[1]);
  emax = max(red_max[0], red_max[1]);
  const uint32_t base = emin & 0xFEu;
  const bool ok = emax - base <= 15u;
  uint8_t* out_b = reinterpret_cast<uint8_t*>(payload) + (size_t)blk * 1024;
  if (ok) {
    uint32_t code = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t d0 = (e[i] - base) >> 1, d1 = (e[i + 4] - base) >> 1;
      const uint32_t byte = (sgn[i] << 7) | d0 | (sgn[i + 4] << 6) | (d1 << 3);
      code |= byte << (8 * i);
    }
    reinterpret_cast<uint32_t*>(out_b)[t] = code;
    uint2 lw;
    lw.x = lo[0] | (lo[1] << 8) | (lo[2] << 16) | (lo[3] << 24);
    lw.y = lo[4] | (lo[5] << 8) | (lo[6] << 16) | (lo[7] << 24);
    reinterpret_cast<uint2*>(out_b + 256)[t] = lw;
    reinterpret_cast<uint32_t*>(out_b + 768)[t] = 0u;
  } else {
    reinterpret_cast<uint4*>(out_b)[t] = x;
  }
  if (t == 0) flags[blk] = ok ? (uint8_t)(base >> 1) : (uint8_t)0xFFu;
"""

ATTN_INPUTS = ["q", "pool", "meta", "page_table", "seq_len", "params", "scale"]
ATTN_OUTPUTS = ["o_part", "ml_part"]
REDUCE_INPUTS = ["o_part", "ml_part", "q", "k_new", "v_new", "params", "scale"]
REDUCE_OUTPUTS = ["out"]
COMPRESS_INPUTS = ["blocks"]
COMPRESS_OUTPUTS = ["flags", "payload"]

SOURCES = {
    "zipfusion_attn": (ATTN_INPUTS, ATTN_OUTPUTS, ATTN_SOURCE),
    "zipfusion_attn_pipe": (ATTN_INPUTS, ATTN_OUTPUTS, PIPE_SOURCE),
    "zipfusion_attn_ring": (ATTN_INPUTS, ATTN_OUTPUTS, RING_SOURCE),
    "zipfusion_reduce": (REDUCE_INPUTS, REDUCE_OUTPUTS, REDUCE_SOURCE),
    "zipfusion_compress": (COMPRESS_INPUTS, COMPRESS_OUTPUTS, COMPRESS_SOURCE),
}

NUM_WARPS = 4  # warps per CTA of the attention kernel; each keeps its own softmax partial
PIPE_STAGES = 3  # pages in flight per warp in the "pipe" variant (STAGES - 1 copies + 1 in use)
PIPE_HEAD_DIMS = (64, 128, 256)
RING_KB = 16  # ring bytes per warp in the "ring" variant (KiB; at least one raw page)
# Warps per CTA of the ring kernel. On GPU time (benchmarks/zipfusion.py sweeps, H200, 8K
# context): 2 warps beat 4 at every batch (B64 430-440 µs vs 527-532, three runs). 3 warps were
# faster at B64 (387 vs 409 µs: one 4-CTA wave of 512 CTAs instead of 0.65 of a 6-CTA wave) and
# equal at B8, but the only GPU test run with 3 warps had NaN outputs from the ring kernel at
# 3 of 4 test shapes (in a run whose process also ran a broken experiment, so the cause is
# not isolated): 2 stays the default until 3 passes the tests (results/zipfusion.json).
RING_NUM_WARPS = int(os.environ.get("ROTARYQUANT_ZIPFUSION_RING_WARPS", "2"))
RING_MAX_G = 8  # the ring variant puts the query heads of a group in the 8 columns of the mma
# Which attention variant runs by default ("ring", "pipe" or "simple"); the benchmark times all.
DEFAULT_VARIANT = os.environ.get("ROTARYQUANT_ZIPFUSION_VARIANT", "ring")
SM_COUNT = 132  # H100 / H200 multiprocessors (the split count aims at whole waves of CTAs)
SM_SHARED_BYTES = 227 * 1024  # shared memory one multiprocessor gives its CTAs (sm_90)
RING_REGS = 136  # registers per thread of the ring kernel, at most (nvcc -Xptxas -v; tested)


def pipe_shared_bytes(head_dim: int, num_warps: int = NUM_WARPS, stages: int = PIPE_STAGES) -> int:
    """Dynamic shared memory of the pipe variant: page slots plus their metadata."""
    slot = 2 * (head_dim // 32) * codec.RAW_BLOCK_BYTES
    return num_warps * stages * (slot + 2 * codec.meta_words(head_dim) * 4)


def ring_bytes(head_dim: int, ring_kb: int = RING_KB) -> int:
    """Ring bytes per warp: `ring_kb` KiB, at least one raw page of one head (K and V)."""
    raw_page = 2 * (head_dim // 32) * codec.RAW_BLOCK_BYTES
    return max(ring_kb * 1024, raw_page)


def ring_max_queued(head_dim: int, ring_kb: int = RING_KB) -> int:
    """Most pages one warp can have queued: as many all-compressed pages as fit, plus one."""
    small_page = 2 * (head_dim // 32) * codec.ZIP_BLOCK_BYTES
    return min(8, ring_bytes(head_dim, ring_kb) // small_page + 1)


def ring_shared_bytes(
    head_dim: int, num_warps: int = RING_NUM_WARPS, ring_kb: int = RING_KB
) -> int:
    """Dynamic shared memory of the ring variant: each warp's ring plus its page table."""
    table = ring_max_queued(head_dim, ring_kb) * (2 * codec.meta_words(head_dim) + 1) * 4
    return num_warps * (ring_bytes(head_dim, ring_kb) + table)


def ring_ctas_per_sm(head_dim: int, num_warps: int = RING_NUM_WARPS, ring_kb: int = RING_KB) -> int:
    """CTAs of the ring kernel one multiprocessor holds (shared memory, registers, warps)."""
    by_smem = SM_SHARED_BYTES // (ring_shared_bytes(head_dim, num_warps, ring_kb) + 1024)
    by_regs = 65536 // (RING_REGS * 32 * num_warps)
    return max(1, min(by_smem, by_regs, 64 // num_warps, 32))


def translation_unit(
    name: str, input_types: list[str], output_types: list[str], template: dict
) -> str:
    """The .cu text MLX's `cuda_kernel` generates for `name` (signature, constants, body) from
    what the kernels pass it (header included from its file, body stripped: see jit.py), with
    plain CUDA includes instead of MLX's header: for compile-only checks with nvcc."""
    inputs, outputs, body = SOURCES[name]
    params = [f"    const {t}* {n}" for t, n in zip(input_types, inputs, strict=True)]
    params += [f"    {t}* {n}" for t, n in zip(output_types, outputs, strict=True)]
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in template.items())
    return (
        "#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
        + jit.include_header(HEADER)
        + f"\n__global__ void {name}(\n"
        + ",\n".join(params)
        + ") {\n"
        + consts
        + jit.strip(body)
        + "\n}\n"
    )


# -- kernels built once at import ----------------------------------------------------------


def _cuda() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def _make_pipe(head_dim: int, num_warps: int, stages: int):
    return jit.cuda_kernel(
        name=f"zipfusion_attn_pipe_d{head_dim}_s{stages}_w{num_warps}",
        input_names=ATTN_INPUTS,
        output_names=ATTN_OUTPUTS,
        source=PIPE_SOURCE,
        header=HEADER,
        shared_memory=pipe_shared_bytes(head_dim, num_warps, stages),
    )


def _make_ring(head_dim: int, num_warps: int, ring_kb: int):
    return jit.cuda_kernel(
        name=f"zipfusion_attn_ring_d{head_dim}_r{ring_kb}_w{num_warps}",
        input_names=ATTN_INPUTS,
        output_names=ATTN_OUTPUTS,
        source=RING_SOURCE,
        header=HEADER,
        shared_memory=ring_shared_bytes(head_dim, num_warps, ring_kb),
    )


def _ring_kernel(head_dim: int, num_warps: int, ring_kb: int):
    """The ring kernel for one (head dim, warps, ring size), built on first use."""
    key = ("zipfusion_attn_ring", head_dim, num_warps, ring_kb)
    if key not in _KERNELS:
        _KERNELS[key] = _make_ring(head_dim, num_warps, ring_kb)
    return _KERNELS[key]


def _pipe_kernel(head_dim: int, num_warps: int, stages: int):
    """The pipe kernel for one (head dim, warps, stages): built at import for the defaults,
    on first use for other settings (the benchmark's sweep)."""
    key = ("zipfusion_attn_pipe", head_dim, num_warps, stages)
    if key not in _KERNELS:
        _KERNELS[key] = _make_pipe(head_dim, num_warps, stages)
    return _KERNELS[key]


_KERNELS: dict = {}
if _cuda():
    for _name, (_ins, _outs, _body) in SOURCES.items():
        if _name in ("zipfusion_attn_pipe", "zipfusion_attn_ring"):
            continue
        _KERNELS[_name] = jit.cuda_kernel(
            name=_name, input_names=_ins, output_names=_outs, source=_body, header=HEADER
        )
    # The pipe variant's shared memory depends on the head dim: one kernel (and name) per dim.
    for _d in PIPE_HEAD_DIMS:
        _KERNELS[("zipfusion_attn_pipe", _d, NUM_WARPS, PIPE_STAGES)] = _make_pipe(
            _d, NUM_WARPS, PIPE_STAGES
        )


def kernels_available() -> bool:
    return bool(_KERNELS)


def _use_kernel(use_kernel: bool | None) -> bool:
    if use_kernel is None:
        return kernels_available()
    if use_kernel and not kernels_available():
        raise RuntimeError(
            "ZipFusion's CUDA kernels need MLX's CUDA backend (mx.cuda.is_available())"
        )
    return use_kernel


# -- references ------------------------------------------------------------------------------


def gather_pages_reference(
    pool: mx.array,
    meta: mx.array,
    page_ids: mx.array,
    layer: int,
    n_ids: int,
    n_kv: int,
    head_dim: int,
) -> tuple[mx.array, mx.array]:
    """Decode pages back to BF16 with MLX ops. page_ids: [..., P] -> K, V: [..., Hkv, P*16, D]."""
    nb = codec.check_head_dim(head_dim)
    mw = codec.meta_words(head_dim)
    lead = page_ids.shape[:-1]
    n_pages = page_ids.shape[-1]
    rows = meta.reshape(-1, n_kv, 2, mw)[layer * n_ids + page_ids.reshape(-1)]  # [N, Hkv, 2, MW]
    off = rows[..., 0].astype(mx.int64)
    shifts = mx.array([0, 8, 16, 24], dtype=mx.uint32)
    fl = ((rows[..., 1:, None] >> shifts) & 0xFF).reshape(*rows.shape[:-1], -1)[..., :nb]
    sizes = mx.where(fl == codec.RAW_FLAG, 4, 3).astype(mx.int64)
    starts = off[..., None] + mx.cumsum(sizes, axis=-1) - sizes  # first row of each block
    g_rows = starts[..., None] + mx.arange(4, dtype=mx.int64)  # compressed blocks read 1 spare row
    g_rows = mx.minimum(g_rows, pool.shape[0] - 1).astype(mx.int32)
    payload = pool[g_rows.reshape(-1)].reshape(-1, codec.BLOCK_VALUES)
    vals = codec.decode_blocks(fl.reshape(-1).astype(mx.uint8), payload)
    vals = vals.reshape(-1, n_kv, 2, nb, codec.BLOCK_VALUES)
    k = codec.from_fragment_order(vals[:, :, 0], "k")  # [N, Hkv, 16, D]
    v = codec.from_fragment_order(vals[:, :, 1], "v")

    def arrange(x):
        x = x.reshape(*lead, n_pages, n_kv, codec.PAGE_TOKENS, head_dim)
        x = mx.swapaxes(x, -3, -4)  # [..., Hkv, P, 16, D]
        return x.reshape(*lead, n_kv, n_pages * codec.PAGE_TOKENS, head_dim)

    return arrange(k), arrange(v)


def paged_attention_reference(
    q, pool, meta, page_table, seq_len, k_new, v_new, layer: int, n_ids: int, scale: float
) -> mx.array:
    """Decode attention over the pages plus this step's token: pages decoded with MLX ops, then
    mlx's own SDPA (so one sequence gives the same bits as mlx-lm's KVCache).

    q: [B, Hq, D] bf16; k_new, v_new: [B, Hkv, D] bf16; returns [B, Hq, D] bf16."""
    b, hq, d = q.shape
    n_kv = k_new.shape[1]
    k, v = gather_pages_reference(pool, meta, page_table, layer, n_ids, n_kv, d)  # [B, Hkv, T0, D]
    pad = mx.zeros((b, n_kv, 1, d), k.dtype)
    k = mx.concatenate([k, pad], axis=2)
    v = mx.concatenate([v, pad], axis=2)
    pos = mx.arange(k.shape[2])[None]
    here = (pos == seq_len[:, None])[:, None, :, None]  # the new token goes right after the pages
    k = mx.where(here, k_new[:, :, None], k)
    v = mx.where(here, v_new[:, :, None], v)
    if b == 1:
        n = int(seq_len[0].item()) + 1
        mask = None
        k, v = k[:, :, :n], v[:, :, :n]
    else:
        keep = (pos <= seq_len[:, None])[:, None, :, None]  # [B, 1, T, 1]
        k = mx.where(keep, k, 0)  # slots past the end of a page hold stale bytes (maybe NaN)
        v = mx.where(keep, v, 0)
        mask = keep[..., 0][:, :, None, :]  # [B, 1, 1, T]
    out = mx.fast.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, mask=mask)
    return out[:, :, 0]


# -- launchers / public functions ----------------------------------------------------------


def compress_blocks(blocks: mx.array, use_kernel: bool | None = None) -> tuple[mx.array, mx.array]:
    """blocks: [N, 512] uint16 -> (flags [N] uint8, payload [N, 512] uint16); see codec."""
    if blocks.ndim != 2 or blocks.shape[1] != codec.BLOCK_VALUES or blocks.dtype != mx.uint16:
        raise ValueError(f"blocks must be [N, 512] uint16, got {blocks.shape} {blocks.dtype}")
    if not _use_kernel(use_kernel) or blocks.shape[0] == 0:
        return codec.encode_blocks(blocks)
    n = blocks.shape[0]
    flags, payload = _KERNELS["zipfusion_compress"](
        inputs=[blocks],
        grid=(n * 64, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(n,), (n, codec.BLOCK_VALUES)],
        output_dtypes=[mx.uint8, mx.uint16],
    )
    return flags, payload


# The kernels' small parameter arrays are made once per distinct value and reused, 8 entries
# (32 bytes) each. MLX gives an array made from host data unified memory (8 bytes or less: a pool
# shared by every such scalar, which the GPU reads remotely; more: managed pages the CPU writes
# and the GPU then reads), and each kernel here reads its parameters before anything else.
# Measured on the H200 (benchmarks/zipfusion.py, GPU clock, two runs): building them per call
# cost the reduce 8.6-14.9 µs instead of 4.4-5.8 and a whole call at B8 74-75 µs, not 64-66.
# A lone kernel reading one fresh array pays far less (results/host_arrays.json: +0.5 µs for
# 4 bytes, +0.06 µs for 32), so the cost comes from the calls' traffic on those pages (CPU
# writes while GPU reads), not the read itself; not isolated further.
# ROTARYQUANT_ZIPFUSION_FRESH_PARAMS=1 builds them per call (the benchmark's side by side).
CACHE_PARAMS = os.environ.get("ROTARYQUANT_ZIPFUSION_FRESH_PARAMS", "0") != "1"


@functools.lru_cache(maxsize=4096)
def _cached_params(values: tuple, floats: bool) -> mx.array:
    return mx.array(list(values) + [0] * (8 - len(values)), mx.float32 if floats else mx.int32)


def _params(values, floats: bool = False) -> mx.array:
    """Parameter array holding `values` (at most 8): cached unless CACHE_PARAMS is off."""
    values = tuple(float(v) if floats else int(v) for v in values)
    if CACHE_PARAMS:
        return _cached_params(values, floats)
    return mx.array(list(values), mx.float32 if floats else mx.int32)


CTA_TARGET = 4 * 132  # CTAs per launch: 4 per H100/H200 multiprocessor (the sweep may retune)


def default_splits(batch: int, n_kv: int, max_pages: int, num_warps: int = NUM_WARPS) -> int:
    """Split the context so the grid has a few CTAs per multiprocessor (flash-decoding)."""
    s = max(1, math.ceil(CTA_TARGET / max(1, batch * n_kv)))
    return int(max(1, min(s, math.ceil(max_pages / (2 * num_warps)))))


def ring_splits(
    batch: int,
    n_kv: int,
    max_pages: int,
    head_dim: int,
    num_warps: int = RING_NUM_WARPS,
    ring_kb: int = RING_KB,
    waves: float = 1.0,
) -> int:
    """Splits for the ring kernel: as many as fill `waves` whole waves of resident CTAs (no
    partly filled last wave), at least two pages per warp."""
    resident = SM_COUNT * ring_ctas_per_sm(head_dim, num_warps, ring_kb)
    s = max(1, int(resident * waves) // max(1, batch * n_kv))
    return int(max(1, min(s, math.ceil(max_pages / (2 * num_warps)))))


def launch_splits(
    variant: str,
    batch: int,
    n_kv: int,
    max_pages: int,
    head_dim: int,
    num_warps: int,
    depth: int,
    scale: float = 1.0,
) -> int:
    """The split count a variant uses by default, times `scale` (the benchmark's sweep); depth is
    the pipe variant's stages or the ring variant's KiB per warp."""
    if variant == "ring":
        return ring_splits(batch, n_kv, max_pages, head_dim, num_warps, depth or RING_KB, scale)
    return max(1, round(default_splits(batch, n_kv, max_pages, num_warps) * scale))


def paged_decode_attention(
    q: mx.array,
    pool: mx.array,
    meta: mx.array,
    page_table: mx.array,
    seq_len: mx.array,
    k_new: mx.array,
    v_new: mx.array,
    *,
    layer: int,
    n_ids: int,
    scale: float,
    n_splits: int | None = None,
    use_kernel: bool | None = None,
    variant: str | None = None,
    num_warps: int | None = None,
    stages: int | None = None,
    ring_kb: int | None = None,
    partials_only: bool = False,
) -> mx.array:
    """Attention of one new token per sequence over its pages (compressed or raw) and itself.

    q: [B, Hq, D] bf16; pool: [rows, 128] uint16; meta: [L*n_ids, Hkv*2*MW] uint32;
    page_table: [B, maxp] int32; seq_len: [B] int32; k_new, v_new: [B, Hkv, D] bf16 -> [B, Hq, D].
    partials_only (kernels only): return the attention kernel's (o_part, ml_part) without the
    reduce (reduce_partials finishes them; the benchmark times the two apart)."""
    b, hq, d = q.shape
    n_kv = k_new.shape[1]
    g = hq // n_kv
    if hq % n_kv or not 1 <= g <= 16:
        raise ValueError(
            f"ZipFusion attention needs 1..16 query heads per KV head, got {hq}/{n_kv}"
        )
    if not _use_kernel(use_kernel):
        if partials_only:
            raise ValueError("partials_only needs the CUDA kernels")
        return paged_attention_reference(
            q, pool, meta, page_table, seq_len, k_new, v_new, layer, n_ids, scale
        )
    maxp = page_table.shape[1]
    mw = codec.meta_words(d)
    variant = variant or DEFAULT_VARIANT
    if variant == "ring" and g > RING_MAX_G:
        variant = "pipe"  # more than 8 query heads per KV head: Q-as-rows layout
    if variant == "ring":
        nw = num_warps or RING_NUM_WARPS
        rk = ring_kb or RING_KB
        s = n_splits or ring_splits(b, n_kv, maxp, d, nw, rk)
    else:
        nw = num_warps or NUM_WARPS
        st = stages or PIPE_STAGES
        s = n_splits or default_splits(b, n_kv, maxp, nw)
    params = _params((layer, n_ids, maxp, s))
    sl2 = _params((scale * math.log2(math.e),), floats=True)
    if variant == "ring":
        kernel = _ring_kernel(d, nw, rk)
        template = [
            ("D", d), ("G", g), ("NW", nw), ("MW", mw),
            ("RING", ring_bytes(d, rk)), ("MAXQ", ring_max_queued(d, rk)),
        ]  # fmt: skip
    elif variant == "pipe" and d in PIPE_HEAD_DIMS:
        kernel = _pipe_kernel(d, nw, st)
        template = [("D", d), ("G", g), ("NW", nw), ("MW", mw), ("STAGES", st)]
    elif variant in ("pipe", "simple"):
        kernel = _KERNELS["zipfusion_attn"]
        template = [("D", d), ("G", g), ("NW", nw), ("MW", mw)]
    else:
        raise ValueError(f"unknown ZipFusion attention variant {variant!r}")
    o_part, ml_part = kernel(
        inputs=[q, pool, meta, page_table, seq_len, params, sl2],
        template=template,
        grid=(s * 32 * nw, n_kv, b),
        threadgroup=(32 * nw, 1, 1),
        output_shapes=[(b, n_kv, s * nw, g, d), (b, n_kv, s * nw, g, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    if partials_only:
        return o_part, ml_part
    return reduce_partials(o_part, ml_part, q, k_new, v_new, scale=scale)


def reduce_partials(
    o_part: mx.array,
    ml_part: mx.array,
    q: mx.array,
    k_new: mx.array,
    v_new: mx.array,
    *,
    scale: float,
) -> mx.array:
    """The reduce kernel alone: merges the attention kernel's per-warp partials
    (o_part [B, Hkv, P, G, D], ml_part [B, Hkv, P, G, 2]) with the new token -> [B, Hq, D]."""
    b, hq, d = q.shape
    g = o_part.shape[3]
    sl2 = _params((scale * math.log2(math.e),), floats=True)
    (out,) = _KERNELS["zipfusion_reduce"](
        inputs=[o_part, ml_part, q, k_new, v_new, _params((o_part.shape[2],)), sl2],
        template=[("D", d), ("G", g), ("RW", REDUCE_WARPS)],
        grid=(32 * REDUCE_WARPS, hq, b),
        threadgroup=(32 * REDUCE_WARPS, 1, 1),
        output_shapes=[(b, hq, d)],
        output_dtypes=[mx.bfloat16],
    )
    return out
