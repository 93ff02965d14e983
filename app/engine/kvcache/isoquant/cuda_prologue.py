"""CUDA prologue of the IsoQuant attention kernels (bodies: isoquant_body.h and
the tensor-core twin isoquant_tc.cuh).

Defines the body's macro contract with CUDA qualifiers and warp shuffles, names the thread and
block indices in every body and builds kernels with `mx.fast.cuda_kernel`. `translation_unit`
returns the .cu text MLX would JIT-compile, with a few stand-ins for MLX's device header, so the
bodies can be compile-checked with nvcc on a machine without a GPU.
"""

from __future__ import annotations

import mlx.core as mx

from .. import jit

HEADER = r"""
#define IQ_FN __device__ __forceinline__
#define IQ_TG
#define IQ_THREAD
#define IQ_SHARED __shared__
#define IQ_BARRIER() __syncthreads()
#define IQ_WARP_SYNC() __syncwarp()
#define IQ_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define IQ_SHFL(v, s) __shfl_sync(0xffffffffu, (v), (s))
#define IQ_EXP2(x) exp2f(x)
#define IQ_NEG_INF (__int_as_float(0xff800000))
typedef uint32_t iq_u32;
typedef unsigned long long iq_u64;
// c += A (16x16, rows x k) * B (16x8, k x n), fp16 operands, fp32 accumulators (PTX fragments)
__device__ __forceinline__ void iq_mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// c += A (16x32) * B (32x8), int8 operands, int32 accumulators (PTX fragments: a0 row g, k
// 4t..4t+3; a1 row g+8; a2, a3 the same at k + 16; b0 k 4t..4t+3, b1 k + 16, column g; bytes in
// ascending k from the low byte)
__device__ __forceinline__ void iq_imma(int c[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// byte permute with PTX semantics: selector nibbles' bit 3 is the sign-replicate mode, not masked
// off (__byte_perm masks every selector with 0x7777: one more instruction per call); callers
// pass selectors whose nibbles are < 8
__device__ __forceinline__ uint32_t iq_prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}
// (x & M) | c as one LOP3 with c in a register (given two immediates ptxas emits two LOP3)
template <uint32_t M>
__device__ __forceinline__ uint32_t iq_and_or(uint32_t x, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "n"(M), "r"(c));
  return r;
}
// x << 4 that the compiler cannot fold into the operand's mask ((x & M) << 4 written in C became
// (x << 4) & (M << 4): two instructions where x & M is needed too)
__device__ __forceinline__ uint32_t iq_shl4(uint32_t x) {
  uint32_t r;
  asm("shl.b32 %0, %1, 4;" : "=r"(r) : "r"(x));
  return r;
}
// (a & M) | (c & ~M) as one LOP3 (written in C, ptxas rebuilt it from two masked operands)
template <uint32_t M>
__device__ __forceinline__ uint32_t iq_bitsel(uint32_t a, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE2;" : "=r"(r) : "r"(a), "n"(M), "r"(c));
  return r;
}
// The high 16 bits of x in both halves, on the FMA pipe instead of a shift on the integer pipe
// (the tile loop's bottleneck): an f16x2 add of nz = -0 in both halves to x's high half swizzled
// into both (HADD2 with .H1_H1), which returns every non-NaN fp16 bit pattern unchanged,
// subnormals included (no .ftz). Callers pass selector words whose high halves are never NaN
// (exponent bits not all ones) and nz from a register ptxas cannot fold (it would drop the add).
__device__ __forceinline__ uint32_t iq_hi16(uint32_t x, uint32_t nz) {
  uint32_t r;
  asm("{\n .reg .b16 l, h;\n .reg .b32 hh;\n mov.b32 {l, h}, %1;\n mov.b32 hh, {h, h};\n"
      " add.rn.f16x2 %0, hh, %2;\n}" : "=r"(r) : "r"(x), "r"(nz));
  return r;
}
// -0 in both fp16 halves (iq_hi16's nz), from an asm ptxas does not see through
__device__ __forceinline__ uint32_t iq_neg_zero2() {
  uint32_t r;
  asm volatile("mov.b32 %0, 0x80008000;" : "=r"(r));
  return r;
}
// a hint: the 128-byte line at p into L1 (and L2)
__device__ __forceinline__ void iq_prefetch(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}
// 2^x without exp2f's subnormal-result path (4 more instructions): results below 2^-126 are 0
__device__ __forceinline__ float iq_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// the 32-bit shared-memory address of a pointer into shared memory
__device__ __forceinline__ uint32_t iq_smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// loads from a 32-bit shared address (volatile: ordered after the cp.async waits and warp syncs)
__device__ __forceinline__ uint32_t iq_lds32(uint32_t s) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(s));
  return v;
}
__device__ __forceinline__ uint2 iq_lds64(uint32_t s) {  // s 8-byte aligned
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(s));
  return v;
}
__device__ __forceinline__ uint32_t iq_lds16(uint32_t s) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(s));
  return v;
}
// 16-byte global -> shared copy (to shared address s) that completes asynchronously; bytes < 16
// zero-fill the rest
__device__ __forceinline__ void iq_cp_async16s(uint32_t s, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void iq_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void iq_cp_wait_all_but() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
"""

BODY = r"""
  const int iq_tid = int(threadIdx.x);
  const int iq_bx = int(blockIdx.x);
  const int iq_by = int(blockIdx.y);
  const int iq_bz = int(blockIdx.z);
"""

# What MLX's generated .cu provides before the header (mlx/backend/cuda/device/utils.cuh).
_MLX_STANDIN = r"""
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""

_CUDA_TYPES = {
    "uint8": "uint8_t",
    "int32": "int32_t",
    "uint32": "uint32_t",
    "int64": "int64_t",
    "uint64": "uint64_t",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
}


def available() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def build(name: str, inputs: list[str], outputs: list[str], body: str, header: str):
    """A kernel object called with `template=`: its values baked into one kernel per template
    (jit.BakedKernel), or MLX's per-call templates with ROTARYQUANT_CUDA_BAKE=0."""
    if jit.bake():
        return jit.BakedKernel(
            name, inputs, outputs, BODY + body, HEADER + header, ensure_row_contiguous=False
        )
    return jit.cuda_kernel(
        name, inputs, outputs, BODY + body, HEADER + header, ensure_row_contiguous=False
    )


def translation_unit(
    name: str,
    inputs: list[tuple[str, str]],
    outputs: list[tuple[str, str]],
    template: list[tuple[str, object]],
    body: str,
    header: str,
    standin: str = _MLX_STANDIN,
    prologue: str = HEADER,
) -> str:
    """The .cu text MLX generates for one kernel (inputs/outputs as (name, dtype name); template
    values int, bool or a dtype name), with stand-ins for MLX's includes (`standin`; the CPU
    emulator in tests passes its own, and its own `prologue`)."""
    params = []
    for n, dt in inputs:
        params.append(f"    const {_CUDA_TYPES[dt]}* {n}")
        if f"{n}_strides" in body:
            params.append(f"    const __grid_constant__ Strides {n}_strides")
    params += [f"    {_CUDA_TYPES[dt]}* {n}" for n, dt in outputs]
    consts = []
    for k, v in template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {k} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {k} = {v};")
        else:
            consts.append(f"  using {k} = {_CUDA_TYPES[v]};")
    return (
        standin
        + prologue
        + header
        + "namespace mlx::core::cu {\n__global__ void custom_kernel_"
        + name
        + "(\n"
        + ",\n".join(params)
        + ") {\n"
        + "\n".join(consts)
        + "\n"
        + BODY
        + body
        + "\n}\n}\n"
    )
