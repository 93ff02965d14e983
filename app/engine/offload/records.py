"""Per-expert records on disk: the pageable layout of routed experts (SPEC §3).

A converted model folder keeps its routed experts out of the safetensors, one file per MoE
layer, one fixed-size record per expert, so that the pager reads one expert with one
positioned read (`os.pread`), never through an mmap of the whole checkpoint.

Folder:
    experts/layer_{L:04d}.bin     L = the mlx-lm layer index (`model.layers.L`, `backbone.layers.L`)

Layer file (all integers little-endian):
    [0, 4096)                       header page: magic b"RQEXPRT1", uint32 n, n bytes of UTF-8
                                    JSON (the layer's layout without checksums), zero padding
    [data_offset + e * stride, +record_size)   record of expert e (data_offset = 4096)
    stride = record_size rounded up to ALIGNMENT (4096), so every record starts page-aligned;
    the file is exactly data_offset + num_experts * stride bytes.

Record: the expert's tensors in layout order, each at its `offset` inside the record (a
multiple of 64), C-contiguous raw bytes of its MLX dtype (bfloat16 as its two raw bytes); the
gaps are zero. Tensor names are the parameter names under the layer's expert module, in the
mlx-lm layout with the expert axis dropped, e.g. for `model.layers.3.mlp.switch_mlp`:
    gate_proj.weight uint32 [I, H*bits/32]   gate_proj.scales / .biases  [I, H/group]
    up_proj.*  (same)                         down_proj.weight uint32 [H, I*bits/32], ...
nemotron_h has fc1.* / fc2.* (non-gated relu2 experts); gpt_oss adds the float `*.bias` [out].
An unquantized role stores only `*.weight` in its float dtype.

Manifest (`rotaryquant.json`) section `experts`:
    {"format": "rotaryquant-experts", "version": 1, "alignment": 4096, "dir": "experts",
     "layers": {"3": {"file": "experts/layer_0003.bin", "module": "model.layers.3.mlp.switch_mlp",
                      "num_experts": 8, "data_offset": 4096, "stride": 8192, "record_size": 6272,
                      "tensors": [{"name": "gate_proj.weight", "dtype": "uint32",
                                   "shape": [64, 16], "offset": 0, "nbytes": 4096}, ...],
                      "quantization": {"gate_proj": {"bits": 2, "group_size": 64,
                                                     "mode": "affine"}, ...},   # null: float
                      "checksums": [crc32 of record e's record_size bytes, ...]}}}

Stacking the records of a layer along a new axis 0 gives exactly the mlx-lm parameters of
that module (`switch_mlp.gate_proj.weight` [E, I, H*bits/32], ...).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import EngineError

FORMAT = "rotaryquant-experts"
VERSION = 1
MAGIC = b"RQEXPRT1"
ALIGNMENT = 4096  # page size: records start on page boundaries for direct positioned reads
TENSOR_ALIGN = 64  # cache line: each tensor in a record starts on one
HEADER_SIZE = 4096
EXPERTS_DIR = "experts"

# MLX dtype name -> (numpy dtype used to hold the raw bytes, item size)
_DTYPES = {
    "uint32": (np.uint32, 4),
    "uint8": (np.uint8, 1),
    "float32": (np.float32, 4),
    "float16": (np.float16, 2),
    "bfloat16": (np.uint16, 2),  # numpy has no bfloat16: carried as raw uint16
}


class ExpertRecordError(EngineError):
    """An expert record is missing, truncated or corrupt: names the file, layer and expert."""

    def __init__(
        self,
        reason: str,
        path: str | None = None,
        layer: int | None = None,
        expert: int | None = None,
    ):
        self.reason, self.path, self.layer, self.expert = reason, path, layer, expert
        where = []
        if layer is not None:
            where.append(f"layer {layer}")
        if expert is not None:
            where.append(f"expert {expert}")
        msg = ", ".join(where) + f": {reason}" if where else reason
        super().__init__(f"{path}: {msg}" if path else msg)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def layer_file_name(layer: int) -> str:
    return f"{EXPERTS_DIR}/layer_{layer:04d}.bin"


@dataclass(frozen=True)
class TensorSpec:
    name: str  # e.g. "gate_proj.weight"
    dtype: str  # MLX dtype name
    shape: tuple[int, ...]
    offset: int  # byte offset inside the record
    nbytes: int

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"{self.name}: unsupported record dtype {self.dtype!r}")
        count = 1
        for s in self.shape:
            count *= s
        if count * _DTYPES[self.dtype][1] != self.nbytes:
            raise ValueError(f"{self.name}: nbytes {self.nbytes} does not match {self.shape}")
        if self.offset % TENSOR_ALIGN:
            raise ValueError(f"{self.name}: offset {self.offset} is not {TENSOR_ALIGN}-aligned")

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TensorSpec:
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"])


@dataclass
class LayerLayout:
    layer: int
    file: str  # relative to the model folder
    module: str  # mlx-lm module path of the stacked experts, e.g. model.layers.3.mlp.switch_mlp
    num_experts: int
    tensors: tuple[TensorSpec, ...]
    quantization: dict  # projection -> {"bits", "group_size", "mode"} or None (float)
    record_size: int
    stride: int
    data_offset: int = HEADER_SIZE
    checksums: list[int] = field(default_factory=list)
    # a view of experts [first, first + num_experts) of a file holding `file_experts` (an
    # expert-parallel rank's share, `share`); 0 / None: the whole file
    first: int = 0
    file_experts: int | None = None

    def __post_init__(self):
        if not isinstance(self.file, str) or not isinstance(self.module, str):
            raise ValueError(f"layer {self.layer}: file and module must be text")
        if self.layer < 0 or self.record_size < 1 or self.data_offset < 0:
            raise ValueError(f"layer {self.layer}: negative index, offset or empty record")
        if self.num_experts < 1:
            raise ValueError(f"layer {self.layer}: num_experts must be >= 1")
        if self.stride % ALIGNMENT or self.stride < self.record_size:
            raise ValueError(f"layer {self.layer}: bad stride {self.stride}")
        end = max((t.offset + t.nbytes for t in self.tensors), default=0)
        if end > self.record_size:
            raise ValueError(f"layer {self.layer}: tensors overrun the record")
        if self.checksums and len(self.checksums) != self.num_experts:
            raise ValueError(
                f"layer {self.layer}: {len(self.checksums)} checksums for "
                f"{self.num_experts} experts"
            )

    @classmethod
    def plan(
        cls,
        layer: int,
        module: str,
        num_experts: int,
        tensors: list[tuple[str, str, tuple[int, ...]]],
        quantization: dict,
    ) -> LayerLayout:
        """Lay out `tensors` [(name, dtype, shape)] inside one record, each 64-byte aligned."""
        specs, off = [], 0
        for name, dtype, shape in tensors:
            if dtype not in _DTYPES:
                raise ValueError(f"{module}.{name}: unsupported record dtype {dtype!r}")
            n = _DTYPES[dtype][1]
            for s in shape:
                n *= s
            off = _round_up(off, TENSOR_ALIGN)
            specs.append(TensorSpec(name, dtype, tuple(int(s) for s in shape), off, n))
            off += n
        record_size = max(off, 1)
        return cls(
            layer,
            layer_file_name(layer),
            module,
            num_experts,
            tuple(specs),
            dict(quantization),
            record_size,
            _round_up(record_size, ALIGNMENT),
        )

    def record_offset(self, expert: int) -> int:
        return self.data_offset + (self.first + expert) * self.stride

    def share(self, lo: int, hi: int) -> LayerLayout:
        """The layout of experts [lo, hi) alone, renumbered 0 … hi-lo-1, over the same file."""
        if not 0 <= lo < hi <= self.num_experts:
            raise ValueError(f"layer {self.layer}: experts [{lo}, {hi}) of {self.num_experts}")
        from dataclasses import replace

        return replace(
            self,
            num_experts=hi - lo,
            checksums=list(self.checksums[lo:hi]) if self.checksums else [],
            first=self.first + lo,
            file_experts=self.file_experts or self.num_experts,
        )

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's tensors (a resident slot), alignment padding not counted."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def slot_elements(self) -> int:
        """Elements of one expert's largest tensor, packed quantized weights counted as the
        weights they hold: how far a gathered matmul's weight offset moves per slot."""
        per = 1
        for t in self.tensors:
            n = 1
            for s in t.shape:
                n *= s
            q = self.quantization.get(t.name.split(".")[0])
            if t.name.endswith(".weight") and q is not None:
                n = n * 32 // q["bits"]  # packed uint32 -> weights
            per = max(per, n)
        return per

    @property
    def file_size(self) -> int:
        return self.data_offset + (self.file_experts or self.num_experts) * self.stride

    def to_dict(self, checksums: bool = True) -> dict:
        skip = ("tensors", "checksums")
        if self.file_experts is None:  # a whole file: the manifest's form
            skip += ("first", "file_experts")
        d = {k: v for k, v in asdict(self).items() if k not in skip}
        d["tensors"] = [t.to_dict() for t in self.tensors]
        if checksums:
            d["checksums"] = list(self.checksums)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LayerLayout:
        return cls(
            layer=int(d["layer"]),
            file=d["file"],
            module=d["module"],
            num_experts=int(d["num_experts"]),
            tensors=tuple(TensorSpec.from_dict(t) for t in d["tensors"]),
            quantization=dict(d.get("quantization", {})),
            record_size=int(d["record_size"]),
            stride=int(d["stride"]),
            data_offset=int(d.get("data_offset", HEADER_SIZE)),
            checksums=[int(c) for c in d.get("checksums", [])],
            first=int(d.get("first", 0)),
            file_experts=int(d["file_experts"]) if d.get("file_experts") else None,
        )


