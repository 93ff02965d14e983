"""The size calculator (app/engine/sizes.py) against built models and published totals."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from app.engine import sizes
from app.engine.quant.widths import ROLES, RoleWidths
from app.engine.testing.random_models import TINY_CONFIGS

CONFIGS = Path(__file__).parent / "data" / "configs"

# Parameter totals from tests/data/configs/README.md (matrices + embeddings, text only, MTP
# excluded), and vendors' published figures for the two architectures without a config file.
PUBLISHED = {
    "qwen3-30b-a3b": (30.5e9, 3.35e9),
    "gemma-4-26b-a4b-it": (25.2e9, 3.8e9),
    "nemotron-3-super-120b-a12b": (120.7e9, 12.8e9),
    "nemotron-3-nano-30b-a3b": (31.6e9, 3.6e9),
    "gpt-oss-120b": (116.8e9, 5.7e9),
    "gpt-oss-20b": (20.9e9, 4.2e9),
    "qwen3-next-80b-a3b": (79.7e9, 3.9e9),
    "qwen3.5-35b-a3b": (34.7e9, 3.45e9),
    "llama-3.1-8b": (8.03e9, 8.03e9),
    "qwen3-8b": (8.19e9, 8.19e9),
}

MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}  # published: 46.7B total, 12.9B active
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}  # published: 671B main model + 14B MTP module, 37B active

# Tiny configs for architectures that random_models has no preset for.
EXTRA_TINY = {
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": 1000,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    },
    "mixtral": {
        "model_type": "mixtral",
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 2,
        "n_routed_experts": 8,
        "kv_lora_rank": 64,
        "q_lora_rank": 96,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "qk_nope_head_dim": 64,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 128,
        "mlp_only_layers": [1],
        "moe_intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": 1000,
        "num_key_value_heads": 2,
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
        "head_dim": 64,
        "full_attention_interval": 2,
    },
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 128,
            "moe_intermediate_size": 64,
            "vocab_size": 1000,
            "full_attention_interval": 4,
            "mtp_num_hidden_layers": 1,
        },
        "vision_config": {"depth": 2},
    },
    # Nemotron 3 Super's latent MoE and a dense MLP block, in miniature.
    "nemotron_h_latent": {
        **TINY_CONFIGS["nemotron_h"],
        "hybrid_override_pattern": "ME*E-M",
        "moe_latent_size": 64,
        "mtp_hybrid_override_pattern": "*E",
        "num_nextn_predict_layers": 1,
    },
}
TINY_ALL = {
    **{
        k: TINY_CONFIGS[k]
        for k in ("qwen3_moe", "qwen2_moe", "nemotron_h", "gemma4_text", "gpt_oss", "llama")
    },
    **EXTRA_TINY,
}


def role_by_name(name: str) -> str:
    """An independent rule by parameter name, as the converter sees mlx-lm's names."""
    leaf = name.rsplit(".", 1)[-1]
    if any(s in name for s in ("switch_mlp", "switch_glu", "mlp.experts.")):
        return "keep_float" if leaf == "bias" else "routed"
    if "shared_expert_gate" in name:
        return "keep_float"
    if "shared_expert" in name:
        return "keep_float" if leaf == "bias" else "shared"
    keep_leaves = (
        "bias",
        "A_log",
        "D",
        "dt_bias",
        "sinks",
        "e_score_correction_bias",
        "layer_scalar",
        "scale",
        "per_expert_scale",
    )
    if (
        leaf in keep_leaves
        or "norm" in name
        or "conv1d" in name
        or "router" in name
        or ".gate." in name
    ):
        return "keep_float"
    return "dense"


def build(config: dict, dtype=mx.float32):
    model_cls, args_cls = _get_classes(dict(config))
    model = model_cls(args_cls.from_dict(dict(config)))
    model.set_dtype(dtype)
    return model


def params_by_role(model) -> dict:
    out = dict.fromkeys(ROLES, 0)
    for name, p in tree_flatten(model.parameters()):
        out[role_by_name(name)] += p.size
    return out


@pytest.mark.parametrize("arch", sorted(TINY_ALL))
def test_role_params_equal_the_built_model(arch):
    config = TINY_ALL[arch]
    s = sizes.compute(config)
    assert s.params == params_by_role(build(config))
    assert s.total_params == sum(s.params.values())


