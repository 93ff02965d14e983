"""Role rules per architecture, the quantization predicate, and streamed kurtosis."""

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import _get_classes

from app.engine.errors import UnsupportedArchitectureError
from app.engine.quant.moments import Moments
from app.engine.quant.roles import (
    RULES,
    check_structure,
    expert_modules,
    param_roles,
    plan_params,
    role_predicate,
    rules_for,
)
from app.engine.quant.widths import ROLES, RoleWidth, RoleWidths
from app.engine.testing.random_models import TINY_CONFIGS
from app.engine.testing.tiny import EXTRA_TINY_CONFIGS

CONFIGS = {**TINY_CONFIGS, **EXTRA_TINY_CONFIGS}


def _model(name):
    cfg = CONFIGS[name]
    cls, args = _get_classes(cfg)
    return cls(args.from_dict(cfg)), cfg["model_type"]


# (config, parameter, role): one line per rule the SPEC names
EXPECTED = [
    ("qwen3_moe", "model.layers.1.mlp.switch_mlp.gate_proj.weight", "routed"),
    ("qwen3_moe", "model.layers.1.mlp.gate.weight", "keep_float"),
    ("qwen3_moe", "model.layers.1.self_attn.q_proj.weight", "dense"),
    ("qwen3_moe", "model.layers.1.self_attn.q_norm.weight", "keep_float"),
    ("qwen3_moe", "model.embed_tokens.weight", "dense"),
    ("qwen3_moe", "lm_head.weight", "dense"),
    ("qwen3_moe", "model.norm.weight", "keep_float"),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert.down_proj.weight", "shared"),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", "keep_float"),
    ("qwen2_moe", "model.layers.0.self_attn.q_proj.bias", "keep_float"),
    ("nemotron_h", "backbone.layers.0.mixer.in_proj.weight", "dense"),
    ("nemotron_h", "backbone.layers.0.mixer.out_proj.weight", "dense"),
    ("nemotron_h", "backbone.layers.0.mixer.A_log", "keep_float"),
    ("nemotron_h", "backbone.layers.0.mixer.D", "keep_float"),
    ("nemotron_h", "backbone.layers.0.mixer.dt_bias", "keep_float"),
    ("nemotron_h", "backbone.layers.0.mixer.conv1d.weight", "keep_float"),
    ("nemotron_h", "backbone.layers.1.mixer.switch_mlp.fc1.weight", "routed"),
    ("nemotron_h", "backbone.layers.1.mixer.shared_experts.up_proj.weight", "shared"),
    ("nemotron_h", "backbone.layers.1.mixer.gate.weight", "keep_float"),
    ("nemotron_h", "backbone.layers.1.mixer.gate.e_score_correction_bias", "keep_float"),
    ("nemotron_h_latent", "backbone.layers.1.mixer.fc1_latent_proj.weight", "dense"),
    ("nemotron_h_latent", "backbone.layers.1.mixer.fc2_latent_proj.weight", "dense"),
    ("nemotron_h_latent", "backbone.layers.1.mixer.switch_mlp.fc2.weight", "routed"),
    ("gemma4_text", "model.layers.0.experts.switch_glu.up_proj.weight", "routed"),
    ("gemma4_text", "model.layers.0.router.proj.weight", "keep_float"),
    ("gemma4_text", "model.layers.0.router.per_expert_scale", "keep_float"),
    ("gemma4_text", "model.layers.0.mlp.gate_proj.weight", "dense"),
    ("gpt_oss", "model.layers.0.mlp.experts.gate_proj.weight", "routed"),
    ("gpt_oss", "model.layers.0.mlp.experts.gate_proj.bias", "keep_float"),
    ("gpt_oss", "model.layers.0.mlp.router.weight", "keep_float"),
    ("gpt_oss", "model.layers.0.self_attn.sinks", "keep_float"),
    ("mixtral", "model.layers.0.block_sparse_moe.switch_mlp.down_proj.weight", "routed"),
    ("mixtral", "model.layers.0.block_sparse_moe.gate.weight", "keep_float"),
    ("deepseek_v3", "model.layers.0.mlp.gate_proj.weight", "dense"),  # first_k_dense_replace
    ("deepseek_v3", "model.layers.1.mlp.switch_mlp.up_proj.weight", "routed"),
    ("deepseek_v3", "model.layers.1.mlp.shared_experts.up_proj.weight", "shared"),
    ("deepseek_v3", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "dense"),
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight", "dense"),
    ("qwen3_next", "model.layers.0.linear_attn.A_log", "keep_float"),
    ("qwen3_next", "model.layers.0.mlp.shared_expert.gate_proj.weight", "shared"),
    ("qwen3_5_moe", "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight", "routed"),
    ("qwen3_5_moe", "language_model.model.layers.0.mlp.shared_expert_gate.weight", "keep_float"),
    ("llama", "model.layers.0.mlp.down_proj.weight", "dense"),
]


