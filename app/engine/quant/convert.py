"""Streaming converter: a checkpoint folder -> the app's model folder (SPEC §2–§3).

Input: a Hugging Face folder (sharded safetensors + index; BF16/FP16/FP32, DeepSeek fp8,
gpt-oss MXFP4) or an mlx-lm folder (float, or already quantized as on mlx-community).
Output folder:
- `model-*.safetensors` + index: every non-routed weight, named as mlx-lm's model expects
  (after its `sanitize`), quantized by role (`config.json` gets a per-module `quantization`
  dict, which mlx-lm's loader reads).
- `experts/layer_LLLL.bin`: every routed expert of every layer as one record
  (`app.engine.offload.records`); routed experts are NOT in the safetensors, so the folder
  loads through `loader.load` (fully resident) or the pager.
- `rotaryquant.json`: widths, parameter counts, bytes and excess kurtosis per role, and the
  records' layout and checksums.

Already-quantized sources: a weight whose role asks for the bits it already has (any group
size) is copied as it is; other widths are re-quantized from its dequantized values (listed in
the manifest's `requantized`). Kurtosis is then measured on the dequantized values.

Streaming: names are mapped with the model's own `sanitize` on lazy arrays (nothing is read);
then each non-expert tensor is read and written in blocks of rows (at most `chunk_bytes` of
source), and experts one at a time with positioned reads. Peak memory above the process
baseline is bounded by a small multiple (~6x: source, float32 copy, quantized output, moment
temporaries) of the largest of: one row block (`chunk_bytes`, 64 MiB), one expert's weights,
one tensor that `sanitize` transforms (conv weights, norms, fp8 blocks, kv_b_proj).
The output is written to a hidden sibling folder and renamed when complete: an interrupted
conversion leaves no output folder (a killed one leaves a `.NAME.rq-partial-PID` folder that
the next run removes). `overwrite` moves the old model to `.NAME.rq-old-PID` for the moment of
the swap; a kill there is mended by the next run (the old model restored). `.NAME.rq-lock`
keeps a second conversion to the same destination out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EngineError, ModelLoadError
from ..fsutil import Busy, exclusive
from ..loader import read_config
from ..manifest import MANIFEST_NAME, Manifest
from ..offload.records import LayerLayout, LayerWriter, experts_section
from .experts_src import QuantSrc, find_expert_sources, infer_quant
from .moments import Moments
from .roles import param_role, rules_for, width_for
from .safetensors_io import OutTensor, SafetensorsReader, ShardedWriter, mx_dtype_name
from .widths import ROLES, RoleWidth, RoleWidths

CHUNK_BYTES = 64 << 20  # source bytes per row block: bounds memory for 1 GB embeddings
_SKIP_FILES = re.compile(
    r"(\.safetensors|\.bin|\.pt|\.pth|\.gguf|\.h5|\.msgpack|\.onnx|"
    r"^model\.safetensors\.index\.json|^config\.json|^" + re.escape(MANIFEST_NAME) + r")$"
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ConvertError(EngineError):
    """The conversion cannot start or finish (destination, disk space)."""


@dataclass(frozen=True)
class ConvertProgress:
    stage: str  # "dense" | "experts" | "finish"
    done: int  # output bytes written so far
    total: int  # output bytes planned
    item: str  # tensor name or "layer L expert e"


@dataclass
class _RoleStats:
    params: int = 0
    bytes: int = 0
    tensors: int = 0
    moments: Moments = field(default_factory=Moments)
    tensor_kurtosis: list = field(default_factory=list)


@dataclass
class _DenseItem:
    name: str  # parameter name in the converted model
    role: str
    width: RoleWidth | None  # target quantization; None = float
    shape: tuple[int, ...]  # float shape
    outputs: list[OutTensor]
    lazy: object = None  # float source: the sanitized lazy array
    src_name: str | None = None  # float source that sanitize passed through unchanged
    qsrc: tuple | None = None  # quantized source: (weight, scales, biases|None, bits, group, mode)
    passthrough: bool = False  # quantized source already at the target bits: kept as is


def _quant_shapes(rows_shape: tuple, in_dims: int, dtype, w: RoleWidth) -> list[tuple]:
    """[(suffix, dtype name, shape)] of mx.quantize's outputs for a [.., in_dims] weight,
    from a lazy 1-row probe (shapes only: nothing is computed)."""
    import mlx.core as mx

    probe = mx.quantize(mx.zeros((1, in_dims), dtype=dtype), w.group_size, w.bits, mode=w.mode)
    names = ("weight", "scales", "biases")
    return [
        (n, mx_dtype_name(a.dtype), (*rows_shape, a.shape[-1]))
        for n, a in zip(names, probe, strict=False)
    ]


def _strip_quant(config: dict) -> dict:
    cfg = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = {
            k: v
            for k, v in cfg["text_config"].items()
            if k not in ("quantization", "quantization_config")
        }
    return cfg


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _recover_interrupted(dst: Path) -> None:
    """Leftovers of killed conversions to `dst` (called holding its lock, so none is live):
    partial outputs are removed; a previous model moved aside by `overwrite` comes back when
    the kill left no model in its place, else it is removed."""
    for p in dst.parent.glob(f".{dst.name}.rq-partial-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in sorted(dst.parent.glob(f".{dst.name}.rq-old-*")):
        if not dst.exists():
            os.replace(p, dst)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _swap_in(tmp: Path, dst: Path) -> None:
    """Replace `dst` by the finished `tmp`; the old copy is restored if the second rename
    fails, and by the next conversion if the process is killed between the two."""
    if not dst.exists():
        os.replace(tmp, dst)
        return
    old = dst.parent / f".{dst.name}.rq-old-{os.getpid()}"
    os.replace(dst, old)
    try:
        os.replace(tmp, dst)
    except BaseException:
        os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _build_model(config: dict, src: Path):
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(config)
        # Built lazily: parameters are never evaluated, so this allocates nothing.
        return model_cls(args_cls.from_dict(config))
    except (ValueError, ImportError) as e:
        raise ModelLoadError(
            f"mlx-lm cannot build {config['model_type']!r}: {e}", str(src / "config.json")
        ) from e
    except (TypeError, KeyError, AttributeError) as e:
        raise ModelLoadError(
            f"config.json is incomplete for {config['model_type']!r}: {e}", str(src / "config.json")
        ) from e


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    widths: RoleWidths | str | None = None,
    progress: Callable[[ConvertProgress], None] | None = None,
    overwrite: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    max_shard_bytes: int = 5 << 30,
    check_disk: bool = True,
) -> Manifest:
    """Convert the checkpoint at `src` into the app's folder `dst`; returns its manifest.

    Raises ModelLoadError for bad input (naming the file and the reason), ConvertError when
    the destination exists, holds the source, is being written by another conversion, or the
    disk is too small."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ConvertError(
            f"{dst}: the destination and the source folder {src} must not contain one another"
        )
    try:
        with exclusive(dst):
            _recover_interrupted(dst)
            return _convert(
                src, dst, widths, progress, overwrite, chunk_bytes, max_shard_bytes, check_disk
            )
    except Busy as e:
        raise ConvertError(f"{e}: another conversion to it is running") from None


