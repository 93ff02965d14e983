"""Random-weight models written directly in the converted format (benchmarks of the pager).

A real-shaped model (e.g. Nemotron 3 Super 120B) is too large to build in float and convert on
a benchmark machine; this writes what the converter would produce at the given role widths —
quantized dense safetensors, one record per routed expert, config with mlx-lm's per-module
`quantization`, manifest — straight from random codes, streaming (one row block or one
expert in memory at a time). Dequantized weights are zero-mean with std ~1/sqrt(fan_in) so
activations stay finite through every layer.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..fsutil import atomic_folder
from ..manifest import Manifest
from ..offload.records import LayerLayout, LayerWriter, experts_section
from ..quant.roles import expert_modules, plan_params, width_for
from ..quant.safetensors_io import OutTensor, ShardedWriter
from ..quant.widths import RoleWidths
from .random_models import write_tiny_tokenizer

BLOCK_BYTES = 64 << 20  # random data generated per row block: bounds memory
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _quant_outputs(name: str, shape: tuple, w, dtype: str) -> list[OutTensor]:
    module = name.rpartition(".")[0]
    rows, cols = shape[:-1], shape[-1]
    return [
        OutTensor(f"{module}.weight", "uint32", (*rows, cols * w.bits // 32)),
        OutTensor(f"{module}.scales", dtype, (*rows, cols // w.group_size)),
        OutTensor(f"{module}.biases", dtype, (*rows, cols // w.group_size)),
    ]


def _scales(rng, shape, fan_in: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Affine scale and bias so that codes uniform in [0, 2^b) give a zero-mean weight with
    std ~ 1/sqrt(fan_in)."""
    levels = 2**bits
    code_std = np.sqrt((levels * levels - 1) / 12.0)
    s = (rng.uniform(0.8, 1.2, shape) / np.sqrt(fan_in) / code_std).astype(np.float32)
    return s, -s * (levels - 1) / 2.0


def _float_values(rng, name: str, shape) -> np.ndarray:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if leaf == "A_log":
        return rng.uniform(0.0, 1.0, shape).astype(np.float32)
    if leaf == "D":
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if leaf == "dt_bias":
        return rng.uniform(-2.0, -1.0, shape).astype(np.float32)
    if len(shape) < 2:  # biases, router score corrections: small, so routing stays varied
        return 0.02 * rng.standard_normal(shape, dtype=np.float32)
    return rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])


def _mx(a: np.ndarray, dtype: str):
    import mlx.core as mx

    return mx.array(a).astype(getattr(mx, dtype)) if a.dtype.kind == "f" else mx.array(a)


