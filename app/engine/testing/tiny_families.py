"""Tiny random models of every architecture mlx-lm ships, built in-process from each module's
ModelArgs (for tests and benchmarks/kv_families.py; not imported by the app).

The config is a small common core (hidden 128, 4 query / 2 KV heads of 32, 2 layers, vocab
256) plus, for any other field the dataclass requires, a small value of its annotated type.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

VOCAB = 256
CORE = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "dim": 128,
    "d_model": 128,
    "n_embd": 128,
    "intermediate_size": 256,
    "ffn_dim": 256,
    "num_hidden_layers": 2,
    "n_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "n_kv_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "sliding_window": 16,
}


# Fields a family needs beyond the core (a generic small value does not build it).
OVERRIDES = {
    "stablelm": {"partial_rotary_factor": 0.25, "use_qkv_bias": False},
    "minicpm3": {
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [1.0] * 8,
            "original_max_position_embeddings": 1024,
        },
        "scale_emb": 1.0,
        "dim_model_base": 128,
        "scale_depth": 1.0,
    },
}


def model_types() -> list[str]:
    """Every module in mlx_lm.models that defines Model and ModelArgs."""
    import mlx_lm.models as pkg

    out = []
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            mod = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):  # olmo exits when its optional package is missing
            continue
        if hasattr(mod, "Model") and hasattr(mod, "ModelArgs"):
            out.append(info.name)
    return sorted(out)


def _small(annotation) -> object:
    text = str(annotation)
    if "Optional" in text or "None" in text:
        return None
    if "bool" in text:
        return False
    if "int" in text:
        return 2
    if "float" in text:
        return 1e-5
    if "str" in text:
        return ""
    if "List" in text or "list" in text:
        return []
    if "Dict" in text or "dict" in text:
        return {}
    return None


def tiny_config(model_type: str) -> dict:
    from .random_models import TINY_CONFIGS

    if model_type in TINY_CONFIGS:  # the hand-made tiny configs of the tested architectures
        return {**TINY_CONFIGS[model_type], "vocab_size": VOCAB}
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    cfg = {"model_type": model_type}
    fields = {f.name: f for f in dataclasses.fields(mod.ModelArgs)}
    for name, f in fields.items():
        if name in CORE:
            cfg[name] = CORE[name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            cfg[name] = _small(f.type)
    return {**cfg, **OVERRIDES.get(model_type, {})}


def build(model_type: str, seed: int = 0, scale: float = 0.05):
    """(model, config) of a tiny random `model_type` in float32; raises what construction does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    cfg = tiny_config(model_type)
    args = (
        mod.ModelArgs.from_dict(cfg)
        if hasattr(mod.ModelArgs, "from_dict")
        else mod.ModelArgs(**cfg)
    )
    model = mod.Model(args)
    key = mx.random.key(seed)
    params = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        if mx.issubdtype(p.dtype, mx.floating):
            k = mx.random.split(key, i + 2)[-1]
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p = (base + scale * mx.random.normal(p.shape, key=k)).astype(mx.float32)
        params.append((name, p))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model, cfg
