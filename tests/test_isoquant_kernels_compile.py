"""The CUDA kernels compile for the H200 (sm_90) with nvcc, in the translation unit MLX's
`cuda_kernel` generates from what we pass it (the stripped body, the header included from its
file), before any device time is spent. Skipped where nvcc is absent."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from app.engine.kvcache import jit
from app.engine.kvcache.isoquant import cuda_prologue as cuda
from app.engine.kvcache.isoquant import kernels as iq

NVCC = shutil.which("nvcc")
_TC = dict(
    D=128, KIND=0, CAUSAL=False, QLO=True, PLO=False, QS=False, TO="bfloat16", FOLD=True, PF=True,
    KI8=True, VSN=True, PV8=True, VIL=True,
)  # fmt: skip
CONFIGS = {
    "iq_fused_tc": [
        _TC,
        {**_TC, "VIL": False},
        {**_TC, "D": 64, "KIND": 1},
        {**_TC, "PV8": False},
        {**_TC, "PV8": False, "VIL": False},
        {**_TC, "KI8": False, "VSN": False, "PV8": False, "VIL": False},
        {**_TC, "QS": True, "FOLD": False, "PF": False, "KI8": False, "PV8": False, "VIL": False},
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
            "PV8": False,
            "VIL": False,
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
    "iq_tc16_pack": [dict(D=128), dict(D=64)],
}
_TYPES = dict(
    k_codes="uint8", v_codes="uint8", k_norms="float16", v_norms="float16", rot="float32",
    lv_k="float32", lv_v="float32", lens="int32", iparams="int32", fparams="float32",
    part_o="float32", part_m="float32", part_l="float32", sinks="float32", scores="float32",
    probs="float32", acc="float32", part="float32", q="bfloat16", k_fp="bfloat16",
    v_fp="bfloat16", add="bfloat16", x_k="bfloat16", x_v="bfloat16", thr_k="float32",
    thr_v="float32", kc="uint8", vc="uint8", kn="float16", vn="float16", counters="int32",
    old="uint8", chunks="uint8",
)  # fmt: skip


def _compile(tmp_path, names: list[str], header: str) -> dict[str, tuple[int, int, int]]:
    """Builds CONFIGS of `names` in one translation unit under `header` for sm_90: {kernel_i:
    (registers, stack frame bytes, spill store bytes)} from ptxas -v."""
    pieces = []
    for name in names:
        _, body = iq.source(name, "cuda")
        ins, outs = iq.SPECS[name]
        for i, cfg in enumerate(CONFIGS[name]):
            t = dict(_TYPES, out=cfg.get("TO", "float32"))
            tu = cuda.translation_unit(
                f"{name}_{i}", [(n, t[n]) for n in ins], [(n, t[n]) for n in outs],
                list(cfg.items()), jit.strip(body), "",
            )  # fmt: skip
            pieces.append(tu[tu.index("namespace mlx::core::cu {\n__global__") :])
    src = tmp_path / f"{names[0]}.cu"
    included = jit.include_header(cuda.HEADER + header)
    assert included.startswith("#include")  # the header MLX gets is one line
    src.write_text(cuda._MLX_STANDIN + included + "\n".join(pieces))
    r = subprocess.run(
        [NVCC, "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / f"{names[0]}.o"),
         "-Xptxas", "-v", "-diag-suppress", "177"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    out = {}
    for m in re.finditer(
        r"Function properties for \S*custom_kernel_(\w+?_\d+)E\S*\s+(\d+) bytes stack frame, "
        r"(\d+) bytes spill stores.*?Used (\d+) registers",
        r.stderr,
        re.S,
    ):
        out[m.group(1)] = (int(m.group(4)), int(m.group(2)), int(m.group(3)))
    assert len(out) == sum(len(CONFIGS[n]) for n in names), r.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit) for the compile check")
def test_cuda_kernels_compile_for_sm90_without_spills(tmp_path):
    """Every kernel builds for sm_90 as MLX builds it (each with its own header). No local
    memory at all in the scalar kernels: a struct whose address escapes (e.g. the tensor-core
    kernel's cp.async stream passed as a pointer that may be null) lives on the stack, and every
    tile then reloads and stores its pointers (measured: ~35 instructions per tile). The
    tensor-core kernel is bounded to 128 registers (4 threadgroups per SM, measured ~5% faster
    at B >= 8 than 96): its default int8 path spills a few words outside the tile loop; the fp16
    Q K^T path (a fallback for codebooks off the int8 grid, which the cache never makes) more."""
    others = [n for n in CONFIGS if n not in iq.TC_BODIES]
    for name, (_regs, frame, spill) in _compile(tmp_path, others, iq.SHARED_HEADER).items():
        assert frame == 0 and spill == 0, (name, frame, spill)
    tc = _compile(tmp_path, ["iq_fused_tc", "iq_tc16_pack"], iq.SHARED_HEADER + iq.TC_HEADER)
    for i in range(len(CONFIGS["iq_tc16_pack"])):
        assert tc[f"iq_tc16_pack_{i}"][1:] == (0, 0), tc[f"iq_tc16_pack_{i}"]
    for i, cfg in enumerate(CONFIGS["iq_fused_tc"]):
        regs, frame, spill = tc[f"iq_fused_tc_{i}"]
        assert regs <= 128, (cfg, regs)  # the launch bound holds
        if cfg["KI8"]:  # a few words in the set-up, the merge and the float walk, none in the
            # tile loop (SASS; measured 24 / 68 bytes at D 128, 16 / 24 at D 64 with the dense
            # rotation and the causal float walk)
            assert frame <= 48 and spill <= 96, (cfg, frame, spill)
        else:  # 4 n-tiles of fp32 accumulators per 32-token tile: measured 24 / 48 and 32 / 28 bytes
            assert frame <= 192 and spill <= 192, (cfg, frame, spill)
