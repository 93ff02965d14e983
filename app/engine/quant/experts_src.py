"""Where the routed experts of a checkpoint live, and reading one expert at a time.

Checkpoints store experts in one of a few ways; each becomes an `ExpertSource` whose
`fetch(e)` returns expert e's float weights (mlx-lm orientation [out, in]) or its already
quantized triple, reading only that expert's bytes:
- mlx-lm layout (mlx-community, the app's random models): stacked `<module>.<proj>.weight`
  [E, out, in] (+ `.scales`/`.biases` when quantized, `.bias` for gpt_oss) — slice e.
- Hugging Face per-expert tensors: `<prefix>.experts.<e>.<proj>.weight` (qwen3_moe, qwen2_moe,
  qwen3_next, mixtral `w1/w2/w3`, nemotron_h `up_proj/down_proj` -> fc1/fc2, deepseek_v3 with
  fp8 `weight_scale_inv`).
- Hugging Face fused tensors: `<prefix>.experts.gate_up_proj` [E, 2I, H] (gate rows then up
  rows) and `.experts.down_proj` [E, H, I] (qwen3_5_moe, gemma4).
- gpt_oss: MXFP4 `gate_up_proj_blocks` [E, 2I, H/32, 16] + `_scales`, gate/up rows interleaved,
  `*_bias`; or the transformers BF16 export `gate_up_proj` [E, H, 2I] (x @ W orientation).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ModelLoadError
from .roles import ArchRules
from .safetensors_io import SafetensorsReader

_LAYER = re.compile(r"layers\.(\d+)")
_PER_EXPERT = re.compile(
    r"^(?P<pre>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)\."
    r"(?P<leaf>weight|weight_scale_inv|scales|biases|bias)$"
)
_FUSED = re.compile(
    r"^(?P<pre>.+)\.experts\.(?P<t>gate_up_proj|down_proj)"
    r"(?P<suf>_blocks|_scales|_bias)?$"
)


@dataclass
class QuantSrc:
    """An already-quantized weight (mlx-community checkpoints)."""

    weight: object
    scales: object
    biases: object | None
    bits: int
    group_size: int
    mode: str

    def dequantize(self, dtype=None):
        import mlx.core as mx

        if dtype is None and self.mode == "affine":
            dtype = self.scales.dtype
        return mx.dequantize(
            self.weight,
            self.scales,
            self.biases,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            dtype=dtype or mx.bfloat16,
        )


def infer_quant(weight_shape, scales_shape, scales_dtype, in_dims: int, where: str) -> tuple:
    """(bits, group_size, mode) of a saved quantized weight, as mlx-lm's infer_quant_config."""
    import mlx.core as mx

    bits = weight_shape[-1] * 32 // in_dims
    group = in_dims // scales_shape[-1]
    if scales_dtype != mx.uint8:
        return bits, group, "affine"
    modes = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
    if (bits, group) not in modes:
        raise ModelLoadError(
            f"cannot infer the quantization of {where}: {bits} bits, group {group}"
        )
    return bits, group, modes[(bits, group)]


