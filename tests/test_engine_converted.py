"""The engine on converted folders (experts in per-expert records) and with the auto-plan."""

import pytest

from app.engine.errors import EngineError
from app.engine.generate import Engine, GenerationSettings, TokenEvent
from app.engine.quant.convert import convert
from app.engine.quant.hf_layout import to_hf_layout


@pytest.fixture(scope="module")
def converted(tiny_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    hf = to_hf_layout(tiny_model_path("qwen3_moe"), root / "hf")
    convert(hf, root / "rq", "dense=4,routed=2,shared=8", check_disk=False)
    return root / "rq"


def _tokens(e: Engine, n=12):
    return [
        ev.token
        for ev in e.generate("Hello, world!", GenerationSettings(max_tokens=n, kv_mode="fp16"))
        if isinstance(ev, TokenEvent) and ev.token >= 0
    ]


def test_converted_folder_loads_resident(converted):
    e = Engine()
    info = e.load(converted)
    assert info.architecture == "qwen3_moe"
    assert len(_tokens(e)) > 0


def test_plan_is_applied_and_reported(converted):
    e = Engine()
    info = e.load(converted, {"plan": True})
    plan = info.extra["plan"]
    assert plan is not None and plan["reasons"]
    assert plan["attention_share"]["measured"]  # profiled on this machine, not estimated
    assert info.extra["default_kv_mode"] == plan["kv_modes"].get("full", "fp16")
    # the tiny model fits any machine: nothing is paged
    assert plan["paging"] is False and info.extra["expert_budget"] is None


def test_expert_budget_needs_a_converted_model(tiny_model_path):
    with pytest.raises(EngineError, match="converted MoE model"):
        Engine().load(tiny_model_path("qwen3_moe"), {"expert_budget": 1 << 20})
