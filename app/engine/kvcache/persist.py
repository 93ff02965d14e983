"""Save and load a prompt cache (IsoQuant layers and mlx-lm's own) as one safetensors file.

Keyed by a format name and version, never by Python class names alone: IsoQuant layers carry
their own JSON meta (format version, rotation, bits, window, seed, layer); mlx-lm layers are
restored by class from mlx_lm.models.cache (KVCache, RotatingKVCache, ArraysCache, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache

from .isoquant.cache import IsoQuantKVCache

FILE_FORMAT = "rotaryquant-prompt-cache"
FILE_VERSION = 1


def save_cache(path: str | Path, caches: list, metadata: dict | None = None) -> None:
    arrays: dict[str, mx.array] = {}
    layers = []
    for i, c in enumerate(caches):
        if isinstance(c, IsoQuantKVCache):
            entry = {"type": "isoquant", "meta": c.meta_state, "items": []}
        else:
            entry = {"type": "mlx_lm", "class": type(c).__name__, "items": []}
        for j, item in enumerate(c.state):
            if isinstance(item, mx.array):
                arrays[f"{i}.{j}"] = item
                entry["items"].append("array")
            elif item is None or isinstance(item, (int, float, bool, str)):
                entry["items"].append({"value": item})
            elif isinstance(item, list) and all(a is None or isinstance(a, mx.array) for a in item):
                for k, a in enumerate(item):  # ArraysCache: a list of arrays (or Nones)
                    if a is not None:
                        arrays[f"{i}.{j}.{k}"] = a
                entry["items"].append({"list": len(item)})
            else:
                raise ValueError(
                    f"layer {i}: cannot save a {type(item).__name__} in the cache state"
                )
        layers.append(entry)
    head = {"format": FILE_FORMAT, "format_version": FILE_VERSION, "layers": layers}
    meta = {"rotaryquant": json.dumps(head), **{k: str(v) for k, v in (metadata or {}).items()}}
    mx.save_safetensors(str(path), arrays, meta)


def load_cache(path: str | Path) -> tuple[list, dict]:
    """Returns (caches, user metadata)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    try:
        head = json.loads(meta.pop("rotaryquant"))
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{path}: not a RotaryQuant prompt-cache file") from None
    if head.get("format") != FILE_FORMAT or head.get("format_version") != FILE_VERSION:
        raise ValueError(
            f"{path}: prompt-cache format {head.get('format')!r} version "
            f"{head.get('format_version')!r}; this build reads version {FILE_VERSION}"
        )
    caches = []
    for i, entry in enumerate(head["layers"]):
        state = []
        for j, item in enumerate(entry["items"]):
            if item == "array":
                state.append(arrays[f"{i}.{j}"])
            elif "list" in item:
                state.append([arrays.get(f"{i}.{j}.{k}") for k in range(item["list"])])
            else:
                state.append(item["value"])
        if entry["type"] == "isoquant":
            caches.append(IsoQuantKVCache.from_state(tuple(state), entry["meta"]))
        else:
            cls = getattr(mlx_cache, entry["class"], None)
            if cls is None:
                raise ValueError(f"{path}: layer {i} has unknown cache class {entry['class']!r}")
            caches.append(cls.from_state(tuple(state)))
    return caches, meta
