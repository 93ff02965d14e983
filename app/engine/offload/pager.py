"""The expert pager (SPEC §3): a bounded set of routed experts resident in slot tensors, the
rest read from their records on demand, LRU eviction across all MoE layers.

Slots: experts whose records have the same layout (every layer of the models we run) share one
pool: a tensor per record tensor, `[num_slots, *shape]`, so `gather_qmm` runs on slots with
remapped indices and any layer can take any slot. The byte budget is split over pools by
their experts' bytes.

Two paths:
- all resident (budget >= every expert): records are loaded at start, a layer maps expert e to
  slot base+e on the device (`indices + base`); nothing is read back to the host, so the step
  synchronizes exactly as the resident model does.
- paged: each MoE layer call reads its router's indices back to the host (one sync per MoE
  layer: the price of knowing what to read), pins its experts, reads the misses into free or
  least recently used unpinned slots and remaps indices to slots (a per-layer expert -> slot
  list kept with the LRU: plain Python on the call's few ids, no numpy per call). Its pins hold until the
  next call's sync has evaluated this call's output; only then may its slots be overwritten.

Prompts: a call whose (token, expert) pairs route to more distinct experts than the pool
has slots (a long prompt on a small budget) runs in groups of at most `num_slots` experts,
resident ones first; each group's rows are evaluated before the next group reuses the slots,
then the rows are put back in order. The prompt itself is not chunked (attention and the KV
cache see exactly what the resident model sees), so the working set never exceeds the budget.
A call that fits (decode always, prompts on a budget of at least one layer's experts) runs as
one pass with mlx-lm's own pair sorting.

Synchronization, honestly: the all-resident path adds none. The paged path reads each MoE
layer's indices back (one sync per MoE layer and forward pass), also when every expert hits:
the host must know the experts before it can read them, and speculating on an all-hit step
does not pay (at 95% hits, a Qwen3-30B step of 48 layers x 8 experts has 384 lookups and
all hit with probability 0.95^384 ~ 3e-9). Its cost is measured in benchmarks/pager.py
(`always_resolve`: the read-back forced with every expert resident).

Device-resolved paging (`PagerOptions.device_route`, device_route.py): each layer owns an
equal share of its pool's slots and keeps its expert -> slot table on the device; one CUDA
kernel a call resolves hits, picks LRU victims and copies misses straight out of the
page-locked record files, so a decode step reads nothing back. On by default ("auto") where it
can run (H200, Qwen3 shapes at 50%: 75% of resident speed against 29% for the host path);
"reference" runs the same step on the host (its specification; CPU tests).

Writes into slots: with unified memory (CPU, Apple GPU) a record is read with one `preadv`
straight into the slot tensors' memory (zero copies; safe because only unpinned slots are
written, after the sync that finished every computation reading them). Elsewhere (CUDA) the
record is read into pinned host staging and copied into the slots by the driver
(cuda_copy.py), or through MLX staging and a functional scatter where that copier is
unavailable. A call's reads up to INLINE_BYTES run on the calling thread; larger ones are split
over the reader threads, one share on the calling thread.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..errors import EngineError
from .lru import POLICIES, NoFreeSlot
from .records import ExpertRecordError, ExpertStore, LayerLayout, TensorSpec
from .speed import records_pin
from .stats import LayerStats, per_token, total

# the host's work of a paged call by part (seconds, summed; `stats()["host_parts"]` per token):
# readback: wait for the router's indices; ids: which experts hit or miss (and the counts);
# policy: the cache's bookkeeping (pins, recency, victims); reads: the misses' reads (wall,
# dispatch included); scatter: staged records into the slots (not on the zero-copy path);
# index: the slot index array the layer gathers with; graph: the layer's expert graph
HOST_PARTS = ("readback", "ids", "policy", "reads", "scatter", "index", "graph")
INDEX_LIMIT = 1 << 31  # MLX CUDA quantized/gathered matmuls: weight offsets in 32-bit ints
STAGE_BYTES = 64 << 20  # host staging per batch of records (scatter path): bounds transients
INLINE_BYTES = 1 << 20  # a call's reads up to this size run on the calling thread: a round
# trip through the reader threads costs more than copying this much out of the page cache

DEVICE_ROUTES = ("off", "auto", "cuda", "reference")
DEVICE_ROUTE_ENV = "ROTARYQUANT_DEVICE_ROUTE"  # the default of PagerOptions.device_route

_NP_STORAGE = {
    "uint32": np.uint32,
    "uint8": np.uint8,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
}


class BudgetError(EngineError, ValueError):
    """The expert budget cannot hold what the pager needs (at least one expert per pool)."""


@dataclass(frozen=True)
class PagerOptions:
    verify: bool = True  # CRC-check records (size is always checked)
    verify_every_read: bool = False  # CRC on every read; else on a record's first read in
    # the process (the CRC costs ~4x the copy out of the page cache; the file is read-only)
    read_threads: int = 4  # concurrent positioned reads of one call's misses (SSD queue depth)
    always_resolve: bool = False  # read indices back even when all experts are resident
    zero_copy: bool | None = None  # preadv into slot memory; None: on unless CUDA
    drop_page_cache: bool = False  # posix_fadvise DONTNEED after each read (cold-disk runs)
    async_eval: bool = False  # start each paged call's experts at once (device busy while
    # Python builds the graph to the next sync); measured in benchmarks, off until it pays
    device_copy: bool | None = None  # CUDA: records through pinned staging, copied into the
    # slots by the driver (cuda_copy.py); None: where its self-test passes
    bank_elements: int | None = None  # weight elements one slot pool may span: larger pools
    # are split into banks of layers (None: MLX CUDA's 32-bit weight offsets there, else no
    # limit; 0: never split)
    policy: str = "slru"  # eviction: segmented LRU beat LRU on trace routing and tied on
    # random (benchmarks/pager_policy.py); "lru" is plain LRU
    pin_records: bool | None = None  # with the device copier: map the record files and
    # page-lock them once, each miss copied by the driver straight from the page cache (no
    # host copy); None: where the files fit in half the host's available memory
    device_route: str = field(default_factory=lambda: os.environ.get(DEVICE_ROUTE_ENV, "auto"))
    # "cuda": misses resolved by a kernel on the device, no read-back (device_route.py; needs
    # the pinned record files); "auto" (default: 2.6x the host path on Qwen3 shapes at 50%,
    # docs/pager.md): that where it is possible, else the host path; "reference": the same
    # step on the host (unified memory: CPU tests); "off": the host path

    def __post_init__(self):
        if self.read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {self.read_threads}")
        if self.device_route not in DEVICE_ROUTES:
            raise ValueError(
                f"device_route must be one of {DEVICE_ROUTES}, got {self.device_route!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")


def _bank_limit(options: PagerOptions) -> int | None:
    """Weight elements one slot pool may span (None: no limit)."""
    if options.bank_elements is not None:
        return options.bank_elements or None
    import mlx.core as mx

    return INDEX_LIMIT if getattr(mx, "cuda", None) and mx.cuda.is_available() else None


def _banks(
    store: ExpertStore, layers: list[int], slots: int, per_slot: int, limit: int | None
) -> list[tuple[list[int], int]]:
    """Split one layout's layers into banks of contiguous layers, each a pool under `limit`
    weight elements, the slots shared out by experts: [(layers, slots)]. One bank where the
    pool fits (or no limit). A bank's call then gathers from its whole pool in one call
    instead of one call per window of slots."""
    experts = [store.layout(x).num_experts for x in layers]
    total = sum(experts)
    if limit is None or slots <= (limit - 1) // per_slot:
        return [(layers, slots)]
    most = max(1, (limit - 1) // per_slot)  # slots a bank may hold
    for k in range(-(-slots // most), len(layers) + 1):
        bounds = [round(i * len(layers) / k) for i in range(k + 1)]
        out = []
        for a, z in zip(bounds, bounds[1:], strict=False):
            n = sum(experts[a:z])
            out.append((layers[a:z], max(1, min(n, slots * n // total))))
        if all(s <= most for _, s in out):
            return out
    # a layer alone exceeds the limit: one bank per layer (its calls use slot windows)
    return [([x], max(1, min(n, slots * n // total))) for x, n in zip(layers, experts, strict=True)]


def _signature(lay: LayerLayout) -> str:
    return json.dumps(
        [[t.to_dict() for t in lay.tensors], lay.quantization, lay.record_size], sort_keys=True
    )


class SlotPool:
    """Slot tensors for every layer whose records share one layout, and their LRU."""

    def __init__(self, layout: LayerLayout, layers: list[int], num_slots: int, policy: str = "lru"):
        import mlx.core as mx

        self.tensors: tuple[TensorSpec, ...] = layout.tensors
        self.quantization = dict(layout.quantization)
        self.record_size = layout.record_size
        self.layers = layers
        self.num_experts = {lay: 0 for lay in layers}  # filled by the pager
        self.slot_bytes = layout.expert_bytes
        self.num_slots = num_slots
        self.lru = POLICIES[policy](num_slots)
        self.pass_keys = 0  # keys resolved in the current forward pass (SLRU's probation)
        # storage dtype: bfloat16 kept as uint16 so numpy can address it; viewed at use
        self.storage = {}
        for t in self.tensors:
            store_dt = mx.uint16 if t.dtype == "bfloat16" else getattr(mx, t.dtype)
            a = mx.zeros((num_slots, *t.shape), dtype=store_dt)
            mx.eval(a)
            self.storage[t.name] = a
        self._views: dict[str, memoryview] | None = None
        self._iov: dict[int, list[memoryview]] = {}  # slot -> its preadv buffers (zero-copy)
        self._arrays: dict | None = None  # the slot tensors in their MLX dtypes (evaluated)
        self._stage: np.ndarray | None = None  # scatter path's host staging
        self._bases: dict[str, int] | None = None  # slot tensors' addresses (device copies)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def arrays(self) -> dict:
        """The slot tensors by record name, in their MLX dtypes: made once and evaluated
        (a bfloat16 view shares its storage's buffer, so reads into the storage show through
        it and no call adds a view to its graph); the scatter path replaces the storage and
        makes them again."""
        import mlx.core as mx

        if self._arrays is None:
            out = {}
            for t in self.tensors:
                a = self.storage[t.name]
                out[t.name] = a.view(mx.bfloat16) if t.dtype == "bfloat16" else a
            mx.eval(list(out.values()))
            self._arrays = out
        return self._arrays

    def slot_iovecs(self, slot: int, lay: LayerLayout) -> list[memoryview]:
        """One slot's preadv buffers for a record of this pool's layout (zero-copy path):
        each tensor straight into the slot, the record's gaps into the slot's own scratch.
        Made once per slot."""
        bufs = self._iov.get(slot)
        if bufs is None:
            bufs = self._iov[slot] = _iovecs(lay, self.slot_views(slot))
        return bufs

    def slot_views(self, slot: int) -> list[memoryview]:
        """Writable byte views of one slot in every slot tensor (zero-copy path)."""
        if self._views is None:
            self._views = {}
            for t in self.tensors:
                mv = memoryview(self.storage[t.name])
                if not mv.c_contiguous or mv.nbytes != self.num_slots * t.nbytes:
                    raise RuntimeError(f"slot tensor {t.name} is not a plain contiguous buffer")
                self._views[t.name] = mv.cast("B")
        return [self._views[t.name][slot * t.nbytes : (slot + 1) * t.nbytes] for t in self.tensors]

    def staging(self, rows: int, copier=None) -> np.ndarray:
        """Host staging (scatter path): [rows, packed] bytes, a record's tensors back to back
        in each row, so a record is read with one preadv and a call's records go to MLX in one
        copy (one host-to-device transfer, not one per tensor). With a device copier: the
        largest batch's rows, allocated once and pinned."""
        if copier is not None and self._stage is None:
            rows = max(rows, STAGE_BYTES // self.slot_bytes)
        if self._stage is None or len(self._stage) < rows:
            if copier is not None and self._stage is not None:
                copier.unregister(self._stage)
            self._stage = np.empty((rows, self.slot_bytes), dtype=np.uint8)
            if copier is not None:
                copier.register(self._stage)
        return self._stage

    def copy_row(self, copier, row: int, slot: int) -> None:
        """Queue the copy of staged row `row` into `slot` on the device copier's stream (the
        slot is unpinned and no computation reading it is in flight); lands by copier.sync()."""
        bases = self._slot_bases()
        pos = self._stage.ctypes.data + row * self.slot_bytes
        for t in self.tensors:
            copier.copy_async(bases[t.name] + slot * t.nbytes, pos, t.nbytes)
            pos += t.nbytes

    def copy_record(self, copier, src: int, slot: int) -> None:
        """Queue the copies of one record at host address `src` (a pinned mapping of its file)
        into `slot`, one per tensor; they land by copier.sync()."""
        bases = self._slot_bases()
        for t in self.tensors:
            copier.copy_async(bases[t.name] + slot * t.nbytes, src + t.offset, t.nbytes)

    def _slot_bases(self) -> dict[str, int]:
        """The slot tensors' addresses (device copies), looked up once."""
        if self._bases is None:
            from .cuda_copy import buffer_address

            self._bases = {t.name: buffer_address(self.storage[t.name]) for t in self.tensors}
        return self._bases

    def stage_views(self, row: int) -> list[memoryview]:
        mv = memoryview(self._stage[row])
        out, pos = [], 0
        for t in self.tensors:
            out.append(mv[pos : pos + t.nbytes])
            pos += t.nbytes
        return out

    def scatter(self, slots: list[int]) -> None:
        """Write staged rows 0 .. len(slots) - 1 into `slots` (functional update)."""
        import mlx.core as mx

        idx = mx.array(np.asarray(slots, dtype=np.uint32))
        n = len(slots)
        big = mx.array(self._stage[:n])  # [n, packed] uint8: the call's one copy to MLX
        pos = 0
        for t in self.tensors:
            store_dt = self.storage[t.name].dtype
            part = big[:, pos : pos + t.nbytes].view(store_dt).reshape(n, *t.shape)
            self.storage[t.name][idx] = part
            pos += t.nbytes
        self._arrays = None  # the storage arrays are new ones


@dataclass
class Group:
    """Experts of one layer call that are resident together (the call's experts exceeded the
    pool): `rows` are positions in the call's flattened (token, expert) pairs."""

    experts: list[int]
    rows: np.ndarray


@dataclass
class Route:
    slot_idx: object = None  # mx.array shaped like the indices: slots to gather (one pass)
    slots: np.ndarray | None = None  # the same slots on the host (None: never read back)
    groups: list | None = None  # else: groups of experts, run one after another
    flat: np.ndarray | None = None  # the call's expert index per pair (host), with groups


def _iovecs(lay: LayerLayout, views: list[memoryview]) -> list[memoryview]:
    """One record's preadv buffers: each tensor straight into its view, gaps into scratch."""
    bufs, pos = [], 0
    for t, view in zip(lay.tensors, views, strict=True):
        if t.offset > pos:
            bufs.append(memoryview(bytearray(t.offset - pos)))
        bufs.append(view)
        pos = t.offset + t.nbytes
    return bufs


class ExpertPager:
    """Resident experts for every MoE layer of one model, within `budget_bytes`."""

    def __init__(self, store: ExpertStore, budget_bytes: int, options: PagerOptions | None = None):
        import mlx.core as mx

        self.store = store
        self.options = options = options or PagerOptions()
        self.budget_bytes = int(budget_bytes)
        if self.budget_bytes < 0:
            raise BudgetError(f"expert budget must be >= 0 bytes, got {budget_bytes}")
        layers = store.layers
        if not layers:
            raise ExpertRecordError("no MoE layers in the expert records", str(store.folder))
        for layer in layers:  # opens every file: size and magic are checked up front
            store.read_raw(layer, 0)
        by_sig: dict[str, list[int]] = {}
        for layer in layers:
            by_sig.setdefault(_signature(store.layout(layer)), []).append(layer)
        groups = list(by_sig.values())
        experts = [sum(store.layout(x).num_experts for x in g) for g in groups]
        slot_bytes = [store.layout(g[0]).expert_bytes for g in groups]
        self.expert_bytes = sum(n * b for n, b in zip(experts, slot_bytes, strict=True))
        self.full = self.budget_bytes >= self.expert_bytes
        self.pools: list[SlotPool] = []
        self.pool_of: dict[int, SlotPool] = {}
        limit = _bank_limit(options)
        for g, n, b in zip(groups, experts, slot_bytes, strict=True):
            slots = n if self.full else min(n, self.budget_bytes * n // self.expert_bytes)
            if slots < 1:
                raise BudgetError(
                    f"expert budget of {self.budget_bytes} bytes holds no expert of layer "
                    f"{g[0]} ({b} bytes each; all experts: {self.expert_bytes} bytes)"
                )
            per_slot = store.layout(g[0]).slot_elements
            for bank, bank_slots in _banks(store, g, slots, per_slot, limit):
                pool = SlotPool(store.layout(bank[0]), bank, bank_slots, options.policy)
                for layer in bank:
                    pool.num_experts[layer] = store.layout(layer).num_experts
                    self.pool_of[layer] = pool
                self.pools.append(pool)
        self.layer_stats = {layer: LayerStats() for layer in layers}
        self.base: dict[int, int] = {}  # all-resident path: slot of (layer, e) = base + e
        zc = options.zero_copy
        self.zero_copy = (
            not (getattr(mx, "cuda", None) and mx.cuda.is_available()) if zc is None else zc
        )
        self._fds: dict[int, int] = {}
        self._pool_exec = (
            ThreadPoolExecutor(options.read_threads) if options.read_threads > 1 else None
        )
        self._pending: list = []  # outputs since the last sync: evaluated before slots move
        self.load_bytes_read = 0
        self._verified = {
            layer: np.zeros(store.layout(layer).num_experts, dtype=bool) for layer in layers
        }
        # expert -> slot of every layer (-1: not resident), kept with the pools' LRUs: a
        # call's hits, misses and slot indices are list lookups
        self._table = {layer: [-1] * store.layout(layer).num_experts for layer in layers}
        self._first_layer = layers[0]  # its calls mark forward passes (token clock)
        self._tick: float | None = None
        self.tokens, self.token_s = 0, 0.0
        self.host_parts = dict.fromkeys(HOST_PARTS, 0.0)
        self._copier = None
        if not self.zero_copy and options.device_copy is not False:
            from .cuda_copy import DeviceCopier

            self._copier = DeviceCopier.open()
        # layer -> (address, map) of its pinned record file (None: reads go through staging)
        self._maps: dict | None = self._map_records() if self._copier is not None else None
        if self.zero_copy:
            for pool in self.pools:  # byte views made here, never first in a reader thread
                pool.slot_views(0)
        # layer -> its device-side tables (device_route.LayerState); None: the host path
        self.device: dict | None = None
        self.device_backend: str | None = None  # "cuda" or "reference" with self.device
        self.device_why = "off"  # why the device path is (not) in use
        self._meta_base: dict[int, np.ndarray] = {}
        if self.full:
            self._load_all()
        if not self.full and options.device_route != "off":
            self._device_setup(options.device_route)

    # -- public ----------------------------------------------------------------------------
    @property
    def no_readback(self) -> bool:
        """Every expert resident and no forced read-back: slots are base + expert index.
        A property: benchmarks swap `options` on a live pager."""
        return self.full and not self.options.always_resolve

    @property
    def read_path(self) -> str:
        """How misses reach the slots: zero_copy (preadv into slot memory), pinned (driver
        copies from the page-locked record files), device_copy (preadv into pinned staging,
        then driver copies), staging (MLX staging and a scatter), device_route (a kernel
        copies them from the device-mapped record files) or device_route_reference (its host
        twin)."""
        if self.device is not None:
            return "device_route" if self.device_backend == "cuda" else "device_route_reference"
        if self.zero_copy:
            return "zero_copy"
        if self._maps is not None and not self.options.drop_page_cache:
            return "pinned"
        return "device_copy" if self._copier is not None else "staging"

    @property
    def pool_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def arrays(self, layer: int) -> dict:
        return self.pool_of[layer].arrays()

    def quantization(self, layer: int) -> dict:
        return self.pool_of[layer].quantization

    def stats(self) -> dict:
        """Plain numbers for the UI: totals, the configuration and one dict per layer."""
        if self.device is not None:
            self._fold_device_stats()
        sb = {layer: self.pool_of[layer].slot_bytes for layer in self.layer_stats}
        out = total(self.layer_stats, sb)
        out.update(
            mode="resident" if self.no_readback else "paged",
            read_path=self.read_path,
            budget_bytes=self.budget_bytes,
            pool_bytes=self.pool_bytes,
            expert_bytes=self.expert_bytes,
            slots=sum(p.num_slots for p in self.pools),
            experts=sum(sum(p.num_experts.values()) for p in self.pools),
            layers={str(k): v.to_dict(sb[k]) for k, v in self.layer_stats.items()},
        )
        out.update(per_token(out, self.tokens, self.token_s))
        out["token_s"] = self.token_s
        n = self.tokens
        out["host_parts"] = {k: 1000 * v / n for k, v in self.host_parts.items()} if n else None
        out["device_route"] = self.device_why
        return out

    def reset_stats(self) -> None:
        for layer, st in self.layer_stats.items():
            resident = st.resident
            self.layer_stats[layer] = LayerStats(resident=resident)
        if self.device is not None:
            self._meta_base = self._device_meta()
        self._tick, self.tokens, self.token_s = None, 0, 0.0
        self.host_parts = dict.fromkeys(HOST_PARTS, 0.0)

    def route(self, layer: int, indices) -> Route:
        """Slots for one call of `layer`'s experts with router `indices` [..., k]."""
        import mlx.core as mx

        st = self.layer_stats[layer]
        self.tick(layer)
        if self.no_readback:
            st.hits += indices.size  # every pair hits; counted without reading indices back
            base = self.base[layer]
            return Route(slot_idx=indices + base if base else indices)
        t0 = time.perf_counter()
        # the last call's output must be computed before any of its slots is overwritten
        mx.eval(indices, *self._pending)
        ids = np.asarray(indices).ravel().tolist()  # plain ints: a decode call has a few
        t1 = time.perf_counter()
        st.readback_s += t1 - t0
        self.host_parts["readback"] += t1 - t0
        st.readbacks += 1
        read_before = st.read_s
        try:
            return self._route_host(layer, indices, ids, st)
        finally:
            st.host_s += time.perf_counter() - t1 - (st.read_s - read_before)

    def tick(self, layer: int) -> None:
        """The token clock: a call of the first MoE layer starts a forward pass."""
        if layer != self._first_layer:
            return
        now = time.perf_counter()  # the last pass took now - tick
        if self._tick is not None:
            self.tokens += 1
            self.token_s += now - self._tick
        self._tick = now
        for pool in self.pools:  # probation outlives two passes' keys
            if pool.pass_keys:
                pool.lru.probation_min = min(pool.num_slots, 2 * pool.pass_keys)
                pool.pass_keys = 0

    # -- device-resolved paging (device_route.py) -------------------------------------------
    def device_step(self, layer: int, ids):
        """Slots (in `layer`'s share, mx.uint32 like `ids`, flat) for one call's expert ids
        (mx.uint32, flat; SKIP pads), the misses loaded. CUDA: lazy, no sync. Reference: the
        ids are read back and the misses read on the host."""
        import mlx.core as mx

        from . import device_route as dr

        state = self.device[layer]
        if self.device_backend == "cuda":
            return dr.step(state, ids)
        t0 = time.perf_counter()
        mx.eval(ids, *self._pending)  # every earlier reader of the slots has run
        self._pending = []
        host = np.asarray(ids)
        t1 = time.perf_counter()
        self.host_parts["readback"] += t1 - t0
        self.layer_stats[layer].readbacks += 1
        tables = [np.asarray(a) for a in state.tables()]
        out, *new, misses = dr.route_reference(host, *tables)
        self.host_parts["policy"] += time.perf_counter() - t1
        if misses:
            pool = self.pool_of[layer]
            self._read_into(pool, layer, [(e, state.lo + v) for e, v in misses])
        state.set_tables(*(mx.array(a) for a in new))
        return mx.array(out)

    def _device_setup(self, want: str) -> None:
        """Give each layer its share of its pool and its device tables, where the chosen
        backend can run; otherwise keep the host path and say why (`device_why`)."""
        from . import device_route as dr

        backend = "reference" if want == "reference" else "cuda"
        why = None
        if backend == "reference" and not self.zero_copy:
            why = "the reference step writes slots from the host (unified memory only)"
        elif backend == "cuda":
            if dr.kernel() is None:
                why = "no CUDA backend"
            elif self.read_path != "pinned":
                why = "the record files are not page-locked (pin_records)"
        shares = {}
        for pool in self.pools:
            n = dr.shares(pool.num_slots, pool.layers)
            lay = self.store.layout(pool.layers[0])
            widest = max(lay.num_experts for lay in map(self.store.layout, pool.layers))
            if why is None and n < 1:
                why = f"fewer slots than layers in a pool ({pool.num_slots} for {len(pool.layers)})"
            elif why is None and n > dr.MAX_SHARE:
                why = f"a layer's share of {n} slots is over {dr.MAX_SHARE}"
            elif why is None and n * lay.slot_elements >= INDEX_LIMIT and backend == "cuda":
                why = "a layer's share spans more than MLX CUDA's 32-bit weight offsets"
            shares[id(pool)] = min(n, widest)
        if why is None and backend == "cuda" and self.options.verify:
            self.verify_records()  # the kernel copies without a CRC: every record checked now
        if why is not None:
            if want in ("cuda", "reference"):
                raise ValueError(f"device_route={want!r} is not possible here: {why}")
            self.device_why = f"off ({why})"
            return
        states = {}
        for pool in self.pools:
            n = shares[id(pool)]
            for i, layer in enumerate(pool.layers):
                lay = self.store.layout(layer)
                st = dr.LayerState(lay.num_experts, n, i * n)
                if backend == "cuda":
                    self._device_pointers(pool, layer, st)
                states[layer] = st
        self.device, self.device_backend = states, backend
        self.device_why = backend
        self._meta_base = self._device_meta()

    def _device_pointers(self, pool: SlotPool, layer: int, st) -> None:
        """The kernel's addresses for `layer`: its record file (device-mapped) and the start
        of its share in every slot tensor; and the records' geometry."""
        import mlx.core as mx

        lay = self.store.layout(layer)
        addr, _ = self._maps[layer]
        dev = self._copier.device_pointer(addr)
        if dev is None:
            raise ValueError("the driver did not map the record files for kernels")
        bases = pool._slot_bases()
        ptrs = [dev + lay.record_offset(0)] + [
            bases[t.name] + st.lo * t.nbytes for t in pool.tensors
        ]
        geom = [lay.stride]
        for t in pool.tensors:
            geom += [t.offset, t.nbytes]
        st.ptrs = mx.array(np.array(ptrs, dtype=np.uint64))
        st.geom = mx.array(np.array(geom, dtype=np.int64))
        st.tensors = len(pool.tensors)
        st.align16 = all(v % 16 == 0 for v in ptrs + geom)
        mx.eval(st.ptrs, st.geom)

    def _device_meta(self) -> dict[int, np.ndarray]:
        """Every layer's device counters now and its resident experts (a sync):
        [clock, hit pairs, missed pairs, records read, resident]."""
        import mlx.core as mx

        states = self.device.values()
        mx.eval([s.meta for s in states], [s.owner for s in states])
        return {
            layer: np.append(np.asarray(s.meta).astype(np.int64), (np.asarray(s.owner) >= 0).sum())
            for layer, s in self.device.items()
        }

    def _fold_device_stats(self) -> None:
        """The device counters since the last reset into the layers' statistics (each read
        fills an empty slot or evicts an expert)."""
        for layer, now in self._device_meta().items():
            st, base = self.layer_stats[layer], self._meta_base[layer]
            d = now - base
            st.hits, st.misses, st.resident = int(d[1]), int(d[2]), int(now[4])
            if self.device_backend == "cuda":
                st.reads = int(d[3])
                st.bytes_read = st.reads * self.store.layout(layer).record_size
            st.evictions = max(0, int(d[3]) - int(d[4]))

    def _route_host(self, layer: int, indices, ids: list[int], st: LayerStats) -> Route:
        """Plain Python on the call's few ids: for a decode call's 8-22 ids, list and dict
        operations cost a fraction of numpy's per-call overhead."""
        import mlx.core as mx

        t0 = time.perf_counter()
        self.release()
        pool = self.pool_of[layer]
        table = self._table[layer]
        ne = len(table)
        if ids and (min(ids) < 0 or max(ids) >= ne):
            raise ExpertRecordError(
                f"router index out of range (0..{ne - 1})", str(self.store.folder), layer
            )
        uniq = sorted(set(ids))
        if len(uniq) > pool.num_slots:
            st.split_calls += 1
            return self._split(layer, np.asarray(ids, dtype=np.int64), np.asarray(uniq))
        self.host_parts["ids"] += time.perf_counter() - t0
        self._acquire(layer, uniq, ids)
        t1 = time.perf_counter()
        slots = np.array([table[e] for e in ids], dtype=np.uint32).reshape(indices.shape)
        route = Route(slot_idx=mx.array(slots), slots=slots)
        self.host_parts["index"] += time.perf_counter() - t1
        return route

    def acquire(self, layer: int, experts: list[int], flat: np.ndarray) -> np.ndarray:
        """Pin `experts` of `layer` (reading misses) for the pairs `flat`; returns the
        layer's expert -> slot table (numpy, -1: not resident)."""
        self._acquire(layer, [int(e) for e in experts], flat.tolist())
        return np.asarray(self._table[layer], dtype=np.int64)

    def track(self, out) -> None:
        """Keep a call's output: the next call evaluates it before moving its slots (not on
        the device path, where the data orders the kernel's writes after earlier reads)."""
        if not self.no_readback and self.device_backend != "cuda":
            self._pending.append(out)
            if self.options.async_eval:
                import mlx.core as mx

                mx.async_eval(out)  # compute it while Python builds the graph to the next sync

    def release(self) -> None:
        """Unpin everything: every computation reading the slots has been evaluated."""
        self._pending = []
        for p in self.pools:
            p.lru.unpin_all()

    def close(self) -> None:
        self._maps = None
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        if self._pool_exec is not None:
            self._pool_exec.shutdown(wait=True)
            self._pool_exec = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __deepcopy__(self, memo):
        # Refused before anything is copied: a copy would close the live pager's files when
        # collected (its finalizer closes the descriptors it holds).
        raise TypeError(
            "a model with paged experts cannot be deep-copied: its experts are read from open "
            "files by the live pager; load the model again for a second copy"
        )

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- internals -------------------------------------------------------------------------
    def _split(self, layer: int, flat: np.ndarray, uniq: np.ndarray) -> Route:
        """A call routed to more experts than the pool holds (a long prompt on a small
        budget): groups of at most `num_slots` experts, resident ones first."""
        pool = self.pool_of[layer]
        resident = [e for e in uniq.tolist() if (layer, e) in pool.lru]
        order = resident + [e for e in uniq.tolist() if (layer, e) not in pool.lru]
        n = pool.num_slots
        groups = []
        for i in range(0, len(order), n):
            experts = order[i : i + n]
            rows = np.nonzero(np.isin(flat, experts))[0]
            groups.append(Group(experts, rows))
        return Route(groups=groups, flat=flat)

    def _acquire(self, layer: int, experts: list[int], ids: list[int]) -> None:
        """Pin `experts` (distinct; their order is the policy's order of use) for the pairs
        `ids`, reading the misses into the slots the policy gives them."""
        pool = self.pool_of[layer]
        st = self.layer_stats[layer]
        parts = self.host_parts
        tables = self._table
        table = tables[layer]
        t0 = time.perf_counter()
        hits = [(layer, e) for e in experts if table[e] >= 0]
        misses = [(layer, e) for e in experts if table[e] < 0]
        n_miss = sum(1 for e in ids if table[e] < 0) if misses else 0
        pool.pass_keys += len(experts)
        t1 = time.perf_counter()
        parts["ids"] += t1 - t0
        try:
            allocs = pool.lru.use(hits, misses)
        except NoFreeSlot as e:  # callers release pins first, so this is a bug
            raise RuntimeError(f"layer {layer}: {e}") from None
        for a in allocs:
            if a.evicted is not None:
                old_layer, old_e = a.evicted
                tables[old_layer][old_e] = -1
                old = self.layer_stats[old_layer]
                old.evictions += 1
                old.resident -= 1
            table[a.key[1]] = a.slot
            st.resident += 1
        parts["policy"] += time.perf_counter() - t1
        if allocs:
            try:
                self._read_into(pool, layer, [(a.key[1], a.slot) for a in allocs])
            except BaseException:
                self._free_failed(pool, allocs)
                raise
        st.misses += n_miss
        st.hits += len(ids) - n_miss

    def _free_failed(self, pool: SlotPool, allocs: list) -> None:
        """A read of this call failed (corrupt or short record): free every slot it was
        filling, so no later call hits a slot holding partial or corrupt bytes."""
        for a in allocs:
            pool.lru.unpin(a.slot)
            pool.lru.deallocate(a.key)
            self._table[a.key[0]][a.key[1]] = -1
            self.layer_stats[a.key[0]].resident -= 1

    def _map_records(self, force: bool = False) -> dict | None:
        """Pin every layer's record file through the copier (`PagerOptions.pin_records`);
        None where that is off, the files would take more than half the available memory,
        or the driver refuses one (then none stays pinned)."""
        want = self.options.pin_records
        if want is False:
            return None
        files = {}
        for layer in self.store.layers:
            lay = self.store.layout(layer)
            files[layer] = (self.store.folder / lay.file, lay.file_size)
        if want is None and not force:
            import psutil

            total = sum({str(path): size for path, size in files.values()}.values())
            if not records_pin(total, psutil.virtual_memory().available):
                return None
        maps, by_file = {}, {}
        for layer, (path, size) in files.items():
            m = by_file.get(str(path))
            if m is None:
                m = by_file[str(path)] = self._copier.map_file(path, size)
            if m is None:
                self._copier.unmap_all()
                return None
            maps[layer] = m
        return maps

    def _layer_fd(self, layer: int) -> int:
        fd = self._fds.get(layer)
        if fd is None:
            fd = os.open(self.store.folder / self.store.layout(layer).file, os.O_RDONLY)
            self._fds[layer] = fd
        return fd

    def _read_into(self, pool: SlotPool, layer: int, todo: list[tuple[int, int]]) -> None:
        """Read experts `todo` [(expert, slot)] of `layer` into their slots."""
        st = self.layer_stats[layer]
        t0 = time.perf_counter()
        lay = self.store.layout(layer)
        fd = self._layer_fd(layer)
        scatter = 0.0
        copier = self._copier
        if self.zero_copy:
            jobs = [(e, pool.slot_iovecs(s, lay), None) for e, s in todo]
            self._reads(layer, lay, fd, jobs)
        elif self._maps is not None and not self.options.drop_page_cache:
            addr, mm = self._maps[layer]
            try:
                for e, s in todo:
                    off = lay.record_offset(e)
                    if self._needs_check(layer, e):
                        with memoryview(mm) as mv:
                            self._check_crc(
                                layer, lay, e, zlib.crc32(mv[off : off + lay.record_size])
                            )
                    pool.copy_record(copier, addr + off, s)
            finally:  # every queued copy has landed (or failed) before slots are freed or used
                ts = time.perf_counter()
                copier.sync()
                scatter += time.perf_counter() - ts
        else:
            per = max(1, STAGE_BYTES // lay.record_size)
            rows = min(per, max(len(todo), 8))
            per = min(per, len(pool.staging(rows, copier)))
            for b in range(0, len(todo), per):
                batch = todo[b : b + per]
                # device copier: each record's copy is queued by the thread that read it as
                # soon as its read ends (overlapping the other reads); the batch then waits
                # for the copier's stream once (also after a failed read: staging is reused)
                jobs = [
                    (
                        e,
                        _iovecs(lay, pool.stage_views(i)),
                        None if copier is None else partial(pool.copy_row, copier, i, s),
                    )
                    for i, (e, s) in enumerate(batch)
                ]
                try:
                    self._reads(layer, lay, fd, jobs)
                finally:
                    if copier is not None:
                        ts = time.perf_counter()
                        copier.sync()
                        scatter += time.perf_counter() - ts
                if copier is None:
                    ts = time.perf_counter()
                    pool.scatter([s for _, s in batch])
                    if b + per < len(todo):  # bound the staged copies held by the lazy scatter
                        import mlx.core as mx

                        mx.eval(list(pool.storage.values()))
                    scatter += time.perf_counter() - ts
        st.reads += len(todo)
        st.bytes_read += len(todo) * lay.record_size
        dt = time.perf_counter() - t0
        st.read_s += dt
        self.host_parts["reads"] += dt - scatter
        self.host_parts["scatter"] += scatter

    def _reads(self, layer: int, lay: LayerLayout, fd: int, jobs: list) -> None:
        """Read records `jobs` [(expert, preadv buffers, then: called after the record's
        read and check, or None)]: on the calling thread up to
        INLINE_BYTES, else split over the reader threads with one share on this thread.
        Every read has ended when this returns, also when one failed (its slots are then
        freed: no thread may still be writing into them)."""
        ex = self._pool_exec
        if ex is None or len(jobs) < 2 or len(jobs) * lay.record_size <= INLINE_BYTES:
            self._read_chunk(layer, lay, fd, jobs)
            return
        n = min(self.options.read_threads, len(jobs))
        futures = [ex.submit(self._read_chunk, layer, lay, fd, jobs[i::n]) for i in range(1, n)]
        error = None
        try:
            self._read_chunk(layer, lay, fd, jobs[0::n])
        except BaseException as e:
            error = e
        for f in futures:
            try:
                f.result()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def _read_chunk(self, layer: int, lay: LayerLayout, fd: int, jobs: list) -> None:
        for expert, bufs, then in jobs:
            self._preadv(layer, lay, fd, expert, bufs)
            if then is not None:
                then()

    def _preadv(self, layer: int, lay: LayerLayout, fd: int, expert: int, bufs: list) -> None:
        off = lay.record_offset(expert)
        n = os.preadv(fd, bufs, off)
        if n != lay.record_size:
            raise ExpertRecordError(
                f"short read ({n} of {lay.record_size} bytes)",
                str(self.store.folder / lay.file),
                layer,
                expert,
            )
        if self.options.drop_page_cache:
            os.posix_fadvise(fd, off, lay.stride, os.POSIX_FADV_DONTNEED)
        if self._needs_check(layer, expert):
            crc = 0
            for b in bufs:
                crc = zlib.crc32(b, crc)
            self._check_crc(layer, lay, expert, crc)

    def _needs_check(self, layer: int, expert: int) -> bool:
        """Whether this read of the record gets its CRC checked (its first in the process, or
        every one with verify_every_read)."""
        o = self.options
        return o.verify and (o.verify_every_read or not self._verified[layer][expert])

    def _check_crc(self, layer: int, lay: LayerLayout, expert: int, crc: int) -> None:
        """Compare a record's CRC32 with the manifest's; marks the record checked."""
        want = lay.checksums[expert] if lay.checksums else None
        if want is None:
            raise ExpertRecordError(
                "manifest has no checksums for this layer",
                str(self.store.folder / lay.file),
                layer,
                expert,
            )
        if crc != want:
            raise ExpertRecordError(
                f"checksum mismatch (crc32 {crc:#010x}, manifest {want:#010x}): the "
                "record is corrupt; convert the model again",
                str(self.store.folder / lay.file),
                layer,
                expert,
            )
        self._verified[layer][expert] = True

    def verify_records(self, threads: int | None = None) -> int:
        """CRC-check every record not checked yet in this process (each is otherwise checked
        on its first read, on the decode path: zlib's CRC32 runs at ~1 GB/s a core, so a
        start-up of mostly first reads pays it per miss). Raises ExpertRecordError on the
        first bad record; returns how many were checked. Reads with its own buffers: safe
        beside decode (the flags only skip a later check)."""
        if not self.options.verify:
            return 0
        todo = [
            (layer, int(e)) for layer, done in self._verified.items() for e in np.flatnonzero(~done)
        ]

        def check(part: list) -> None:  # the decode path's read and check, own buffer
            buf = bytearray(max(self.store.layout(layer).record_size for layer, _ in part))
            mv = memoryview(buf)
            for layer, expert in part:
                lay = self.store.layout(layer)
                self._preadv(layer, lay, self._layer_fd(layer), expert, [mv[: lay.record_size]])

        if not todo:
            return 0
        for layer in {layer for layer, _ in todo}:
            self._layer_fd(layer)  # opened here, not raced by the threads below
        n = max(1, min(threads or self.options.read_threads, len(todo)))
        if n == 1:
            check(todo)
        else:
            with ThreadPoolExecutor(n) as ex:
                for f in [ex.submit(check, todo[i::n]) for i in range(n)]:
                    f.result()
        return len(todo)

    def _load_all(self) -> None:
        """All-resident start: every expert into slot base+e, layer after layer."""
        import mlx.core as mx

        for pool in self.pools:
            for layer in pool.layers:
                ne = pool.num_experts[layer]
                allocs = [pool.lru.allocate((layer, e)) for e in range(ne)]
                self.base[layer] = allocs[0].slot
                self._table[layer][:] = [a.slot for a in allocs]
                assert [a.slot for a in allocs] == list(range(allocs[0].slot, allocs[0].slot + ne))
                self._read_into(pool, layer, [(e, a.slot) for e, a in enumerate(allocs)])
                self.layer_stats[layer].resident = ne
                if not self.zero_copy:
                    mx.eval(list(pool.storage.values()))
        self.load_bytes_read = sum(st.bytes_read for st in self.layer_stats.values())
        self.reset_stats()  # the start-up load is not paging traffic