def experts_section(layouts: list[LayerLayout]) -> dict:
    """The manifest's `experts` section for these layers."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "alignment": ALIGNMENT,
        "dir": EXPERTS_DIR,
        "layers": {str(lay.layer): lay.to_dict() for lay in layouts},
    }


def _to_bytes(arr, spec: TensorSpec) -> bytes:
    """Raw C-order bytes of an mx.array or numpy array, checked against `spec`."""
    import mlx.core as mx

    if isinstance(arr, mx.array):
        if str(arr.dtype).removeprefix("mlx.core.") != spec.dtype:
            raise ValueError(f"{spec.name}: dtype {arr.dtype}, layout says {spec.dtype}")
        if arr.dtype == mx.bfloat16:
            arr = arr.view(mx.uint16)
        arr = np.asarray(arr)
    else:
        if np.dtype(arr.dtype) != np.dtype(_DTYPES[spec.dtype][0]):
            raise ValueError(f"{spec.name}: dtype {arr.dtype}, layout says {spec.dtype}")
    if tuple(arr.shape) != spec.shape:
        raise ValueError(f"{spec.name}: shape {tuple(arr.shape)}, layout says {spec.shape}")
    return np.ascontiguousarray(arr).tobytes()


class LayerWriter:
    """Writes the records of one layer file, in any order; `close()` checks that every expert
    was written and returns the layout with its checksums."""

    def __init__(self, folder: str | os.PathLike, layout: LayerLayout):
        self.layout = layout
        self.path = Path(folder) / layout.file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._crc: list[int | None] = [None] * layout.num_experts
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        header = json.dumps(layout.to_dict(checksums=False), sort_keys=True).encode()
        if len(MAGIC) + 4 + len(header) > HEADER_SIZE:
            raise ValueError(f"layer {layout.layer}: layout too large for the header page")
        page = MAGIC + struct.pack("<I", len(header)) + header
        os.pwrite(self._fd, page.ljust(HEADER_SIZE, b"\0"), 0)
        os.ftruncate(self._fd, layout.file_size)  # zero-filled, sparse until written

    def write(self, expert: int, tensors: dict) -> int:
        """Write expert `expert`'s tensors (mx or numpy arrays by record name); returns its CRC."""
        lay = self.layout
        if not 0 <= expert < lay.num_experts:
            raise ValueError(f"layer {lay.layer}: expert {expert} out of range")
        names = {t.name for t in lay.tensors}
        if set(tensors) != names:
            raise ValueError(
                f"layer {lay.layer} expert {expert}: tensors {sorted(tensors)} "
                f"do not match the layout {sorted(names)}"
            )
        buf = bytearray(lay.record_size)
        for spec in lay.tensors:
            buf[spec.offset : spec.offset + spec.nbytes] = _to_bytes(tensors[spec.name], spec)
        n = os.pwrite(self._fd, buf, lay.record_offset(expert))
        if n != len(buf):
            raise OSError(f"{self.path}: short write ({n} of {len(buf)} bytes)")
        crc = zlib.crc32(buf)
        self._crc[expert] = crc
        return crc

    def close(self) -> LayerLayout:
        missing = [e for e, c in enumerate(self._crc) if c is None]
        os.fsync(self._fd)
        os.close(self._fd)
        if missing:
            raise ValueError(f"layer {self.layout.layer}: experts {missing[:8]} never written")
        self.layout.checksums = [int(c) for c in self._crc]
        return self.layout

    def abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


