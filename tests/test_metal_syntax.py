"""The Metal kernel bodies, with the Metal prologue and the signature MLX generates, compile as
C++ against a stand-in for Metal's standard library (tests/metal_shim). No Mac is needed: this
catches syntax, name and type errors in the shared bodies; their logic is checked by the CUDA
twin (tests/test_isoquant_kernels.py, tests/gpu/test_isoquant_gpu.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from app.engine.kvcache.isoquant import kernels as iq
from app.engine.kvcache.isoquant import metal_prologue as metal

SHIM = Path(__file__).parent / "metal_shim"

# (kernel, template) pairs covering every head dim, bit width, rotation kind and flag
CONFIGS = {
    "iq_fused_scalar": [
        dict(D=64, RB=8, KB=3, VB=3, KIND=0, CAUSAL=False),
        dict(D=128, RB=8, KB=4, VB=3, KIND=1, CAUSAL=True),
        dict(D=256, RB=4, KB=3, VB=4, KIND=2, CAUSAL=False),
        dict(D=512, RB=2, KB=4, VB=4, KIND=0, CAUSAL=True),
    ],
    "iq_combine": [dict(D=64, KIND=0, TO="float16"), dict(D=512, KIND=2, TO="bfloat16")],
    "iq_qk_dot": [dict(D=128, RB=4, KB=3, KIND=0), dict(D=256, RB=1, KB=4, KIND=2)],
    "iq_softmax": [dict(CAUSAL=True), dict(CAUSAL=False)],
    "iq_value_word": [dict(D=128, RB=4, VB=3), dict(D=512, RB=1, VB=4)],
    "iq_value_dim": [dict(D=64, RB=2, VB=4), dict(D=256, RB=4, VB=3)],
    "iq_rotate_inverse": [
        dict(D=128, KIND=0, ADD=True, TO="bfloat16"),
        dict(D=64, KIND=1, ADD=False, TO="float32"),
    ],
    "iq_encode": [
        dict(D=128, KIND=0, KB=3, VB=3, HT="float16"),
        dict(D=512, KIND=2, KB=4, VB=3, HT="float16"),
    ],
}
_TYPES = dict(
    k_codes="uint8", v_codes="uint8", k_norms="float16", v_norms="float16", rot="float32",
    lv_k="float32", lv_v="float32", lens="int32", iparams="int32", fparams="float32",
    part_o="float32", part_m="float32", part_l="float32", sinks="float32", scores="float32",
    probs="float32", acc="float32", part="float32", thr_k="float32", thr_v="float32",
    kc="uint8", vc="uint8", kn="float16", vn="float16",
)  # fmt: skip


def _io(name: str, cfg: dict, dtype: str, size: int):
    ins, outs = iq.SPECS[name]
    t = dict(_TYPES, q=dtype, k_fp=dtype, v_fp=dtype, add=dtype, x_k=dtype, x_v=dtype)
    t["out"] = cfg.get("TO", "float32")
    return [(n, t[n], size) for n in ins], [(n, t[n]) for n in outs]


def _unit() -> str:
    parts = [metal.HEADER, iq.SHARED_HEADER]
    for name, cfgs in CONFIGS.items():
        _, body = iq.source(name, "metal")
        for i, cfg in enumerate(cfgs):
            # alternate device / constant inputs (MLX passes arrays under 8 elements as constant)
            ins, outs = _io(
                name, cfg, ("float16", "bfloat16", "float32")[i % 3], 100 if i % 2 else 4
            )
            tu = metal.translation_unit(f"{name}_{i}", ins, outs, list(cfg.items()), body, "")
            parts.append(tu[len(metal.HEADER) :])
    return "\n".join(parts)


def test_shared_bodies_name_no_backend_builtins():
    # Backend words live in the prologues only; the bodies use the IQ_* macros.
    cuda_words = r"__shfl|__syncthreads|__syncwarp|threadIdx|blockIdx|__shared__|__device__"
    metal_words = r"simd_shuffle|threadgroup_barrier|thread_position|threadgroup float"
    text = re.sub(r"//[^\n]*", "", iq.BODY_PATH.read_text())  # code only
    assert not re.search(cuda_words, text)
    assert not re.search(metal_words, text)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the C++ syntax check")
def test_metal_bodies_compile_as_cpp_against_the_shim(tmp_path):
    src = tmp_path / "isoquant_metal.cpp"
    src.write_text(_unit())
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-attributes",
           "-Wno-unused-variable", "-Werror", f"-I{SHIM}", "-x", "c++", str(src)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the C++ syntax check")
def test_the_syntax_check_catches_an_error(tmp_path):
    bad = _unit().replace("iq_warp_sum(l[r])", "iq_warp_sum(l[r], 1)", 1)
    src = tmp_path / "bad.cpp"
    src.write_text(bad)
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wno-attributes", f"-I{SHIM}",
                        "-x", "c++", str(src)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode != 0 and "iq_warp_sum" in r.stderr
