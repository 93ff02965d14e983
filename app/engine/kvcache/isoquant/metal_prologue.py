"""Metal prologue of the IsoQuant attention kernels (bodies: isoquant_body.h).

Defines the body's macro contract with Metal's qualifiers and simdgroup built-ins, names the
thread/threadgroup indices in every body (MLX adds an attribute to the signature only when its
name appears in the body text) and builds kernels with `mx.fast.metal_kernel`.
"""

from __future__ import annotations

import mlx.core as mx

HEADER = r"""
#include <metal_stdlib>
using namespace metal;
#define IQ_FN inline
#define IQ_TG threadgroup
#define IQ_THREAD thread
#define IQ_SHARED threadgroup
#define IQ_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define IQ_WARP_SYNC() simdgroup_barrier(mem_flags::mem_threadgroup)
#define IQ_SHFL_XOR(v, m) simd_shuffle_xor((v), ushort(m))
#define IQ_SHFL(v, s) simd_shuffle((v), ushort(s))
#define IQ_EXP2(x) metal::exp2(x)
#define IQ_NEG_INF (-INFINITY)
typedef uint32_t iq_u32;
typedef uint64_t iq_u64;
"""

BODY = r"""
  const int iq_tid = int(thread_position_in_threadgroup.x);
  const int iq_bx = int(threadgroup_position_in_grid.x);
  const int iq_by = int(threadgroup_position_in_grid.y);
  const int iq_bz = int(threadgroup_position_in_grid.z);
"""


def available() -> bool:
    return bool(getattr(mx, "metal", None) and mx.metal.is_available())


def build(name: str, inputs: list[str], outputs: list[str], body: str, header: str):
    """One kernel object; `body` and `header` are the shared texts without this prologue."""
    return mx.fast.metal_kernel(
        name=name,
        input_names=inputs,
        output_names=outputs,
        source=BODY + body,
        header=HEADER + header,
        ensure_row_contiguous=False,
    )


_METAL_TYPES = {
    "uint8": "uint8_t",
    "int32": "int32_t",
    "float16": "half",
    "bfloat16": "bfloat16_t",
    "float32": "float",
}
_ATTRIBUTES = ("thread_position_in_threadgroup", "threadgroup_position_in_grid")


def translation_unit(
    name: str,
    inputs: list[tuple[str, str, int]],
    outputs: list[tuple[str, str]],
    template: list[tuple[str, object]],
    body: str,
    header: str,
) -> str:
    """The Metal source MLX generates for one kernel (mlx/fast.cpp write_signature): inputs as
    (name, dtype name, element count), template values int, bool or a dtype name; explicit
    instantiation without Metal's host_name attribute (for a C++ syntax check)."""
    src = BODY + body
    lines, idx = [], 0
    for n, dt, size in inputs:
        space = "constant" if size < 8 else "device"
        lines.append(f"  const {space} {_METAL_TYPES[dt]}* {n} [[buffer({idx})]]")
        idx += 1
        if f"{n}_strides" in src:
            lines.append(f"  const constant int64_t* {n}_strides [[buffer({idx})]]")
            idx += 1
    for n, dt in outputs:
        lines.append(f"  device {_METAL_TYPES[dt]}* {n} [[buffer({idx})]]")
        idx += 1
    lines += [f"  uint3 {a} [[{a}]]" for a in _ATTRIBUTES if a in src]

    def tval(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v) if isinstance(v, int) else _METAL_TYPES[v]

    def tkind(v):
        return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename"

    fn = f"custom_kernel_{name}"
    tparams = ", ".join(f"{tkind(v)} {k}" for k, v in template)
    targs = "<" + ", ".join(tval(v) for _, v in template) + ">"
    return (
        HEADER
        + header
        + f"template <{tparams}>\n[[kernel]] void {fn}(\n"
        + ",\n".join(lines)
        + ") {\n"
        + src
        + "\n}\n"
        + f"template decltype({fn}{targs}) {fn}{targs};\n"
    )