def write_random_converted(
    config: dict,
    folder: str | os.PathLike,
    widths: RoleWidths | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    progress: Callable[[str, int, int], None] | None = None,
    max_shard_bytes: int = 5 << 30,
) -> Manifest:
    """Write a random model of `config`'s shapes at `widths` into `folder` (atomically:
    a hidden sibling renamed at the end). `progress(item, done_bytes, total_bytes)`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    t0 = time.perf_counter()
    widths = widths or RoleWidths()
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    mt = config["model_type"]
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))  # lazy: nothing is allocated
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    modules = dict(model.named_modules())
    exp_mods = expert_modules(model, mt)
    exp_prefix = tuple(m + "." for m in exp_mods)
    plans = [p for p in plan_params(model, mt, widths) if not p.name.startswith(exp_prefix)]
    rng = np.random.default_rng(seed)

    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        # dense tensors
        per_plan = [
            _quant_outputs(p.name, p.shape, p.width, dtype)
            if p.width is not None
            else [OutTensor(p.name, dtype, p.shape)]
            for p in plans
        ]
        outs = [o for po in per_plan for o in po]
        layouts = []
        for mod, projs in exp_mods.items():
            m = _LAYER.search(mod + ".")
            if m is None:
                raise ValueError(f"{mod}: no layer index in the expert module path")
            tensors, q = [], {}
            n_exp = shapes[f"{mod}.{projs[0]}.weight"][0]
            for pr in projs:
                out_d, in_d = shapes[f"{mod}.{pr}.weight"][1:]
                w = width_for(widths, "routed", in_d)
                if w is None:
                    tensors.append((f"{pr}.weight", dtype, (out_d, in_d)))
                    q[pr] = None
                else:
                    tensors += [
                        (f"{pr}.weight", "uint32", (out_d, in_d * w.bits // 32)),
                        (f"{pr}.scales", dtype, (out_d, in_d // w.group_size)),
                        (f"{pr}.biases", dtype, (out_d, in_d // w.group_size)),
                    ]
                    q[pr] = {"bits": w.bits, "group_size": w.group_size, "mode": w.mode}
                if f"{mod}.{pr}.bias" in shapes:
                    tensors.append((f"{pr}.bias", dtype, (out_d,)))
            layouts.append(LayerLayout.plan(int(m.group(1)), mod, n_exp, tensors, q))
        total = sum(o.nbytes for o in outs) + sum(
            lay.record_size * lay.num_experts for lay in layouts
        )
        done = 0

        writer = ShardedWriter(tmp, outs, max_shard_bytes=max_shard_bytes)
        try:
            for p, p_outs in zip(plans, per_plan, strict=True):
                module = p.name.rpartition(".")[0]
                rows = p.shape[0] if len(p.shape) > 1 else 1
                row_bytes = max(1, p.params // rows * 4)
                step = max(1, BLOCK_BYTES // row_bytes)
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    if p.width is None:
                        v = _float_values(
                            rng, p.name, (r1 - r0, *p.shape[1:]) if len(p.shape) > 1 else p.shape
                        )
                        writer.write(p.name, _mx(v, dtype), r0)
                        continue
                    w = p.width
                    n_words = p.shape[-1] * w.bits // 32
                    codes = rng.integers(
                        0, 2**32, (r1 - r0, *p.shape[1:-1], n_words), dtype=np.uint32
                    )
                    s, b = _scales(
                        rng, (*codes.shape[:-1], p.shape[-1] // w.group_size), p.shape[-1], w.bits
                    )
                    writer.write(f"{module}.weight", mx.array(codes), r0)
                    writer.write(f"{module}.scales", _mx(s, dtype), r0)
                    writer.write(f"{module}.biases", _mx(b, dtype), r0)
                done += sum(o.nbytes for o in p_outs)
                if progress:
                    progress(p.name, done, total)
            writer.close()
        except BaseException:
            writer.abort()
            raise

        layouts, done = _write_layers(tmp, layouts, seed, dtype, done, total, progress)

        # mlx-lm's per-module quantization, as the converter writes it
        top = widths.dense
        quant = {"group_size": top.group_size, "bits": top.bits or 4, "mode": top.mode}
        planned = {p.name.rpartition(".")[0]: p.width for p in plans if p.name.endswith(".weight")}
        for lay in layouts:
            for pr, qp in lay.quantization.items():
                quant[f"{lay.module}.{pr}"] = qp or False
        for path, mod in modules.items():
            if hasattr(mod, "to_quantized") and path not in quant:
                w = planned.get(path)
                quant[path] = (
                    {"group_size": w.group_size, "bits": w.bits, "mode": w.mode}
                    if w is not None
                    else False
                )
        cfg = dict(config, quantization=quant, torch_dtype=dtype)
        cfg.setdefault("eos_token_id", 2)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        write_tiny_tokenizer(tmp)
        dense_bytes = sum(o.nbytes for o in outs)
        expert_bytes = sum(lay.record_size * lay.num_experts for lay in layouts)
        man = Manifest(
            architecture=mt,
            name=folder.name,
            source=f"random:seed={seed}",
            roles={"routed": {"bits": widths.routed.bits, "bytes": expert_bytes}},
            experts=experts_section(layouts),
            total_bytes=dense_bytes + expert_bytes,
            extra={
                "widths": widths.to_dict(),
                "synthesized": {
                    "seconds": round(time.perf_counter() - t0, 1),
                    "dense_bytes": dense_bytes,
                },
            },
        )
        man.save(tmp)
    return man


def _float_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the raw storage of `dtype` (bfloat16: round to nearest even), in
    numpy: layer writers run in worker processes that never start MLX (or a GPU context)."""
    if dtype == "bfloat16":
        u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return a.astype(np.dtype(dtype))