def _convert(
    src: Path,
    dst: Path,
    widths,
    progress,
    overwrite: bool,
    chunk_bytes: int,
    max_shard_bytes: int,
    check_disk: bool,
) -> Manifest:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    t0 = time.perf_counter()
    if isinstance(widths, str):
        widths = RoleWidths.parse(widths)
    widths = widths or RoleWidths()
    config = read_config(src)
    rules = rules_for(config["model_type"])
    src_man = Manifest.load(src)
    if src_man is not None and src_man.experts:
        raise ModelLoadError(
            "already converted (routed experts are in experts/*.bin): "
            "convert the original checkpoint instead",
            str(src),
        )
    if not any((src / t).exists() for t in _TOKENIZER_FILES):
        raise ModelLoadError("no tokenizer (tokenizer.json or tokenizer.model)", str(src))
    if dst.exists() and not overwrite:
        raise ConvertError(f"{dst}: destination exists (pass overwrite to replace it)")

    reader = SafetensorsReader(src)
    float_cfg = _strip_quant(config)
    model = _build_model(float_cfg, src)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    modules = dict(model.named_modules())
    from .roles import expert_modules

    exp_mods = expert_modules(model, config["model_type"])
    n_layers = len(getattr(model, "layers", [])) or 10**9

    # Lazy arrays for every tensor (mx.load reads nothing until evaluated); sanitize maps the
    # names exactly as mlx-lm's loader does.
    lazy: dict = {}
    for f in sorted({i.file for i in reader.tensors.values()}):
        try:
            lazy.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"cannot read safetensors: {e}", str(f)) from e
    src_of = {id(v): k for k, v in lazy.items()}
    # Experts first: their checks give clearer errors than sanitize's KeyErrors.
    sources = find_expert_sources(reader, rules, exp_mods, expected, str(src), n_layers)
    try:
        sanitized = model.sanitize(dict(lazy)) if hasattr(model, "sanitize") else dict(lazy)
    except (KeyError, ValueError, IndexError) as e:
        raise ModelLoadError(
            f"config.json does not match the weights: mlx-lm's sanitize "
            f"failed ({type(e).__name__}: {e})",
            str(src),
        ) from e

    expert_prefixes = tuple(f"{m}." for m in exp_mods)
    items = _plan_dense(
        sanitized, src_of, expected, modules, rules, widths, exp_mods, expert_prefixes, src
    )
    layouts, fallback = [], [i.name for i in items if i.role != "keep_float" and i.width is None]
    for s in sources:
        layouts.append(_plan_layer(s, widths, expected, modules))

    dense_bytes = sum(o.nbytes for i in items for o in i.outputs)
    expert_bytes = sum(lay.file_size for lay in layouts)
    total = dense_bytes + sum(lay.record_size * lay.num_experts for lay in layouts)
    aux = [p for p in src.iterdir() if p.is_file() and not _SKIP_FILES.search(p.name)]
    need = dense_bytes + expert_bytes + sum(p.stat().st_size for p in aux) + (64 << 20)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if check_disk:
        free = shutil.disk_usage(dst.parent).free
        if free < need:
            raise ConvertError(
                f"{dst.parent}: not enough free disk: the converted model needs "
                f"{need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"
            )

    tmp = dst.parent / f".{dst.name}.rq-partial-{os.getpid()}"
    tmp.mkdir()
    stats = {r: _RoleStats() for r in ROLES}
    peak = [_rss()]
    done = [0]

    def report(stage: str, item: str, nbytes: int) -> None:
        done[0] += nbytes
        peak[0] = max(peak[0], _rss())
        if progress is not None:
            progress(ConvertProgress(stage, done[0], total, item))

    writer = None
    # MLX keeps freed buffers for reuse; conversion allocates blocks of ever-changing sizes,
    # so the cache would only grow RSS. Off while converting, restored after.
    prev_cache = mx.set_cache_limit(0)
    try:
        writer = ShardedWriter(tmp, [o for i in items for o in i.outputs], max_shard_bytes)
        for item in items:
            _write_dense(item, reader, writer, stats, chunk_bytes)
            report("dense", item.name, sum(o.nbytes for o in item.outputs))
        writer.close()
        writer = None
        for s, lay in zip(sources, layouts, strict=True):
            _write_layer(s, lay, tmp, stats, expected, report)
        quant = _quant_config(widths, modules, items, layouts)
        out_cfg = dict(config)
        out_cfg.pop("quantization_config", None)
        if isinstance(out_cfg.get("text_config"), dict):
            out_cfg["text_config"] = {
                k: v for k, v in out_cfg["text_config"].items() if k != "quantization_config"
            }
        out_cfg["quantization"] = quant
        out_cfg["quantization_config"] = quant
        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2))
        for p in aux:
            shutil.copy2(p, tmp / p.name)
        manifest = _manifest(
            config,
            src,
            dst,
            widths,
            stats,
            layouts,
            fallback,
            items,
            time.perf_counter() - t0,
            peak[0],
        )
        manifest.save(tmp)
        report("finish", str(dst), 0)
        _swap_in(tmp, dst)
    except BaseException:
        if writer is not None:
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
        mx.set_cache_limit(prev_cache)
        mx.clear_cache()
    return manifest


