"""Runs the IsoQuant CUDA kernel bodies on the CPU through tests/cuda_emu/emu.h.

`EmuKernel` has the call signature of an `mx.fast.cuda_kernel` object, so tests can put it in
place of the built kernels and drive the real launchers (split plans, combine, fallbacks).
Each (kernel, template, dtypes) compiles once per session with g++ into a cache folder; inputs
and outputs travel as raw files. The generated signature is kvcache.isoquant.cuda_prologue's
`translation_unit`, i.e. what MLX compiles on the GPU.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from app.engine.kvcache.isoquant import cuda_prologue as cp

EMU_DIR = Path(__file__).parent
_CACHE = Path(tempfile.gettempdir()) / f"iq_emu_{os.getuid()}"
_DT = {
    mx.uint8: "uint8",
    mx.int32: "int32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
    mx.float32: "float32",
}
_CT = {
    "uint8": "uint8_t",
    "int32": "int32_t",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
}
# The CUDA prologue without its inline-PTX mma (emu.h provides iq_mma).
_PROLOGUE = cp.HEADER.split("// c += A")[0]


def gxx() -> str | None:
    return shutil.which("g++")


def _raw(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _from_raw(buf: bytes, shape, dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(buf, np.uint16).reshape(shape)).view(mx.bfloat16)
    npdt = {mx.float16: np.float16, mx.float32: np.float32, mx.int32: np.int32, mx.uint8: np.uint8}[
        dtype
    ]
    return mx.array(np.frombuffer(buf, npdt).reshape(shape))


class EmuKernel:
    # inputs passed one element past a 16-byte boundary (the kernels' paths for unaligned rows)
    misalign: frozenset[str] = frozenset()

    def __init__(self, name: str, inputs: list[str], outputs: list[str], body: str, header: str):
        self.name, self.inputs, self.outputs, self.body, self.header = (
            name,
            inputs,
            outputs,
            body,
            header,
        )

    def _binary(self, in_dt: list[str], out_dt: list[str], template) -> Path:
        tmpl = [(k, _DT[v] if isinstance(v, mx.Dtype) else v) for k, v in template]
        tu = cp.translation_unit(
            self.name, list(zip(self.inputs, in_dt, strict=True)), list(zip(self.outputs, out_dt, strict=True)), tmpl,
            self.body, self.header, standin='#include "emu.h"\n', prologue=_PROLOGUE,
        )  # fmt: skip
        src = tu + self._main(in_dt, out_dt)
        # the binary's name covers emu.h too: a changed emulator must rebuild it
        key = hashlib.sha256(src.encode() + (EMU_DIR / "emu.h").read_bytes()).hexdigest()[:20]
        exe = _CACHE / f"{self.name}_{key}"
        if not exe.exists():
            _CACHE.mkdir(parents=True, exist_ok=True)
            cpp = exe.with_suffix(".cpp")
            cpp.write_text(src)
            cmd = [
                gxx(),
                "-std=c++20",
                "-O1",
                "-pthread",
                "-w",
                f"-I{EMU_DIR}",
                "-o",
                str(exe) + ".tmp",
                str(cpp),
            ]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.replace(str(exe) + ".tmp", exe)
        return exe

    def _main(self, in_dt, out_dt) -> str:
        strided = [f"{n}_strides" in self.body for n in self.inputs]
        lines = [
            "#include <cstdio>\n#include <fstream>\n#include <iterator>\n#include <string>",
            "static std::vector<char> rd(const std::string& p) {",
            "  std::ifstream f(p, std::ios::binary);",
            "  return std::vector<char>(std::istreambuf_iterator<char>(f), {});",
            "}",
            "int main(int argc, char** argv) {",
            "  std::string dir = argv[1];",
            '  std::ifstream pf(dir + "/params.txt");',
            "  unsigned gx, gy, gz; int nt; pf >> gx >> gy >> gz >> nt;",
        ]
        args = []
        for i, dt in enumerate(in_dt):
            lines.append(f'  auto in{i} = rd(dir + "/in{i}.bin");')
            if self.inputs[i] in self.misalign:  # vector data is 16-byte aligned
                lines.append(f"  std::vector<char> mis{i}(in{i}.size() + 16);")
                lines.append(
                    f"  std::memcpy(mis{i}.data() + sizeof({_CT[dt]}), in{i}.data(), in{i}.size());"
                )
                args.append(f"(const {_CT[dt]}*)(mis{i}.data() + sizeof({_CT[dt]}))")
            else:
                args.append(f"(const {_CT[dt]}*)in{i}.data()")
            if strided[i]:
                lines.append(
                    f"  mlx::core::cu::Strides st{i}{{}}; for (int k = 0; k < 10; ++k) pf >> st{i}[k];"
                )
                args.append(f"st{i}")
        for i, dt in enumerate(out_dt):
            lines.append(f"  size_t nb{i}; pf >> nb{i}; std::vector<char> out{i}(nb{i});")
            lines.append(f"  std::memset(out{i}.data(), 0xFF, nb{i});  // poison: unwritten -> NaN")
            args.append(f"({_CT[dt]}*)out{i}.data()")
        lines.append(
            f"  emu_launch(gx, gy, gz, nt, [&] {{ mlx::core::cu::custom_kernel_{self.name}({', '.join(args)}); }});"
        )
        for i in range(len(out_dt)):
            lines.append(
                f'  {{ std::ofstream f(dir + "/out{i}.bin", std::ios::binary); f.write(out{i}.data(), nb{i}); }}'
            )
        lines.append("  return 0;\n}\n")
        return "\n".join(lines)

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        in_dt = [_DT[a.dtype] for a in inputs]
        out_dt = [_DT[d] for d in output_dtypes]
        exe = self._binary(in_dt, out_dt, template)
        nt = threadgroup[0] * threadgroup[1] * threadgroup[2]
        blocks = [-(-g // t) for g, t in zip(grid, threadgroup, strict=True)]
        with tempfile.TemporaryDirectory() as d:
            params = [*blocks, nt]
            for i, a in enumerate(inputs):
                mx.eval(a)
                Path(d, f"in{i}.bin").write_bytes(_raw(a))
                if f"{self.inputs[i]}_strides" in self.body:
                    st, acc = [], 1
                    for n in reversed(a.shape):
                        st.append(acc)
                        acc *= n
                    params += (st[::-1] + [0] * 10)[:10]
            for shape, dt in zip(output_shapes, output_dtypes, strict=True):
                params.append(int(np.prod(shape)) * dt.size)
            Path(d, "params.txt").write_text(" ".join(str(v) for v in params))
            subprocess.run([str(exe), d], check=True, capture_output=True)
            return [
                _from_raw(Path(d, f"out{i}.bin").read_bytes(), shape, dt)
                for i, (shape, dt) in enumerate(zip(output_shapes, output_dtypes, strict=True))
            ]
