"""Write an mlx-lm folder back in the Hugging Face checkpoint layout (the inverse of mlx-lm's
`sanitize`): per-expert or fused expert tensors, HF conv/norm conventions, sharded files with
an index. Tests and benchmarks use it so that the converter reads realistic input; mlx-lm's
own loader reading the result back gives the original weights (checked in the tests).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .roles import rules_for

_QWEN_NEXT_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def _experts_to_hf(weights: dict, rules, gpt_oss_format: str) -> dict:
    import mlx.core as mx

    out = dict(weights)
    inverse = {v: k for k, v in rules.proj_names.items()}
    mods = sorted(
        {
            k.rsplit(".", 2)[0]
            for k in weights
            if any(k.rsplit(".", 2)[0].endswith("." + s) for s in rules.experts)
        }
    )
    for mod in mods:
        pre = mod.removesuffix("." + rules.expert_module)
        projs = sorted({k.rsplit(".", 2)[1] for k in weights if k.startswith(mod + ".")})
        w = {p: out.pop(f"{mod}.{p}.weight") for p in projs}
        b = {p: out.pop(f"{mod}.{p}.bias") for p in projs if f"{mod}.{p}.bias" in out}
        if rules.hf_experts == "per_expert":
            for p, arr in w.items():
                for e in range(arr.shape[0]):
                    out[f"{pre}.experts.{e}.{inverse.get(p, p)}.weight"] = arr[e]
        elif rules.hf_experts == "fused":
            out[f"{pre}.experts.gate_up_proj"] = mx.concatenate(
                [w["gate_proj"], w["up_proj"]], axis=1
            )  # [E, 2I, H]
            out[f"{pre}.experts.down_proj"] = w["down_proj"]
        elif rules.hf_experts == "gpt_oss":
            E, inter, hidden = w["gate_proj"].shape
            gu = mx.stack([w["gate_proj"], w["up_proj"]], axis=2).reshape(E, 2 * inter, hidden)
            gub = mx.stack([b["gate_proj"], b["up_proj"]], axis=-1).reshape(E, 2 * inter)
            out[f"{pre}.experts.gate_up_proj_bias"] = gub
            out[f"{pre}.experts.down_proj_bias"] = b["down_proj"]
            if gpt_oss_format == "mxfp4":
                for name, arr in (("gate_up_proj", gu), ("down_proj", w["down_proj"])):
                    q, s = mx.quantize(arr, 32, 4, mode="mxfp4")
                    rows, cols = arr.shape[1], arr.shape[2]
                    out[f"{pre}.experts.{name}_blocks"] = q.view(mx.uint8).reshape(
                        E, rows, cols // 32, 16
                    )
                    out[f"{pre}.experts.{name}_scales"] = s
            else:  # transformers BF16 export: x @ W
                out[f"{pre}.experts.gate_up_proj"] = gu.transpose(0, 2, 1)
                out[f"{pre}.experts.down_proj"] = w["down_proj"].transpose(0, 2, 1)
        else:
            raise ValueError(f"{rules.model_type}: no Hugging Face expert layout")
    return out


def _dense_to_hf(weights: dict, model_type: str) -> dict:
    out = {}
    for k, v in weights.items():
        if "conv1d.weight" in k and v.ndim == 3 and v.shape[-1] == 1:
            v = v.swapaxes(1, 2)  # mlx [C, K, 1] -> HF [C, 1, K]
        if (
            model_type in ("qwen3_next", "qwen3_5_moe")
            and v.ndim == 1
            and any(k.endswith(s) for s in _QWEN_NEXT_NORMS)
        ):
            v = v - 1.0  # HF stores these norms zero-centred; sanitize adds 1
        if model_type in ("qwen3_5_moe",):
            if k.startswith("language_model.model."):
                k = "model.language_model." + k.removeprefix("language_model.model.")
            else:
                k = k.removeprefix("language_model.")
        out[k] = v
    return out


def to_hf_layout(
    mlx_folder: str | os.PathLike,
    hf_folder: str | os.PathLike,
    shards: int = 2,
    gpt_oss_format: str = "mxfp4",
) -> Path:
    """Write the mlx-lm folder `mlx_folder` as a Hugging Face checkpoint in `hf_folder`
    (sharded over `shards` files); returns `hf_folder`."""
    import mlx.core as mx

    src, dst = Path(mlx_folder), Path(hf_folder)
    config = json.loads((src / "config.json").read_text())
    rules = rules_for(config["model_type"])
    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    if any(k.endswith(".scales") for k in weights):
        raise ValueError(f"{src}: already quantized; only float folders can be un-sanitized")
    if rules.has_experts:
        weights = _experts_to_hf(weights, rules, gpt_oss_format)
    weights = _dense_to_hf(weights, config["model_type"])
    if config["model_type"] == "gpt_oss" and gpt_oss_format == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4"}
    dst.mkdir(parents=True, exist_ok=True)
    names = sorted(weights)
    total = sum(weights[n].nbytes for n in names)
    per, cur, acc, parts = total / shards, [], 0, []
    for n in names:  # consecutive names per shard, as real checkpoints are split
        cur.append(n)
        acc += weights[n].nbytes
        if acc >= per * (len(parts) + 1) and len(parts) < shards - 1:
            parts.append(cur)
            cur = []
    parts.append(cur)
    parts = [p for p in parts if p]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        mx.save_safetensors(
            str(dst / fname), {n: weights[n] for n in part}, metadata={"format": "pt"}
        )
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.name.startswith("tokenizer"):
            shutil.copy2(f, dst / f.name)
    return dst