def _plan_dense(
    sanitized, src_of, expected, modules, rules, widths, exp_mods, expert_prefixes, src
) -> list[_DenseItem]:
    import mlx.core as mx

    names = {k for k in sanitized if not k.startswith(expert_prefixes)}
    used: set = set()
    items = []
    for name, shape in expected.items():
        if name.startswith(expert_prefixes):
            continue
        module, _, leaf = name.rpartition(".")
        m = modules.get(module)
        quantizable = m is not None and hasattr(m, "to_quantized") and leaf == "weight"
        role = param_role(rules, name, quantizable)
        width = width_for(widths, role, shape[-1]) if quantizable else None
        if name not in names:
            raise ModelLoadError(
                f"config.json does not match the weights: no tensor for "
                f"{name} (shape {list(shape)})",
                str(src),
            )
        used.add(name)
        arr = sanitized[name]
        item = _DenseItem(name, role, width, shape, [])
        if quantizable and f"{module}.scales" in names:
            s = sanitized[f"{module}.scales"]
            b = sanitized.get(f"{module}.biases")
            used |= {f"{module}.scales", f"{module}.biases"} & names
            bits, g, mode = infer_quant(arr.shape, s.shape, s.dtype, shape[-1], module)
            if arr.shape[:-1] != shape[:-1]:
                raise ModelLoadError(
                    f"config.json does not match the weights: {name} has "
                    f"shape {list(arr.shape)}, expected {list(shape)}",
                    str(src),
                )
            item.qsrc = (arr, s, b, bits, g, mode)
            # Same bits (any group): keep the source's codes; re-grouping only adds error.
            item.passthrough = width is not None and (width.bits, width.mode) == (bits, mode)
            if item.passthrough:
                width = item.width = RoleWidth(bits, g, mode)
            fdtype = s.dtype if mode == "affine" else mx.bfloat16
        else:
            if tuple(arr.shape) != shape:
                raise ModelLoadError(
                    f"config.json does not match the weights: {name} has "
                    f"shape {list(arr.shape)}, expected {list(shape)}",
                    str(src),
                )
            item.lazy = arr
            item.src_name = src_of.get(id(arr))
            fdtype = arr.dtype
        if width is not None:
            for suffix, dt, shp in _quant_shapes(shape[:-1], shape[-1], fdtype, width):
                if suffix == "biases" and width.mode != "affine":
                    continue
                item.outputs.append(OutTensor(f"{module}.{suffix}", dt, shp))
        else:
            item.outputs.append(OutTensor(name, mx_dtype_name(fdtype), shape))
        items.append(item)
    extra = sorted(names - used)
    if extra:
        raise ModelLoadError(
            f"config.json does not match the weights: unexpected tensor "
            f"{extra[0]}" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""),
            str(src),
        )
    return items