@pytest.mark.parametrize(
    "arch", ["qwen3_moe", "nemotron_h", "gpt_oss", "gemma4_text", "deepseek_v3"]
)
def test_role_bytes_equal_the_quantized_model(arch):
    """Quantize the built model by role (SPEC §2 widths) and compare bytes per role."""
    config = TINY_ALL[arch]
    widths = RoleWidths()
    model = build(config, mx.float16)
    names = {}

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        role = role_by_name(path + ".weight")
        w = widths[role]
        if w.bits is None or module.weight.shape[-1] % w.group_size:
            return False
        return {"bits": w.bits, "group_size": w.group_size, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)
    got = dict.fromkeys(ROLES, 0)
    for name, p in tree_flatten(model.parameters()):
        base = name.rsplit(".", 1)[0]
        names[name] = p
        if name.endswith((".scales", ".biases")):
            role = role_by_name(base + ".weight")
        else:
            role = role_by_name(name)
        got[role] += p.nbytes
    s = sizes.compute(config, widths, float_bytes=2)
    assert s.bytes == got
    assert got["routed"] < s.params["routed"] * 2 * 0.2  # 2-bit + scales, not fp16
    assert any(p.dtype == mx.uint32 for p in names.values())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_config_totals_within_one_percent(name):
    s = sizes.sizes_for(CONFIGS / f"{name}.json")
    total, active = PUBLISHED[name]
    assert abs(s.total_params - total) / total < 0.01, (s.total_params, total)
    assert abs(s.active_params - active) / active < 0.02, (s.active_params, active)
    assert s.total_bytes == sum(s.bytes.values())
    assert 0 <= s.expert_bytes <= s.bytes["routed"] + s.bytes["keep_float"]


def test_published_totals_of_mixtral_and_deepseek():
    m = sizes.compute(MIXTRAL_8X7B)
    assert abs(m.total_params - 46.7e9) / 46.7e9 < 0.01
    assert abs(m.active_params - 12.9e9) / 12.9e9 < 0.01
    d = sizes.compute(DEEPSEEK_V3)
    assert abs(d.total_params - 671e9) / 671e9 < 0.01
    assert abs(d.total_params + d.excluded["mtp"] - 685e9) / 685e9 < 0.01
    assert abs(d.active_params - 37e9) / 37e9 < 0.03
    (kv,) = d.kv
    assert kv.kind == "mla" and kv.bytes_per_token == (512 + 64) * 2
    assert not kv.compressible("isoquant3")


def test_nemotron_super_geometry():
    s = sizes.sizes_for(CONFIGS / "nemotron-3-super-120b-a12b.json")
    assert (s.layers, s.moe_layers, s.attention_layers, s.recurrent_layers) == (88, 40, 8, 40)
    assert (s.experts_per_layer, s.experts_per_token) == (512, 22)
    # latent experts: fc1 2688x1024 + fc2 1024x2688
    assert s.params_per_expert == 2 * 2688 * 1024
    assert s.kv_bytes_per_token == 8 * 2 * 2 * 128 * 2 == 8192
    # 40 Mamba layers: fp32 SSM state 128x64x128 + bf16 conv state 3 x (8192 + 2*8*128)
    assert s.recurrent_state_bytes == 40 * (128 * 64 * 128 * 4 + 3 * (8192 + 2048) * 2)
    assert abs(s.excluded["mtp"] - 2_942_324_736) / 2_942_324_736 < 0.001


def test_kv_kinds_of_gemma_and_gpt_oss():
    g = sizes.sizes_for(CONFIGS / "gemma-4-26b-a4b-it.json")
    kinds = {k.kind: k for k in g.kv}
    assert kinds["full"].layers == 5 and kinds["full"].bytes_per_token == 2 * 2 * 512 * 2
    assert kinds["sliding"].layers == 25 and kinds["sliding"].window == 1024
    assert kinds["sliding"].bytes_per_token == 8 * 2 * 256 * 2
    # sliding caches stop growing at the window; full ones grow in steps of 256 tokens
    assert kinds["sliding"].nbytes(100_000) == kinds["sliding"].nbytes(1024) == 25 * 1024 * 8192
    assert kinds["full"].nbytes(1000) == 5 * 1024 * 4096
    o = sizes.sizes_for(CONFIGS / "gpt-oss-120b.json")
    assert {k.kind: k.layers for k in o.kv} == {"full": 18, "sliding": 18}
    assert o.kv_bytes_per_token == 18 * 8 * 64 * 2 * 2


