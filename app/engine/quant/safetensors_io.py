"""Streaming safetensors: read one tensor, one slice along axis 0 or a block of rows with
positioned reads, and write sharded files whose headers are planned before any data.

`mx.load` is lazy per tensor but not per slice; the converter needs one expert of a fused
[E, ...] tensor, or a block of rows of a 1 GB embedding, without holding the rest.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError
from ..loader import read_safetensors_layout

# safetensors dtype -> (numpy dtype holding the raw bytes, MLX dtype name it becomes)
_ST = {
    "F32": (np.float32, "float32"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),
    "U8": (np.uint8, "uint8"),
    "I8": (np.int8, "int8"),
    "U16": (np.uint16, "uint16"),
    "I16": (np.int16, "int16"),
    "U32": (np.uint32, "uint32"),
    "I32": (np.int32, "int32"),
    "U64": (np.uint64, "uint64"),
    "I64": (np.int64, "int64"),
    "BOOL": (np.bool_, "bool"),
    "F8_E4M3": (np.uint8, "uint8"),  # raw fp8 bytes: mx.from_fp8 turns them into floats
}
_MX_TO_ST = {v[1]: k for k, v in _ST.items() if k not in ("F8_E4M3",)}


def mx_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def mx_dtype(self) -> str:
        return _ST[self.dtype][1]


class SafetensorsReader:
    """All tensors of a checkpoint folder (sharded with an index, or single files), checked
    against the index and the files' sizes before anything is read."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.tensors: dict[str, TensorInfo] = {}
        self._fds: dict[Path, int] = {}
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ModelLoadError(f"corrupt shard index: {e}", str(index)) from e
            for f in files:
                if not (self.folder / f).exists():
                    raise ModelLoadError(
                        f"missing weight shard {f} (listed in the index)", str(self.folder / f)
                    )
        else:
            weight_map = None
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError("no weights: no *.safetensors file", str(self.folder))
        for f in files:
            path = self.folder / f
            header, data_start = read_safetensors_layout(path)
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                if t["dtype"] not in _ST:
                    raise ModelLoadError(
                        f"tensor {name!r} has unsupported dtype {t['dtype']}", str(path)
                    )
                if name in self.tensors:
                    raise ModelLoadError(
                        f"tensor {name!r} is in two shards "
                        f"({self.tensors[name].file.name} and {f})",
                        str(path),
                    )
                lo, hi = t["data_offsets"]
                self.tensors[name] = TensorInfo(
                    name, path, t["dtype"], tuple(t["shape"]), data_start + lo, hi - lo
                )
        if weight_map is not None:
            for name, f in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != f:
                    raise ModelLoadError(
                        f"tensor {name!r} listed in the index is not in {f}", str(self.folder / f)
                    )

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _read(self, info: TensorInfo, offset: int, nbytes: int, shape: tuple[int, ...]):
        import mlx.core as mx

        np_dtype = _ST[info.dtype][0]
        buf = np.empty(nbytes, dtype=np.uint8)
        n = (
            os.preadv(self._fd(info.file), [memoryview(buf)], info.start + offset)
            if hasattr(os, "preadv")
            else _pread_into(self._fd(info.file), buf, info.start + offset)
        )
        if n != nbytes:
            raise ModelLoadError(
                f"tensor {info.name!r} is truncated (read {n} of {nbytes} bytes)", str(info.file)
            )
        arr = mx.array(buf.view(np_dtype).reshape(shape))
        return arr.view(mx.bfloat16) if info.dtype == "BF16" else arr

    def read(self, name: str):
        """The whole tensor as an mx.array (fp8 as its raw uint8 bytes)."""
        info = self.tensors[name]
        return self._read(info, 0, info.nbytes, info.shape)

    def read_rows(self, name: str, start: int, stop: int):
        """Rows [start, stop) along axis 0 (one expert of a fused [E, ...] tensor when
        stop = start + 1, keeping the axis)."""
        info = self.tensors[name]
        if not info.shape or not 0 <= start < stop <= info.shape[0]:
            raise IndexError(f"{name}: rows [{start}, {stop}) of shape {info.shape}")
        row = info.nbytes // info.shape[0]
        return self._read(info, start * row, (stop - start) * row, (stop - start, *info.shape[1:]))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> int:
    data = os.pread(fd, buf.nbytes, offset)
    memoryview(buf)[: len(data)] = data
    return len(data)


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str  # MLX dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = np.dtype(_ST[_MX_TO_ST[self.dtype]][0]).itemsize
        for s in self.shape:
            n *= s
        return n


class ShardedWriter:
    """Writes tensors planned up front into `model-XXXXX-of-YYYYY.safetensors` shards plus the
    index; each tensor may arrive whole or as blocks of rows, in any order."""

    def __init__(
        self, folder: str | os.PathLike, plan: list[OutTensor], max_shard_bytes: int = 5 << 30
    ):
        self.folder = Path(folder)
        shards: list[list[OutTensor]] = [[]]
        size = 0
        for t in plan:
            if shards[-1] and size + t.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
        n = len(shards)
        self._where: dict[str, tuple[int, int, OutTensor]] = {}  # name -> (fd, offset, tensor)
        self._written: dict[str, int] = {}
        self._fds: list[int] = []
        self.weight_map: dict[str, str] = {}
        self.files: list[Path] = []
        for i, tensors in enumerate(shards):
            fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            header: dict = {"__metadata__": {"format": "mlx"}}
            off = 0
            for t in tensors:
                header[t.name] = {
                    "dtype": _MX_TO_ST[t.dtype],
                    "shape": list(t.shape),
                    "data_offsets": [off, off + t.nbytes],
                }
                off += t.nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # safetensors: data starts 8-byte aligned
            path = self.folder / fname
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(fd, 8 + len(raw) + off)
            self._fds.append(fd)
            self.files.append(path)
            base = 8 + len(raw)
            for t in tensors:
                self._where[t.name] = (fd, base + header[t.name]["data_offsets"][0], t)
                self._written[t.name] = 0
                self.weight_map[t.name] = fname

    def write(self, name: str, arr, row: int = 0) -> None:
        """Write `arr` (all of tensor `name`, or its rows from `row` on)."""
        import mlx.core as mx

        fd, off, t = self._where[name]
        if (
            mx_dtype_name(arr.dtype) != t.dtype
            or tuple(arr.shape[1:]) != t.shape[1:]
            or (not t.shape and arr.shape != ())
        ):
            raise ValueError(f"{name}: got {arr.dtype} {arr.shape}, planned {t.dtype} {t.shape}")
        if t.shape and row + arr.shape[0] > t.shape[0]:
            raise ValueError(f"{name}: rows {row}..{row + arr.shape[0]} beyond {t.shape[0]}")
        if arr.dtype == mx.bfloat16:
            arr = arr.view(mx.uint16)
        data = np.ascontiguousarray(np.asarray(arr))
        row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else 0
        n = os.pwrite(fd, memoryview(data).cast("B"), off + row * row_bytes)
        if n != data.nbytes:
            raise OSError(f"{name}: short write ({n} of {data.nbytes} bytes)")
        self._written[name] += n

    def close(self) -> None:
        """Check that every planned byte was written, sync, and write the index."""
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds = []
        short = [n for n, (_, _, t) in self._where.items() if self._written[n] != t.nbytes]
        if short:
            raise RuntimeError(f"tensors not completely written: {short[:5]}")
        total = sum(t.nbytes for _, _, t in self._where.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(self.weight_map.items())),
        }
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def abort(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