def _row_blocks(n_rows: int, row_bytes: int, chunk_bytes: int):
    step = max(1, chunk_bytes // max(1, row_bytes))
    for r in range(0, n_rows, step):
        yield r, min(n_rows, r + step)


def _write_dense(item: _DenseItem, reader, writer, stats, chunk_bytes: int) -> None:
    import mlx.core as mx

    st = stats[item.role]
    mom = Moments()
    rows = item.shape[0] if len(item.shape) >= 2 else 1
    if item.qsrc is not None:
        w, s, b, bits, g, mode = item.qsrc
        mx.eval(w, s, *(x for x in (b,) if x is not None))
        row_bytes = w.nbytes // max(1, w.shape[0])

        def blocks():
            for r0, r1 in _row_blocks(rows, row_bytes * 8, chunk_bytes):
                q = QuantSrc(w[r0:r1], s[r0:r1], None if b is None else b[r0:r1], bits, g, mode)
                yield r0, q
    elif item.src_name is not None and len(item.shape) >= 2:
        info = reader.info(item.src_name)
        row_bytes = info.nbytes // item.shape[0]

        def blocks():
            for r0, r1 in _row_blocks(rows, row_bytes, chunk_bytes):
                yield r0, reader.read_rows(item.src_name, r0, r1)
    else:
        arr = item.lazy
        mx.eval(arr)
        if arr.ndim < 2:

            def blocks():
                yield 0, arr
        else:
            row_bytes = arr.nbytes // arr.shape[0]

            def blocks():
                for r0, r1 in _row_blocks(rows, row_bytes, chunk_bytes):
                    yield r0, arr[r0:r1]

    for r0, x in blocks():
        if isinstance(x, QuantSrc):
            if item.passthrough:
                parts = [x.weight, x.scales] + ([x.biases] if x.biases is not None else [])
                for o, a in zip(item.outputs, parts, strict=True):
                    writer.write(o.name, a, r0)
                mom.add(x.dequantize())
                continue
            x = x.dequantize()
        mom.add(x)
        if item.width is not None:
            wd = item.width
            outs = mx.quantize(x, wd.group_size, wd.bits, mode=wd.mode)
            for o, a in zip(item.outputs, outs, strict=False):
                writer.write(o.name, a, r0)
        else:
            writer.write(item.outputs[0].name, x, r0)
    n = 1
    for d in item.shape:
        n *= d
    st.params += n
    st.bytes += sum(o.nbytes for o in item.outputs)
    st.tensors += 1
    st.moments.merge(mom)
    st.tensor_kurtosis.append(mom.excess_kurtosis)


def _expert_float(w, bias):
    return w.dequantize() if isinstance(w, QuantSrc) else w


def _plan_layer(s, widths: RoleWidths, expected: dict, modules: dict) -> LayerLayout:
    """Record layout of one layer, from the shapes of its expert 0."""
    e0 = s.fetch(0)
    tensors, quant = [], {}
    for p in s.projs:
        want = expected[f"{s.module}.{p}.weight"][1:]
        w = e0[p]["w"]
        shape = tuple(w.shape) if not isinstance(w, QuantSrc) else (*w.weight.shape[:-1], want[-1])
        if shape != want:
            raise ModelLoadError(
                f"config.json does not match the weights: layer {s.layer} "
                f"expert {p} has shape {list(shape)}, expected {list(want)}"
            )
        fdtype = (
            w.scales.dtype
            if isinstance(w, QuantSrc) and w.mode == "affine"
            else (w.dequantize().dtype if isinstance(w, QuantSrc) else w.dtype)
        )
        width = width_for(widths, "routed", want[-1])
        if (
            isinstance(w, QuantSrc)
            and width is not None
            and (w.bits, w.mode) == (width.bits, width.mode)
        ):
            width = RoleWidth(w.bits, w.group_size, w.mode)  # kept as is, as for dense
        quant[p] = (
            None
            if width is None
            else {"bits": width.bits, "group_size": width.group_size, "mode": width.mode}
        )
        if width is None:
            tensors.append((f"{p}.weight", mx_dtype_name(fdtype), want))
        else:
            for suffix, dt, shp in _quant_shapes(want[:-1], want[-1], fdtype, width):
                tensors.append((f"{p}.{suffix}", dt, shp))
        if e0[p]["bias"] is not None:
            bshape = tuple(e0[p]["bias"].shape)
            if (s.num_experts, *bshape) != expected.get(f"{s.module}.{p}.bias"):
                raise ModelLoadError(
                    f"config.json does not match the weights: layer {s.layer} "
                    f"expert {p}.bias has shape {list(bshape)}"
                )
            tensors.append((f"{p}.bias", mx_dtype_name(e0[p]["bias"].dtype), bshape))
        elif f"{s.module}.{p}.bias" in expected:
            raise ModelLoadError(f"layer {s.layer}: expert {p}.bias is missing from the checkpoint")
    return LayerLayout.plan(s.layer, s.module, s.num_experts, tensors, quant)


def _write_layer(s, lay: LayerLayout, folder: Path, stats, expected, report) -> None:
    import mlx.core as mx

    w_lw = LayerWriter(folder, lay)
    try:
        per_tensor = {p: Moments() for p in s.projs}
        for e in range(s.num_experts):
            exp = s.fetch(e)
            rec = {}
            for p in s.projs:
                w = exp[p]["w"]
                q = lay.quantization[p]
                if (
                    isinstance(w, QuantSrc)
                    and q is not None
                    and (w.bits, w.group_size, w.mode) == (q["bits"], q["group_size"], q["mode"])
                ):
                    outs = [w.weight, w.scales] + ([w.biases] if w.biases is not None else [])
                    x = w.dequantize()
                else:
                    x = _expert_float(w, None)
                    outs = (
                        mx.quantize(x, q["group_size"], q["bits"], mode=q["mode"])
                        if q is not None
                        else [x]
                    )
                per_tensor[p].add(x)
                names = ["weight", "scales", "biases"] if q is not None else ["weight"]
                for n, a in zip(names, outs, strict=False):
                    rec[f"{p}.{n}"] = a
                if exp[p]["bias"] is not None:
                    rec[f"{p}.bias"] = exp[p]["bias"]
                    kf = stats["keep_float"]
                    kf.params += exp[p]["bias"].size
                    kf.moments.add(exp[p]["bias"])
            w_lw.write(e, rec)
            report("experts", f"layer {lay.layer} expert {e}", lay.record_size)
        w_lw.close()
    except BaseException:
        w_lw.abort()
        raise
    st, kf = stats["routed"], stats["keep_float"]
    for p in s.projs:
        n = 1
        for d in expected[f"{s.module}.{p}.weight"]:  # [E, out, in]
            n *= d
        st.params += n
        st.tensors += 1
        st.moments.merge(per_tensor[p])
        st.tensor_kurtosis.append(per_tensor[p].excess_kurtosis)
        for t in lay.tensors:
            if t.name == f"{p}.bias":
                kf.bytes += t.nbytes * s.num_experts
                kf.tensors += 1
            elif t.name.startswith(f"{p}."):
                st.bytes += t.nbytes * s.num_experts


def _quant_config(widths, modules, items, layouts) -> dict:
    """mlx-lm's `quantization` dict: defaults plus an entry for every quantizable module."""
    d = widths.dense
    top = d if d.bits is not None else RoleWidth(4, 64)
    q: dict = {"group_size": top.group_size, "bits": top.bits, "mode": top.mode}
    quantized = {
        i.name.rpartition(".")[0]: None
        if i.width is None
        else {"group_size": i.width.group_size, "bits": i.width.bits, "mode": i.width.mode}
        for i in items
        if i.name.endswith(".weight")
    }
    for lay in layouts:
        for p, qp in lay.quantization.items():
            quantized[f"{lay.module}.{p}"] = qp
    for path, m in modules.items():
        if hasattr(m, "to_quantized"):
            q[path] = quantized.get(path) or False
    return q


def _kurt(x: float) -> float | None:
    return None if x != x else round(x, 4)  # NaN (empty or constant) -> null in JSON


def _manifest(
    config, src: Path, dst: Path, widths, stats, layouts, fallback, items, seconds, peak_rss
) -> Manifest:
    roles = {}
    for r in ROLES:
        st = stats[r]
        w = widths[r]
        ks = [k for k in st.tensor_kurtosis if k == k]
        roles[r] = {
            "bits": w.bits,
            "group_size": w.group_size,
            "mode": w.mode,
            "params": st.params,
            "bytes": st.bytes,
            "tensors": st.tensors,
            "kurtosis": _kurt(st.moments.excess_kurtosis),
            "kurtosis_median_tensor": _kurt(statistics.median(ks)) if ks else None,
        }
    section = experts_section(layouts) if layouts else None
    old = Manifest.load(src)
    source = old.source if old is not None and old.source else str(src)
    return Manifest(
        architecture=config["model_type"],
        name=dst.name,
        source=source,
        roles=roles,
        experts=section,
        total_bytes=sum(v["bytes"] for v in roles.values()),
        extra={
            "widths": widths.to_dict(),
            "converted_from": str(src),
            "conversion": {
                "seconds": round(seconds, 2),
                "peak_rss_bytes": peak_rss,
                "format": "role-quantized; routed experts in experts/*.bin only",
            },
            "unquantized_fallback": fallback,
            "requantized": [i.name for i in items if i.qsrc is not None and not i.passthrough],
        },
    )
