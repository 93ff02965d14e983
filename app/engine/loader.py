"""Loading a model from a local folder through mlx-lm, with clear errors for bad folders.

The engine loads only local paths; nothing here talks to the hub.
"""

from __future__ import annotations

import json
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError, UnsupportedArchitectureError
from .manifest import Manifest
from .quant.converted import expert_weights

# safetensors: 8-byte little-endian header length, a JSON header, then the tensor bytes.
_ST_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
_MAX_HEADER = 100 * 1024 * 1024  # a header larger than this is garbage, not a model


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    config: dict
    path: Path
    manifest: Manifest | None

    @property
    def architecture(self) -> str:
        return self.config.get("model_type", "?")


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """Parse and check a safetensors header against the file's size. Raises ModelLoadError."""
    return read_safetensors_layout(path)[0]


def read_safetensors_layout(path: str | os.PathLike) -> tuple[dict, int]:
    """The checked header and the file offset where tensor data starts (8 + header length):
    a tensor's bytes are at that offset + its `data_offsets`."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise ModelLoadError("file is empty or truncated (no safetensors header)", str(path))
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise ModelLoadError(
                f"corrupt or truncated safetensors file (header claims {n} bytes, file has {size})",
                str(path),
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"corrupt safetensors header: {e}", str(path)) from e
    if not isinstance(header, dict):
        raise ModelLoadError("corrupt safetensors header: not a JSON object", str(path))
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = t["data_offsets"]
            nbytes = _ST_DTYPE_BYTES[t["dtype"]]
            count = 1
            for s in t["shape"]:
                count *= s
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"corrupt safetensors header entry {name!r}", str(path)) from e
        if hi - lo != count * nbytes or lo > hi:
            raise ModelLoadError(f"tensor {name!r} has inconsistent offsets", str(path))
        end = max(end, hi)
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "has trailing bytes"
        raise ModelLoadError(
            f"safetensors file {what}: expected {8 + n + end} bytes, found {size}", str(path)
        )
    return header, 8 + n


def read_config(path: str | os.PathLike) -> dict:
    """`path`/config.json, checked to be a JSON object with a model_type. Raises ModelLoadError."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError("no such folder", str(path))
    if not path.is_dir():
        raise ModelLoadError("not a folder", str(path))
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError("not a model folder: config.json is missing", str(path))
    try:
        config = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"config.json is not valid JSON: {e}", str(cfg_path)) from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError("config.json has no model_type", str(cfg_path))
    from .sizes import SizeError, check_dimensions

    try:
        check_dimensions(config)
    except SizeError as e:
        raise ModelLoadError(e.reason, str(cfg_path)) from None
    return config


def check_folder(path: str | os.PathLike) -> tuple[dict, Manifest | None]:
    """Check that `path` is a loadable model folder; return its config and manifest."""
    path = Path(path)
    config = read_config(path)
    cfg_path = path / "config.json"
    model_type = config["model_type"]
    if not _architecture_supported(config):
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported by mlx-lm", str(cfg_path)
        )
    manifest = Manifest.load(path)
    shards = sorted(path.glob("model*.safetensors"))
    if not shards:
        raise ModelLoadError("no weights: model*.safetensors is missing", str(path))
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"corrupt shard index: {e}", str(index)) from e
        missing = sorted(w for w in wanted if not (path / w).exists())
        if missing:
            raise ModelLoadError(f"missing weight shard {missing[0]}", str(path / missing[0]))
    for shard in shards:
        read_safetensors_header(shard)
    if not any(
        (path / t).exists() for t in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    ):
        raise ModelLoadError("no tokenizer (tokenizer.json or tokenizer.model)", str(path))
    return config, manifest


def _architecture_supported(config: dict) -> bool:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, ImportError):
        return False
    return True


def mlx_lm_has_model(model_type: str) -> bool:
    """Whether mlx-lm has a module for `model_type`, read from its files without importing it
    (the window process never loads MLX)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    remap: dict = {}
    try:
        for node in ast.parse((root / "utils.py").read_text()).body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "MODEL_REMAPPING" for t in node.targets
            ):
                remap = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass  # no remapping known: the module name is the model type
    return (root / "models" / f"{remap.get(model_type, model_type)}.py").is_file()


@contextmanager
def weight_errors(path: Path, keep: tuple[type[BaseException], ...] = ()):
    """Turn mlx-lm's weight-loading errors into ModelLoadError naming `path`; `keep` passes."""
    try:
        yield
    except keep:
        raise
    except ValueError as e:
        # mlx-lm raises ValueError for weights that don't match the config (missing/extra keys,
        # wrong shapes).
        raise ModelLoadError(f"weights do not match config.json: {e}", str(path)) from e
    except (OSError, RuntimeError) as e:
        raise ModelLoadError(f"could not read weights: {e}", str(path)) from e


def sanitized_weights(path: Path):
    """The lazily built model of `path` with its sanitized safetensors, not yet loaded ->
    (model, config, weights). strict=False: a converted folder's routed experts are not in
    the safetensors. Call inside `weight_errors`."""
    import glob

    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, config = load_model(path, lazy=True, strict=False)
    weights = {}
    for wf in sorted(glob.glob(str(path / "model*.safetensors"))):
        weights.update(mx.load(wf))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    return model, config, weights


def load_exact(model, weights: dict) -> None:
    """Load `weights` into `model`, which must name exactly these parameters (the paged
    layers' experts are not parameters): a missing or extra name is a ValueError naming the
    first of each. Call inside `weight_errors`."""
    from mlx.utils import tree_flatten

    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise ValueError(f"{what} ({len(missing)} missing, {len(extra)} unexpected)")
    model.load_weights(list(weights.items()), strict=True)


def folder_tokenizer(path: Path, config: dict):
    """mlx-lm's tokenizer of `path`. Raises ModelLoadError."""
    from mlx_lm.utils import load_tokenizer

    try:
        return load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizers raise many types; all mean the same to the user
        raise ModelLoadError(f"could not load the tokenizer: {e}", str(path)) from e


def load(path: str | os.PathLike, lazy: bool = False, verify: bool = True) -> LoadedModel:
    """Load a model folder, every weight resident. Raises ModelLoadError naming the file and the
    reason. A converted folder keeps its routed experts in per-expert records: they are stacked
    back into the model, each record's checksum checked as it is read (verify=False skips it)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    path = Path(path).resolve()
    config, manifest = check_folder(path)
    if manifest is None or not manifest.experts:
        with weight_errors(path):
            model, config = load_model(path, lazy=lazy)
        return LoadedModel(model, folder_tokenizer(path, config), config, path, manifest)
    # the strict load covers dense and experts together
    with weight_errors(path):
        model, config, weights = sanitized_weights(path)
        weights.update(expert_weights(path, manifest.experts, verify=verify))
        model.load_weights(list(weights.items()), strict=True)
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    return LoadedModel(model, folder_tokenizer(path, config), config, path, manifest)
