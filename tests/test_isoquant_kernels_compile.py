"""The CUDA kernels compile for the H200 (sm_90) with nvcc, in the translation unit MLX's
`cuda_kernel` generates from what we pass it (the stripped body, the header included from its
file), before any device time is spent. Skipped where nvcc is absent."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from app.engine.cuda_kernels import isoquant as cuda
from app.engine.cuda_kernels import jit
from app.engine.kvcache_kernels import isoquant as iq

NVCC = shutil.which("nvcc")
_TC = dict(
    D=128, KIND=0, CAUSAL=False, QLO=True, PLO=False, QS=False, TO="bfloat16", FOLD=False, PF=True,
    KI8=True,
)  # fmt: skip
CONFIGS = {
    "iq_fused_tc": [
        _TC,
        {**_TC, "KI8": False},
        {**_TC, "QS": True, "FOLD": True, "PF": False, "KI8": False},
        {
            **_TC,
            "D": 64,
            "KIND": 2,
            "CAUSAL": True,
            "QLO": False,
            "PLO": True,
            "QS": True,
            "TO": "float32",
            "FOLD": True,
        },
    ],  # fmt: skip
    "iq_fused_scalar": [dict(D=128, RB=8, KB=3, VB=3, KIND=0, CAUSAL=False)],
    "iq_combine": [dict(D=128, KIND=0, TO="bfloat16")],
    "iq_qk_dot": [dict(D=128, RB=4, KB=3, KIND=0)],
    "iq_softmax": [dict(CAUSAL=True)],
    "iq_value_word": [dict(D=128, RB=4, VB=3)],
    "iq_value_dim": [dict(D=128, RB=4, VB=3)],
    "iq_rotate_inverse": [dict(D=128, KIND=0, ADD=True, TO="bfloat16")],
    "iq_encode": [dict(D=128, KIND=0, KB=3, VB=3, HT="float16")],
}
_TYPES = dict(
    k_codes="uint8", v_codes="uint8", k_norms="float16", v_norms="float16", rot="float32",
    lv_k="float32", lv_v="float32", lens="int32", iparams="int32", fparams="float32",
    part_o="float32", part_m="float32", part_l="float32", sinks="float32", scores="float32",
    probs="float32", acc="float32", part="float32", q="bfloat16", k_fp="bfloat16",
    v_fp="bfloat16", add="bfloat16", x_k="bfloat16", x_v="bfloat16", thr_k="float32",
    thr_v="float32", kc="uint8", vc="uint8", kn="float16", vn="float16", counters="int32",
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit) for the compile check")
def test_cuda_kernels_compile_for_sm90_without_spills(tmp_path):
    pieces = []
    for name, cfgs in CONFIGS.items():
        hdr, body = iq.source(name, "cuda")
        ins, outs = iq.SPECS[name]
        for i, cfg in enumerate(cfgs):
            t = dict(_TYPES, out=cfg.get("TO", "float32"))
            tu = cuda.translation_unit(
                f"{name}_{i}", [(n, t[n]) for n in ins], [(n, t[n]) for n in outs],
                list(cfg.items()), jit.strip(body), "",
            )  # fmt: skip
            pieces.append(tu[tu.index("namespace mlx::core::cu {\n__global__") :])
    src = tmp_path / "isoquant.cu"
    hdr = iq.SHARED_HEADER + iq.TC_HEADER
    included = jit.include_header(cuda.HEADER + hdr)
    assert included.startswith("#include")  # the header MLX gets is one line
    src.write_text(cuda._MLX_STANDIN + included + "\n".join(pieces))
    r = subprocess.run(
        [NVCC, "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o"),
         "-Xptxas", "-v", "-diag-suppress", "177"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and max(spills) == 0, r.stderr[-4000:]
    # no local memory at all: a struct whose address escapes (e.g. the tensor-core kernel's
    # cp.async stream passed as a pointer that may be null) lives on the stack, and every tile
    # then reloads and stores its pointers (measured: ~35 instructions per tile)
    frames = [int(n) for n in re.findall(r"(\d+) bytes stack frame", r.stderr)]
    assert len(frames) == len(spills) and max(frames) == 0, r.stderr[-4000:]