class ExpertStore:
    """Reads expert records of a converted folder: one positioned read per expert.

    Not thread-safe per layer file descriptor beyond what pread guarantees (pread itself is
    safe to call from several threads on one fd); MLX arrays are created in the caller's thread.
    """

    def __init__(self, folder: str | os.PathLike, section: dict | None = None):
        self.folder = Path(folder)
        if section is None:
            from ..manifest import Manifest

            m = Manifest.load(self.folder)
            section = m.experts if m is not None else None
            if not section:
                raise ExpertRecordError(
                    "no expert records: manifest has no `experts` section",
                    str(self.folder / "rotaryquant.json"),
                )
        if not isinstance(section, dict):
            raise ExpertRecordError(
                "manifest `experts` must be an object", str(self.folder / "rotaryquant.json")
            )
        if section.get("format") != FORMAT:
            raise ExpertRecordError(
                f"unknown experts format {section.get('format')!r}", str(self.folder)
            )
        if int(section.get("version", 0)) > VERSION:
            raise ExpertRecordError(
                f"experts format version {section.get('version')} is newer "
                f"than this app reads ({VERSION})",
                str(self.folder),
            )
        self.layouts = self._parse_layers(section.get("layers"))
        self._fds: dict[int, int] = {}

    def _parse_layers(self, layers) -> dict[int, LayerLayout]:
        """The manifest's layer layouts, checked: each a complete layout whose file lies inside
        the model folder (a manifest never makes the app open another file)."""
        where = str(self.folder / "rotaryquant.json")
        if not isinstance(layers, dict) or not layers:
            raise ExpertRecordError(
                f"manifest `experts.layers` must map layer indices to layouts, got {layers!r:.60}",
                where,
            )
        root = self.folder.resolve()
        out = {}
        for k, v in layers.items():
            try:
                lay = LayerLayout.from_dict(v)
                if str(lay.layer) != str(k):
                    raise ValueError(f"key {k!r} holds layer {lay.layer}")
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ExpertRecordError(
                    f"manifest `experts.layers.{k}` is malformed: {type(e).__name__}: {e}", where
                ) from None
            path = (root / lay.file).resolve()
            if Path(lay.file).is_absolute() or not path.is_relative_to(root):
                raise ExpertRecordError(
                    f"expert file {lay.file!r} is outside the model folder", where, lay.layer
                )
            out[lay.layer] = lay
        return out

    @property
    def layers(self) -> list[int]:
        return sorted(self.layouts)

    def layout(self, layer: int) -> LayerLayout:
        try:
            return self.layouts[layer]
        except KeyError:
            raise ExpertRecordError(
                "no such MoE layer in the expert records", str(self.folder), layer
            ) from None

    def expert_bytes(self) -> int:
        """Bytes of every layer's experts (what a budget of 100% holds)."""
        return sum(self.layout(x).expert_bytes * self.layout(x).num_experts for x in self.layers)

    def _fd(self, layer: int) -> int:
        fd = self._fds.get(layer)
        if fd is None:
            lay = self.layout(layer)
            path = self.folder / lay.file
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise ExpertRecordError("expert file is missing", str(path), layer) from None
            size = os.fstat(fd).st_size
            if size != lay.file_size:
                os.close(fd)
                what = "truncated" if size < lay.file_size else "has trailing bytes"
                raise ExpertRecordError(
                    f"expert file {what}: expected {lay.file_size} bytes, found {size}",
                    str(path),
                    layer,
                )
            head = os.pread(fd, HEADER_SIZE, 0)
            if head[: len(MAGIC)] != MAGIC:
                os.close(fd)
                raise ExpertRecordError("not an expert record file (bad magic)", str(path), layer)
            self._fds[layer] = fd
        return fd

    def _check_expert(self, layer: int, expert: int) -> LayerLayout:
        lay = self.layout(layer)
        if not 0 <= expert < lay.num_experts:
            raise ExpertRecordError(
                f"expert index out of range (0..{lay.num_experts - 1})",
                str(self.folder / lay.file),
                layer,
                expert,
            )
        return lay

    def read_raw(self, layer: int, expert: int, out: np.ndarray | None = None) -> np.ndarray:
        """The record's bytes (uint8 [record_size]) with one positioned read, into `out`
        (a writable uint8 buffer of at least record_size bytes) when given."""
        lay = self._check_expert(layer, expert)
        fd = self._fd(layer)
        off = lay.record_offset(expert)
        if out is None:
            out = np.empty(lay.record_size, dtype=np.uint8)
        view = memoryview(out).cast("B")[: lay.record_size]
        if len(view) < lay.record_size:
            raise ValueError(f"buffer of {len(view)} bytes < record size {lay.record_size}")
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view], off)
        else:  # Windows has no preadv; one pread plus a copy
            data = os.pread(fd, lay.record_size, off)
            view[: len(data)] = data
            n = len(data)
        if n != lay.record_size:
            raise ExpertRecordError(
                f"short read ({n} of {lay.record_size} bytes)",
                str(self.folder / lay.file),
                layer,
                expert,
            )
        return np.frombuffer(view, dtype=np.uint8)

    def arrays(self, layer: int, raw: np.ndarray) -> dict[str, np.ndarray]:
        """Numpy views of the tensors inside a record's bytes (bfloat16 as raw uint16)."""
        lay = self.layout(layer)
        res = {}
        for t in lay.tensors:
            np_dtype = _DTYPES[t.dtype][0]
            res[t.name] = raw[t.offset : t.offset + t.nbytes].view(np_dtype).reshape(t.shape)
        return res

    def read(self, layer: int, expert: int, verify: bool = False) -> dict:
        """Expert `expert` of `layer` as mx.arrays by record name (e.g. "gate_proj.weight")."""
        import mlx.core as mx

        raw = self.read_raw(layer, expert)
        if verify:
            self._verify_bytes(layer, expert, raw)
        lay = self.layout(layer)
        out = {}
        for (name, a), t in zip(self.arrays(layer, raw).items(), lay.tensors, strict=True):
            arr = mx.array(a)
            out[name] = arr.view(mx.bfloat16) if t.dtype == "bfloat16" else arr
        return out

    def read_layer(self, layer: int, verify: bool = True) -> dict:
        """All experts of `layer` stacked along axis 0: the mlx-lm parameters of the module.
        `verify`: each record's CRC is checked while its bytes are in hand (one pass)."""
        import mlx.core as mx

        lay = self.layout(layer)
        stacked = {
            t.name: np.empty((lay.num_experts, *t.shape), dtype=_DTYPES[t.dtype][0])
            for t in lay.tensors
        }
        buf = np.empty(lay.record_size, dtype=np.uint8)
        for e in range(lay.num_experts):
            self.read_raw(layer, e, out=buf)
            if verify:
                self._verify_bytes(layer, e, buf)
            for name, a in self.arrays(layer, buf).items():
                stacked[name][e] = a
        out = {}
        for t in lay.tensors:
            arr = mx.array(stacked.pop(t.name))
            out[t.name] = arr.view(mx.bfloat16) if t.dtype == "bfloat16" else arr
        return out

    def _verify_bytes(self, layer: int, expert: int, raw: np.ndarray) -> None:
        lay = self.layout(layer)
        if not lay.checksums:
            raise ExpertRecordError(
                "manifest has no checksums for this layer",
                str(self.folder / lay.file),
                layer,
                expert,
            )
        crc = zlib.crc32(memoryview(raw)[: lay.record_size])
        if crc != lay.checksums[expert]:
            raise ExpertRecordError(
                f"checksum mismatch (crc32 {crc:#010x}, manifest "
                f"{lay.checksums[expert]:#010x}): the file is corrupt",
                str(self.folder / lay.file),
                layer,
                expert,
            )

    def verify(self, layer: int, expert: int) -> None:
        """Raise ExpertRecordError naming layer and expert if the record's size or CRC is off."""
        self._verify_bytes(layer, expert, self.read_raw(layer, expert))

    def verify_all(self, progress=None) -> None:
        for layer in self.layers:
            for e in range(self.layouts[layer].num_experts):
                self.verify(layer, e)
            if progress:
                progress(layer)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