def test_kv_modes_shrink_full_layers_only():
    s = sizes.sizes_for(CONFIGS / "qwen3-30b-a3b.json")
    fp16 = s.kv_bytes(32768, "fp16")
    iso = s.kv_bytes(32768, "isoquant3")
    zf = s.kv_bytes(32768, "zipfusion")
    assert fp16 == 48 * 32768 * 4 * 2 * 128 * 2
    assert 4.9 < fp16 / iso < 5.2  # 50 bytes per 128-d vector vs 256, with a 64-token fp16 window
    assert 1.3 < fp16 / zf < 1.34  # 12 bits per value + 8 bytes per page, head and K/V
    g = sizes.sizes_for(CONFIGS / "gemma-4-26b-a4b-it.json")
    sliding = next(k for k in g.kv if k.kind == "sliding").nbytes(32768)
    assert g.kv_bytes(32768, "isoquant3") - sliding < (g.kv_bytes(32768) - sliding) / 4


def test_model_folder_name_and_errors(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIGS["qwen3_moe"]))
    assert sizes.sizes_for(folder).name == "m"
    assert sizes.sizes_for(folder / "config.json").architecture == "qwen3_moe"
    with pytest.raises(sizes.SizeError, match="no-such-model"):
        sizes.sizes_for(tmp_path / "no-such-model")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(sizes.SizeError, match=r"config.json.*no size rule for architecture 'bert'"):
        sizes.sizes_for(folder)
    bad = dict(TINY_CONFIGS["qwen3_moe"])
    del bad["num_experts"]
    (folder / "config.json").write_text(json.dumps(bad))
    with pytest.raises(sizes.SizeError, match="num_experts"):
        sizes.sizes_for(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(sizes.SizeError, match="not valid JSON"):
        sizes.sizes_for(folder)


def test_quantized_folder_widths():
    cfg = {**TINY_CONFIGS["llama"], "quantization": {"bits": 4, "group_size": 32}}
    s = sizes.compute(cfg)
    assert s.widths.dense.bits == 4 and s.widths.dense.group_size == 32


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_hidden_layers": 1e9}, "num_hidden_layers must be a whole number, got 1000000000.0"),
        (
            {"num_hidden_layers": 10**9},
            r"num_hidden_layers = 1000000000 is out of range \(1\.\.4096\)",
        ),
        ({"hidden_size": 0}, "hidden_size = 0 is out of range"),
        ({"num_hidden_layers": 0}, "num_hidden_layers = 0 is out of range"),
        ({"intermediate_size": -4}, "intermediate_size = -4 is out of range"),
        ({"num_attention_heads": "32"}, "num_attention_heads must be a whole number"),
        ({"head_dim": True}, "head_dim must be a whole number"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok = 200 exceeds the 128 experts"),
    ],
)
def test_hostile_config_dimensions_are_refused_at_once(change, match):
    """One check (sizes.check_dimensions) before anything is built from a config: sizes, the
    planner and the download pre-check (sizes.compute) and the loader all go through it."""
    from app.engine.errors import ModelLoadError
    from app.engine.loader import read_config
    from app.engine.planner import Machine, plan_model
    from app.engine.sizes import SizeError, check_dimensions, compute, load_config

    cfg, _, _ = load_config("qwen3-30b-a3b")
    bad = {**cfg, **change}
    for fn in (check_dimensions, compute):
        with pytest.raises(SizeError, match=match):
            fn(bad)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(bad))
        with pytest.raises(SizeError, match=match):
            plan_model(d, Machine.detect(ram="32GB"))
        with pytest.raises(ModelLoadError, match=match):
            read_config(d)
    check_dimensions(cfg)


def test_real_configs_pass_the_dimension_check():
    from app.engine.sizes import check_dimensions, shared_configs_dir

    files = sorted(shared_configs_dir().glob("*.json"))
    assert len(files) >= 8
    for f in files:
        check_dimensions(json.loads(f.read_text()), str(f))