def _write_layer(folder: Path, lay: LayerLayout, seed: tuple, dtype: str) -> LayerLayout:
    """One layer's records: codes from a per-layer random pool at a different offset per
    expert (distinct experts without generating every byte), scales drawn per expert."""
    rng = np.random.default_rng(seed)
    code_bytes = sum(t.nbytes for t in lay.tensors if t.dtype == "uint32")
    pool = rng.integers(0, 2**32, (2 * code_bytes) // 4 + 1024, dtype=np.uint32)
    lw = LayerWriter(folder, lay)
    try:
        for e in range(lay.num_experts):
            shift = int(rng.integers(0, code_bytes // 4 + 1024))
            rec, pos = {}, shift
            for t in lay.tensors:
                proj, _, leaf = t.name.rpartition(".")
                if t.dtype == "uint32":
                    n = t.nbytes // 4
                    rec[t.name] = pool[pos : pos + n].reshape(t.shape)
                    pos += n
                elif leaf == "scales":
                    q = lay.quantization[proj]
                    fan_in = t.shape[-1] * q["group_size"]
                    s, b = _scales(rng, t.shape, fan_in, q["bits"])
                    rec[t.name] = s
                    rec[f"{proj}.biases"] = b
                elif leaf in ("weight", "bias"):
                    rec[t.name] = _float_values(rng, t.name, t.shape) * (leaf == "weight")
            for k, v in list(rec.items()):
                if v.dtype.kind == "f":
                    rec[k] = _float_bits(v, dtype)
            lw.write(e, rec)
        return lw.close()
    except BaseException:
        lw.abort()
        raise


def _write_layers(
    folder: Path, layouts: list[LayerLayout], seed: int, dtype: str, done: int, total: int, progress
) -> tuple[list[LayerLayout], int]:
    """Every layer's records, several layers at once in worker processes (spawned: no MLX
    state is inherited); a layer's data depends only on (seed, layer)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    workers = min(len(layouts), max(1, (os.cpu_count() or 1) - 1), 16)
    out = []
    if workers <= 1:
        pending = [(lay, None) for lay in layouts]
        ex = None
    else:
        ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
        pending = [
            (lay, ex.submit(_write_layer, folder, lay, (seed, lay.layer), dtype)) for lay in layouts
        ]
    try:
        for lay, fut in pending:
            done_lay = fut.result() if fut else _write_layer(folder, lay, (seed, lay.layer), dtype)
            out.append(done_lay)
            done += lay.record_size * lay.num_experts
            if progress:
                progress(f"layer {lay.layer} experts", done, total)
    finally:
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)
    return out, done


def write_random_experts(
    folder: str | os.PathLike,
    num_layers: int,
    num_experts: int,
    projs: dict[str, tuple[int, int]],
    bits: int = 2,
    group_size: int = 64,
    dtype: str = "bfloat16",
    seed: int = 0,
    module: str = "backbone.layers.{layer}.mixer.switch_mlp",
) -> dict:
    """Expert records alone (no model around them) -> the manifest's `experts` section, also
    saved as `experts.json` in `folder`. `projs`: projection -> (out, in), e.g. Nemotron 3
    Super's {"fc1": (2688, 1024), "fc2": (1024, 2688)}: records of a real model's size for
    pager measurements without its compute."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layouts = []
    for layer in range(num_layers):
        tensors, q = [], {}
        for pr, (out_d, in_d) in projs.items():
            tensors += [
                (f"{pr}.weight", "uint32", (out_d, in_d * bits // 32)),
                (f"{pr}.scales", dtype, (out_d, in_d // group_size)),
                (f"{pr}.biases", dtype, (out_d, in_d // group_size)),
            ]
            q[pr] = {"bits": bits, "group_size": group_size, "mode": "affine"}
        layouts.append(LayerLayout.plan(layer, module.format(layer=layer), num_experts, tensors, q))
    layouts, _ = _write_layers(folder, layouts, seed, dtype, 0, 0, None)
    section = experts_section(layouts)
    (folder / "experts.json").write_text(json.dumps(section))
    return section
