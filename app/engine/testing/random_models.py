"""Random-weight models with tiny or real shapes, saved as ordinary mlx-lm folders.

Tests build tiny ones in-process (vocab 1000, hidden 128, 8 experts); benchmarks build real
shapes from a `config.json` (e.g. ../shared/configs). Both go through the same loading path as
real models: config.json + model.safetensors + tokenizer + manifest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..fsutil import atomic_folder
from ..manifest import Manifest

TINY_VOCAB = 1000

# Small but structurally faithful: same block kinds, routing and special layers as the real
# models (shared experts, Mamba layers, sliding + global layers, attention sinks).
TINY_CONFIGS: dict[str, dict] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": TINY_VOCAB,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": TINY_VOCAB,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "vocab_size": TINY_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attention_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        # Mamba, MoE, attention, MoE, Mamba, MoE — the Nemotron-H pattern in miniature.
        "hybrid_override_pattern": "ME*EME",
        "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 128,
        "n_group": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "mlp_hidden_act": "relu2",
        "time_step_limit": [0.0, 1e9],
        "tie_word_embeddings": False,
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "head_dim": 64,
        "global_head_dim": 128,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size": TINY_VOCAB,
        "vocab_size_per_layer_input": TINY_VOCAB,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "attention_k_eq_v": True,
        "use_double_wide_mlp": False,
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 64,
        "max_position_embeddings": 4096,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": TINY_VOCAB,
        "rms_norm_eps": 1e-5,
        "hidden_size": 128,
        "intermediate_size": 64,
        "head_dim": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 16,
        "rope_theta": 150000,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
    },
    "llama": {
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": TINY_VOCAB,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}
TINY_ARCHS = ("qwen3_moe", "qwen2_moe", "nemotron_h", "gemma4_text", "gpt_oss")

_TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the "
    "capital of France. To be, or not to be, that is the question. 0123456789 + - * / = ( ) "
    "user assistant system Hello, world! How are you today? I am fine, thank you. "
)
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE trained in-process on a fixed text: deterministic, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": specials,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _randomize(model, seed: int, scale: float) -> None:
    """Replace every float parameter with N(0, scale²); norms around 1 (mlx-lm's nemotron_h
    zero-inits its router, which would make routing degenerate)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed)
    new = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        if not mx.issubdtype(p.dtype, mx.floating):
            new.append((name, p))
            continue
        k = (
            mx.random.fold_in(key, i)
            if hasattr(mx.random, "fold_in")
            else mx.random.split(key, i + 2)[-1]
        )
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight":
            v = 1.0 + 0.1 * mx.random.normal(p.shape, key=k)
        elif leaf in ("A_log",):
            v = mx.random.uniform(0.0, 1.0, p.shape, key=k)
        elif leaf in ("D", "dt_bias"):
            v = (
                mx.random.uniform(0.5, 1.5, p.shape, key=k)
                if leaf == "D"
                else mx.random.uniform(-2.0, -1.0, p.shape, key=k)
            )
        else:
            v = scale * mx.random.normal(p.shape, key=k)
        new.append((name, v.astype(p.dtype)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def make_random_model(
    config: dict | str,
    folder: str | os.PathLike,
    seed: int = 0,
    dtype: str = "float32",
    scale: float = 0.05,
    tokenizer: bool = True,
) -> Path:
    """Build a model from `config` (a dict or a name in TINY_CONFIGS), randomize it and save
    it as an mlx-lm folder at `folder` (atomically). Returns the folder."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    if isinstance(config, str):
        config = dict(TINY_CONFIGS[config])
    config = dict(config)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    _randomize(model, seed, scale)
    weights = dict(tree_flatten(model.parameters()))
    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        config.setdefault("eos_token_id", 2)
        config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer:
            write_tiny_tokenizer(tmp, min(TINY_VOCAB, config.get("vocab_size", TINY_VOCAB)))
        nbytes = sum(v.nbytes for v in weights.values())
        Manifest(
            architecture=config["model_type"],
            name=folder.name,
            source=f"random:seed={seed}",
            total_bytes=nbytes,
        ).save(tmp)
    return folder