def fp8_block_dequant(weight, scale_inv, block: int = 128):
    """DeepSeek-V3 fp8 weight [m, n] with one inverse scale per 128x128 block -> bfloat16;
    the same arithmetic as mlx-lm's deepseek_v3 sanitize, so both give the same bits."""
    import mlx.core as mx

    w = mx.from_fp8(weight, dtype=mx.bfloat16)
    m, n = w.shape
    pb, ps = (-m) % block, (-n) % block
    w = mx.pad(w, ((0, pb), (0, ps)))
    w = w.reshape(((m + pb) // block, block, (n + ps) // block, block))
    w = (w * scale_inv[:, None, :, None]).reshape(m + pb, n + ps)
    return w[:m, :n].astype(mx.bfloat16)


@dataclass
class ExpertSource:
    module: str  # mlx-lm path of the stacked expert module
    layer: int
    num_experts: int
    projs: list[str]  # mlx-lm projection names
    fetch: Callable[[int], dict]  # e -> {proj: {"w": mx.array | QuantSrc, "bias": mx.array|None}}
    keys: set  # source tensor names it consumes


def _layer_of(path: str) -> int | None:
    m = _LAYER.search(path)
    return int(m.group(1)) if m else None


def _tail(path: str) -> str:
    m = _LAYER.search(path)
    return path[m.end() :] if m else path


def find_expert_sources(
    reader: SafetensorsReader,
    rules: ArchRules,
    modules: dict,
    expected: dict,
    src: str,
    model_layers: int,
) -> list[ExpertSource]:
    """One ExpertSource per expert module of the model (`modules`: path -> projections;
    `expected`: mlx-lm parameter name -> shape of the float model)."""
    by_layer = {}
    for mod in modules:
        L = _layer_of(mod)
        if L is None or L in by_layer:
            raise ModelLoadError(f"cannot place expert module {mod!r} in a layer", src)
        by_layer[L] = mod
    sources: dict[str, ExpertSource] = {}
    consumed: set = set()

    def module_for(pre: str, key: str) -> str | None:
        L = _layer_of(pre)
        mod = by_layer.get(L) if L is not None else None
        if mod is None:
            if pre.startswith("mtp.") or ".mtp." in pre or (L is not None and L >= model_layers):
                return None  # multi-token-prediction layers: mlx-lm's sanitize drops them too
            raise ModelLoadError(f"expert tensor {key!r} has no MoE layer in config.json", src)
        if _tail(mod) != f"{_tail(pre)}.{rules.expert_module}":
            raise ModelLoadError(
                f"expert tensor {key!r} does not match the model's expert module {mod!r}", src
            )
        return mod

    names = list(reader.tensors)
    # 1. mlx-lm stacked layout
    for mod, projs in modules.items():
        if f"{mod}.{projs[0]}.weight" in reader:
            keys = {
                f"{mod}.{p}.{leaf}"
                for p in projs
                for leaf in ("weight", "scales", "biases", "bias")
            }
            keys &= set(names)
            sources[mod] = ExpertSource(
                mod,
                _layer_of(mod),
                expected[f"{mod}.{projs[0]}.weight"][0],
                projs,
                _stacked_fetch(reader, mod, projs, expected),
                keys,
            )
            consumed |= keys
    # 2. Hugging Face per-expert tensors
    per: dict[str, dict] = {}
    inverse = {v: k for k, v in rules.proj_names.items()}
    for k in names:
        m = _PER_EXPERT.match(k)
        if m and k not in consumed:
            mod = module_for(m["pre"], k)
            consumed.add(k)
            if mod is None:
                continue
            per.setdefault(mod, {"pre": m["pre"], "experts": set()})["experts"].add(int(m["e"]))
    for mod, d in per.items():
        if mod in sources:
            raise ModelLoadError(f"experts of {mod} are stored twice", src)
        n = expected[f"{mod}.{modules[mod][0]}.weight"][0]
        if d["experts"] != set(range(n)):
            missing = sorted(set(range(n)) - d["experts"])
            extra = sorted(d["experts"] - set(range(n)))
            raise ModelLoadError(
                f"layer {_layer_of(mod)}: config.json has {n} experts but the "
                f"checkpoint "
                + (f"lacks expert {missing[0]}" if missing else f"has expert {extra[0]}"),
                src,
            )
        hf = {p: inverse.get(p, p) for p in modules[mod]}
        for h in hf.values():
            for e in range(n):
                key = f"{d['pre']}.experts.{e}.{h}.weight"
                if key not in reader:
                    raise ModelLoadError(
                        f"layer {_layer_of(mod)}: expert tensor {key!r} is missing", src
                    )
        sources[mod] = ExpertSource(
            mod,
            _layer_of(mod),
            n,
            modules[mod],
            _per_expert_fetch(reader, d["pre"], hf, expected, mod),
            set(),
        )
    # 3./4. fused tensors (qwen3_5_moe, gemma4, gpt_oss)
    fused: dict[str, dict] = {}
    for k in names:
        m = _FUSED.match(k)
        if m and k not in consumed:
            mod = module_for(m["pre"], k)
            consumed.add(k)
            if mod is not None:
                fused.setdefault(mod, {"pre": m["pre"]})[m["t"] + (m["suf"] or "")] = k
    for mod, d in fused.items():
        if mod in sources:
            raise ModelLoadError(f"experts of {mod} are stored twice", src)
        n = expected[f"{mod}.{modules[mod][0]}.weight"][0]
        if rules.hf_experts == "gpt_oss":
            fetch = _gpt_oss_fetch(reader, d, mod, src)
        elif rules.hf_experts == "fused":
            for t in ("gate_up_proj", "down_proj"):
                if t not in d:
                    raise ModelLoadError(f"layer {_layer_of(mod)}: experts.{t} is missing", src)
            fetch = _fused_fetch(reader, d)
        else:
            raise ModelLoadError(
                f"fused expert tensors are not expected for "
                f"{rules.model_type}: {next(iter(d.values()))!r}",
                src,
            )
        for t, k in d.items():
            if t != "pre" and reader.info(k).shape[0] != n:
                raise ModelLoadError(
                    f"{k} holds {reader.info(k).shape[0]} experts, config.json says {n}",
                    str(reader.info(k).file),
                )
        sources[mod] = ExpertSource(mod, _layer_of(mod), n, modules[mod], fetch, set())
    missing = [m for m in modules if m not in sources]
    if missing:
        raise ModelLoadError(
            f"the checkpoint has no expert weights for {missing[0]} "
            "(config.json describes a MoE layer there)",
            src,
        )
    return [sources[m] for m in modules]


def _stacked_fetch(reader, mod, projs, expected):
    def fetch(e: int) -> dict:
        out = {}
        for p in projs:
            base = f"{mod}.{p}"
            w = reader.read_rows(f"{base}.weight", e, e + 1)[0]
            if f"{base}.scales" in reader:
                s = reader.read_rows(f"{base}.scales", e, e + 1)[0]
                b = (
                    reader.read_rows(f"{base}.biases", e, e + 1)[0]
                    if f"{base}.biases" in reader
                    else None
                )
                in_dims = expected[f"{base}.weight"][-1]
                bits, g, mode = infer_quant(w.shape, s.shape, s.dtype, in_dims, base)
                w = QuantSrc(w, s, b, bits, g, mode)
            bias = (
                reader.read_rows(f"{base}.bias", e, e + 1)[0] if f"{base}.bias" in reader else None
            )
            out[p] = {"w": w, "bias": bias}
        return out

    return fetch


def _per_expert_fetch(reader, pre, hf, expected, mod):
    def fetch(e: int) -> dict:
        out = {}
        for p, h in hf.items():
            base = f"{pre}.experts.{e}.{h}"
            w = reader.read(f"{base}.weight")
            if f"{base}.weight_scale_inv" in reader:
                w = fp8_block_dequant(w, reader.read(f"{base}.weight_scale_inv"))
            elif f"{base}.scales" in reader:
                s = reader.read(f"{base}.scales")
                b = reader.read(f"{base}.biases") if f"{base}.biases" in reader else None
                bits, g, mode = infer_quant(
                    w.shape, s.shape, s.dtype, expected[f"{mod}.{p}.weight"][-1], base
                )
                w = QuantSrc(w, s, b, bits, g, mode)
            bias = reader.read(f"{base}.bias") if f"{base}.bias" in reader else None
            out[p] = {"w": w, "bias": bias}
        return out

    return fetch


def _fused_fetch(reader, d):
    def fetch(e: int) -> dict:
        gu = reader.read_rows(d["gate_up_proj"], e, e + 1)[0]  # [2I, H]: gate rows, up rows
        mid = gu.shape[0] // 2
        down = reader.read_rows(d["down_proj"], e, e + 1)[0]  # [H, I]
        return {
            "gate_proj": {"w": gu[:mid], "bias": None},
            "up_proj": {"w": gu[mid:], "bias": None},
            "down_proj": {"w": down, "bias": None},
        }

    return fetch


def _gpt_oss_fetch(reader, d, mod, src):
    import mlx.core as mx

    blocks = "gate_up_proj_blocks" in d
    need = (
        ["gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"]
        if blocks
        else ["gate_up_proj", "down_proj"]
    )
    for t in need + ["gate_up_proj_bias", "down_proj_bias"]:
        if t not in d:
            raise ModelLoadError(f"{mod}: gpt_oss expert tensor experts.{t} is missing", src)
    dtype = getattr(mx, reader.info(d["gate_up_proj_bias"]).mx_dtype)

    def mxfp4(name: str, e: int):
        b = reader.read_rows(d[f"{name}_blocks"], e, e + 1)[0]  # [rows, H/32, 16] uint8
        s = reader.read_rows(d[f"{name}_scales"], e, e + 1)[0]  # [rows, H/32] uint8
        w = b.view(mx.uint32).flatten(-2)
        return mx.dequantize(w, s, group_size=32, bits=4, mode="mxfp4", dtype=dtype)

    def fetch(e: int) -> dict:
        if blocks:
            gu, down = mxfp4("gate_up_proj", e), mxfp4("down_proj", e)  # [2I, H], [H, I]
        else:  # transformers BF16 export: x @ W, so transpose to [out, in]
            gu = reader.read_rows(d["gate_up_proj"], e, e + 1)[0].T
            down = reader.read_rows(d["down_proj"], e, e + 1)[0].T
        gub = reader.read_rows(d["gate_up_proj_bias"], e, e + 1)[0]
        return {
            "gate_proj": {"w": mx.contiguous(gu[0::2]), "bias": mx.contiguous(gub[0::2])},
            "up_proj": {"w": mx.contiguous(gu[1::2]), "bias": mx.contiguous(gub[1::2])},
            "down_proj": {"w": down, "bias": reader.read_rows(d["down_proj_bias"], e, e + 1)[0]},
        }

    return fetch
