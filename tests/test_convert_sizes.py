"""The converter's measured bytes per role equal the size calculator's (`app.engine.sizes`,
from config.json alone) on every tiny architecture, and one expert record holds exactly the
calculator's bytes per expert."""

import json

import pytest

from app.engine import sizes
from app.engine.quant.convert import convert
from app.engine.quant.widths import ROLES, RoleWidths
from app.engine.testing.random_models import TINY_CONFIGS, make_random_model
from app.engine.testing.tiny import EXTRA_TINY_CONFIGS

CONFIGS = {**TINY_CONFIGS, **EXTRA_TINY_CONFIGS}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("spec", ["", "routed=3,shared=4/32"])
def test_converter_bytes_equal_size_calculator(tmp_path, name, spec):
    # bf16: the calculator counts 2-byte scales and biases, as a bf16 checkpoint gets
    src = make_random_model(CONFIGS[name], tmp_path / "src", seed=2, dtype="bfloat16")
    widths = RoleWidths.parse(spec)
    man = convert(src, tmp_path / "out", widths=widths)
    want = sizes.compute(json.loads((src / "config.json").read_text()), widths)
    for r in ROLES:
        assert man.roles[r]["params"] == want.params[r], r
        assert man.roles[r]["bytes"] == want.bytes[r], r
    if man.experts:
        for lay in man.experts["layers"].values():
            assert sum(t["nbytes"] for t in lay["tensors"]) == want.bytes_per_expert
        assert len(man.experts["layers"]) == want.moe_layers
