"""The table of KV modes (app/engine/kvcache/modes.py): importable without MLX, one row per mode
read by planner, sizes, CLI, backend and the engine's make_cache; adding a mode is one row."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from app.engine import kvcache
from app.engine.kvcache import modes
from app.engine.planner import Machine, PlanRefused, make_plan
from app.engine.sizes import KVKind, sizes_for

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).parent / "data" / "configs"
RESEARCH = ("isoquant3_v1", "isoquant3_v2", "turboquant3")


def test_table_imports_without_mlx():
    code = (
        "import sys, app.engine.kvcache, app.engine.kvcache.modes as m\n"
        "assert m.names()\n"
        "bad = [k for k in ('mlx', 'mlx_lm') if k in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_rows_are_consistent_and_their_factories_resolve():
    assert kvcache.FLOAT in kvcache.MODES and kvcache.mode(kvcache.FLOAT).lossless
    for row in kvcache.MODES.values():
        module, name = row.factory.split(":")
        assert callable(getattr(importlib.import_module(module), name)), row.name
        assert set(row.backends) <= set(modes.BACKENDS)
    for auto in (modes.AUTO_LOSSLESS, modes.AUTO_COMPACT):
        assert kvcache.mode(auto).offered
    assert (
        kvcache.mode(modes.AUTO_LOSSLESS).lossless and not kvcache.mode(modes.AUTO_COMPACT).lossless
    )


def test_research_variants_are_reachable_but_not_offered():
    offered = kvcache.names(offered=True)
    assert not set(RESEARCH) & set(offered)
    assert set(RESEARCH) <= set(kvcache.names("cpu"))
    assert {"fp16", "isoquant3", "isoquant4", "isoquant_k4v3", "zipfusion"} <= set(offered)
    assert "zipfusion" not in kvcache.names("metal") and "zipfusion" in kvcache.names("cuda")
    with pytest.raises(PlanRefused, match="research variant"):
        make_plan(
            sizes_for(CONFIGS / "qwen3-8b.json"),
            Machine.simulate("64GB", "cpu"),
            kv_mode="turboquant3",
        )


def test_unknown_and_unavailable_modes_say_why():
    with pytest.raises(ValueError, match="unknown KV mode 'isoquant2'"):
        kvcache.mode("isoquant2")
    assert kvcache.unavailable_reason("isoquant3", "cpu") is None
    assert kvcache.unavailable_reason("zipfusion", "metal") == (
        "ZipFusion needs an NVIDIA GPU (MLX's CUDA backend); this machine runs on metal"
    )
    with pytest.raises(ValueError, match="already in the table"):
        kvcache.register(kvcache.mode("fp16"))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_row_bytes_follow_the_codec(d):
    dims = kvcache.AttentionDims(kv_heads=4, k_head_dim=d, v_head_dim=d)
    t = 1000
    assert kvcache.mode("fp16").nbytes(dims, t) == 1024 * 4 * 2 * d * 2  # 256-token steps
    recent = modes.DEFAULT_WINDOW
    iq3 = kvcache.mode("isoquant3").nbytes(dims, t)
    assert iq3 == (t - recent) * 4 * 2 * (d * 3 // 8 + 2) + recent * 4 * 2 * d * 2
    k4v3 = kvcache.mode("isoquant_k4v3").nbytes(dims, t)
    assert k4v3 - iq3 == (t - recent) * 4 * (d // 8)  # one more bit for each K coordinate
    zf = kvcache.mode("zipfusion").nbytes(dims, t)
    assert zf < kvcache.mode("fp16").nbytes(dims, t)


@pytest.fixture
def float_row():
    """A trivial extra mode: mlx-lm's float cache under another name, offered on every backend."""
    row = kvcache.register(
        kvcache.KVMode(
            "float_copy", "float copy", True, modes.BACKENDS, modes.float_nbytes,
            "app.engine.kvcache.modes:float_cache", description="test row",
        )
    )  # fmt: skip
    yield row
    del kvcache.MODES[row.name]


def test_one_row_adds_a_mode_everywhere(float_row, tiny_model_path):
    from mlx_lm.models.cache import KVCache

    from app.cli import build_parser
    from app.engine.backend import detect
    from app.engine.generate import Engine, GenerationSettings

    name = float_row.name
    # planner and sizes
    m = Machine.simulate("64GB", "metal")
    assert name in m.kv_modes and name in detect().kv_modes
    s = sizes_for(CONFIGS / "qwen3-8b.json")
    assert s.kv_bytes(4096, name) == s.kv_bytes(4096, "fp16")
    p = make_plan(s, m, 4096, kv_mode=name)
    assert p.kv_mode == name and p.quality()["kv"]["full"] == 2
    assert KVKind("full", 2, 4, 64, 64).nbytes(300, name) == KVKind("full", 2, 4, 64, 64).nbytes(
        300
    )
    # CLI
    args = build_parser().parse_args(["plan", "qwen3-8b", "--kv-mode", name])
    assert args.kv_mode == name
    # the engine: offered to the chat and built by make_cache
    e = Engine()
    info = e.load(tiny_model_path("llama"))
    assert name in info.kv_modes
    cache = e.make_cache(GenerationSettings(kv_mode=name))
    assert cache and all(type(c) is KVCache for c in cache) and e.last_kv_mode == name
    assert kvcache.make_cache(e.loaded.model, name, window=4)  # other modes' knobs are ignored


def test_engine_refuses_a_mode_this_backend_cannot_run(tiny_model_path):
    from app.engine.errors import EngineError
    from app.engine.generate import Engine, GenerationSettings

    e = Engine()
    e.load(tiny_model_path("llama"))
    with pytest.raises(EngineError, match="unknown KV mode 'nope'"):
        e.make_cache(GenerationSettings(kv_mode="nope"))
    cache = e.make_cache(GenerationSettings(kv_mode="isoquant3_v1"))  # research rows: reachable
    assert type(cache[0]).__name__ == "IsoQuantKVCache" and cache[0].rotation_kind == "v1"