@pytest.mark.parametrize("name,param,role", EXPECTED)
def test_role_of_named_parameters(name, param, role):
    model, mt = _model(name)
    roles = param_roles(model, mt)
    assert param in roles, param
    assert roles[param] == role


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_parameter_has_a_role_and_experts_are_found(name):
    model, mt = _model(name)
    plans = plan_params(model, mt)
    by_role = {}
    for p in plans:
        by_role[p.role] = by_role.get(p.role, 0) + p.params
        if p.width is not None:  # quantized params are matrices of quantizable modules
            assert len(p.shape) >= 2 and p.name.endswith(".weight")
        if p.name.endswith((".bias", "norm.weight")):
            assert p.role == "keep_float", p.name
    mods = expert_modules(model, mt)
    assert bool(mods) == rules_for(mt).has_experts
    assert by_role.get("routed", 0) > 0 if mods else "routed" not in by_role
    for mod, projs in mods.items():
        assert projs in (["down_proj", "gate_proj", "up_proj"], ["fc1", "fc2"]), (mod, projs)


def test_unknown_architecture_is_an_error():
    with pytest.raises(
        UnsupportedArchitectureError,
        match="no role rules for architecture 'falcon_mamba'.*qwen3_moe",
    ):
        rules_for("falcon_mamba")


def test_expert_layer_outside_the_rules_is_an_error():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = SwitchLinear(8, 8, 4)  # not where qwen3_moe keeps its experts

    with pytest.raises(UnsupportedArchitectureError, match="not covered by the role rules"):
        check_structure(Block(), "qwen3_moe")


def test_predicate_widths_and_fallbacks():
    pred = role_predicate("qwen2_moe", RoleWidths().with_bits(routed=3))
    assert pred("model.layers.0.mlp.switch_mlp.up_proj", SwitchLinear(128, 64, 8)) == {
        "group_size": 64,
        "bits": 3,
        "mode": "affine",
    }
    assert pred("model.layers.0.mlp.shared_expert.up_proj", nn.Linear(128, 64))["bits"] == 8
    assert pred("model.layers.0.self_attn.o_proj", nn.Linear(128, 128))["bits"] == 4
    assert pred("model.layers.0.mlp.gate", nn.Linear(128, 8)) is False  # router
    assert pred("model.layers.0.self_attn.o_proj", nn.Linear(96, 128)) is False  # 96 % 64
    assert pred("model.norm", nn.RMSNorm(128)) is False
    assert (
        role_predicate("llama", RoleWidths(dense=RoleWidth(None)))(
            "model.layers.0.mlp.up_proj", nn.Linear(128, 64)
        )
        is False
    )


def test_param_plan_bytes_match_mlx_quantize():
    model, mt = _model("qwen2_moe")
    for p in plan_params(model, mt):
        if p.width is None:
            continue
        w = mx.zeros(p.shape, dtype=mx.bfloat16)
        got = sum(a.nbytes for a in mx.quantize(w, p.width.group_size, p.width.bits))
        assert p.nbytes(2) == got, p.name


def test_widths_parse():
    w = RoleWidths.parse("dense=4, routed=3/32, shared=float")
    assert (w.routed.bits, w.routed.group_size, w.shared.bits, w.dense.bits) == (3, 32, None, 4)
    with pytest.raises(ValueError, match="unknown role 'experts'"):
        RoleWidths.parse("experts=2")


def test_all_rule_sets_are_consistent():
    for mt, r in RULES.items():
        assert r.model_type == mt
        assert r.hf_experts in ("none", "per_expert", "fused", "gpt_oss")
        assert (r.hf_experts == "none") == (not r.experts)


def _np_kurtosis(x):
    x = x.astype(np.float64)
    d = x - x.mean()
    return (d**4).mean() / (d**2).mean() ** 2 - 3


@pytest.mark.parametrize("dist", ["normal", "laplace", "uniform", "shifted"])
def test_streamed_kurtosis_equals_direct(dist):
    rng = np.random.default_rng(1)
    n = 100_003
    x = {
        "normal": rng.standard_normal(n),
        "laplace": rng.laplace(size=n),
        "uniform": rng.uniform(-1, 1, n),
        "shifted": 5 + 0.01 * rng.standard_normal(n),
    }[dist]
    x = x.astype(np.float32)
    m = Moments()
    for part in np.array_split(x, 7):  # uneven blocks, merged
        m.merge(Moments().add(mx.array(part)))
    want = _np_kurtosis(x)
    assert math.isclose(m.excess_kurtosis, want, rel_tol=1e-3, abs_tol=2e-3)
    assert m.n == n
    expected = {"normal": 0.0, "laplace": 3.0, "uniform": -1.2, "shifted": 0.0}[dist]
    assert abs(m.excess_kurtosis - expected) < 0.15


REAL_CONFIGS = sorted((Path(__file__).parent / "data" / "configs").glob("*.json"))


@pytest.mark.parametrize("path", REAL_CONFIGS, ids=lambda p: p.stem)
def test_real_configs_roles_agree_with_size_calculator(path):
    """Real-shaped models built lazily from the release configs (nothing allocated): the role
    plan gives the size calculator's parameters and bytes for every role."""
    from app.engine import sizes

    cfg = json.loads(path.read_text())
    cls, args = _get_classes(cfg)
    model = cls(args.from_dict(cfg))
    params, nbytes = dict.fromkeys(ROLES, 0), dict.fromkeys(ROLES, 0)
    for p in plan_params(model, cfg["model_type"]):
        params[p.role] += p.params
        nbytes[p.role] += p.nbytes(2)
    want = sizes.compute(cfg)
    assert params == want.params and nbytes == want.bytes
    if want.moe_layers:  # SPEC §2: routed experts are 90%+ of an MoE model's parameters
        assert params["routed"] / sum(params.values()) > 0.9
