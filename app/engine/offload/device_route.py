"""Misses resolved on the device: a paged layer's call with no host round trip (CUDA).

On the host path every paged layer reads its router's indices back before it can gather
(48 syncs a Qwen3 token, each a host build / device run / host wait turn). Here each MoE layer
owns a fixed share of its pool's slots and keeps its expert -> slot table, the slots' owners
and their last-use stamps as device arrays. One CUDA kernel a call:

1. looks the call's experts up; a miss takes the least recently used slot of the layer's share
   that holds none of this call's experts (empty slots first, ties to the lowest slot);
2. copies each missed record from the page-locked, device-mapped record file (host memory)
   into its slot, tensor by tensor, over the bus;
3. returns the slot of each (token, expert) pair, which the gathered matmuls then use.

Every block runs the bookkeeping itself in shared memory (thread 0 lists the call's misses;
each miss's victim is a block-wide argmin of (stamp, slot)) and copies its share of the misses'
bytes; block 0 writes the new tables. The kernel writes the slot tensors
through their addresses, which MLX does not track: the order is kept by the data, since the
gather takes the kernel's slot indices, and a slot's next writer (a later token's call of
the same layer) depends on every earlier read of it through the residual stream.

`route_reference` is the same step in numpy: the specification the kernel is tested against
(tests/cuda_emu) and the CPU's backend of `DeviceRouter`, which applies the misses through the
pager's own reads (with their CRC checks) into slot memory the host can write.

Calls whose pairs outnumber the layer's share (prompts) keep a host step: their experts are
read back and loaded in groups of at most the share, through the same step, one group at a
time (layers.py).
"""

from __future__ import annotations

import numpy as np

SKIP = 0xFFFFFFFF  # an id the step passes over (padding of a group)
META = 4  # [clock, hit pairs, missed pairs, records read]
MAX_SHARE = 1024  # slots a layer's share may hold (shared memory: 16 bytes a slot and pair)
THREADS = 256
BLOCKS = 132

_BODY = r"""
  const int tid = int(threadIdx.x);
  const int blk = int(blockIdx.x);
  __shared__ int sh_owner[N];
  __shared__ unsigned sh_stamp[N];
  __shared__ int sh_me[P];
  __shared__ int sh_ms[P];
  __shared__ unsigned long long sh_red[NT];
  __shared__ int sh_nm;
  __shared__ unsigned sh_clock;
  for (int i = tid; i < N; i += NT) {
    sh_owner[i] = owner[i];
    sh_stamp[i] = stamp[i];
  }
  if (blk == 0) {
    for (int i = tid; i < E; i += NT) slot_of_out[i] = slot_of[i];
  }
  __syncthreads();
  if (tid == 0) {  // the call's hits stamped first (no miss may evict them), its misses listed
    const unsigned clock = meta[0] + 1u;
    int nm = 0;
    for (int j = 0; j < P; ++j) {
      const unsigned e = ids[j];
      if (e >= unsigned(E)) continue;
      const int s = slot_of[e];
      if (s >= 0 && sh_owner[s] == int(e)) {
        sh_stamp[s] = clock;
        continue;
      }
      bool listed = false;
      for (int m = 0; m < nm; ++m) listed = listed || sh_me[m] == int(e);
      if (!listed) sh_me[nm++] = int(e);
    }
    sh_nm = nm;
    sh_clock = clock;
  }
  __syncthreads();
  const int nm = sh_nm;
  const unsigned clock = sh_clock;
  for (int m = 0; m < nm; ++m) {  // each miss: the least recent slot (lowest on ties)
    unsigned long long best = ~0ull;
    for (int i = tid; i < N; i += NT) {
      const unsigned long long key =
          sh_stamp[i] != clock ? ((unsigned long long)sh_stamp[i] << 32) | unsigned(i) : ~0ull;
      best = key < best ? key : best;
    }
    sh_red[tid] = best;
    __syncthreads();
    for (int w = NT / 2; w > 0; w >>= 1) {
      if (tid < w && sh_red[tid + w] < sh_red[tid]) sh_red[tid] = sh_red[tid + w];
      __syncthreads();
    }
    if (tid == 0) {
      const unsigned long long k = sh_red[0];
      const int v = k == ~0ull ? -1 : int(k & 0xFFFFFFFFull);
      sh_ms[m] = v;
      if (v >= 0) {
        const int old = sh_owner[v];
        if (blk == 0) {
          if (old >= 0) slot_of_out[old] = -1;
          slot_of_out[sh_me[m]] = v;
        }
        sh_owner[v] = sh_me[m];
        sh_stamp[v] = clock;
      }
    }
    __syncthreads();
  }
  if (blk == 0) {
    for (int i = tid; i < N; i += NT) {
      owner_out[i] = sh_owner[i];
      stamp_out[i] = sh_stamp[i];
    }
    for (int j = tid; j < P; j += NT) {  // each pair's slot; 0 for SKIP and unplaced ids
      const unsigned e = ids[j];
      unsigned out = 0;
      if (e < unsigned(E)) {
        const int s = slot_of[e];
        if (s >= 0 && sh_owner[s] == int(e)) out = unsigned(s);
        for (int m = 0; m < nm; ++m) {
          if (sh_me[m] == int(e) && sh_ms[m] >= 0) out = unsigned(sh_ms[m]);
        }
      }
      slot_idx[j] = out;
    }
    if (tid == 0) {
      unsigned hits = 0, missed = 0, reads = 0;
      for (int m = 0; m < nm; ++m) reads += sh_ms[m] >= 0 ? 1u : 0u;
      for (int j = 0; j < P; ++j) {
        const unsigned e = ids[j];
        if (e >= unsigned(E)) continue;
        bool fresh = false, placed = false;
        for (int m = 0; m < nm; ++m) {
          if (sh_me[m] == int(e)) {
            fresh = true;
            placed = sh_ms[m] >= 0;
          }
        }
        if (!fresh) ++hits;
        else if (placed) ++missed;
      }
      meta_out[0] = clock;
      meta_out[1] = meta[1] + hits;
      meta_out[2] = meta[2] + missed;
      meta_out[3] = meta[3] + reads;
    }
  }
  const unsigned long long g = (unsigned long long)blk * NT + tid;
  const unsigned long long gs = (unsigned long long)gridDim.x * NT;
  const unsigned long long stride = (unsigned long long)geom[0];
  for (int m = 0; m < nm; ++m) {
    if (sh_ms[m] < 0) continue;
    const unsigned char* rec = (const unsigned char*)ptrs[0] + stride * sh_me[m];
    for (int t = 0; t < T; ++t) {
      const unsigned long long nb = (unsigned long long)geom[2 + 2 * t];
      const unsigned char* src = rec + geom[1 + 2 * t];
      unsigned char* dst = (unsigned char*)ptrs[1 + t] + nb * sh_ms[m];
      if (ALIGN16) {
        const uint4* s4 = (const uint4*)src;
        uint4* d4 = (uint4*)dst;
        for (unsigned long long i = g; i < nb / 16; i += gs) d4[i] = s4[i];
        for (unsigned long long i = nb / 16 * 16 + g; i < nb; i += gs) dst[i] = src[i];
      } else {
        for (unsigned long long i = g; i < nb; i += gs) dst[i] = src[i];
      }
    }
  }
"""

INPUTS = ["ids", "slot_of", "owner", "stamp", "meta", "ptrs", "geom"]
OUTPUTS = ["slot_idx", "slot_of_out", "owner_out", "stamp_out", "meta_out"]


def body() -> str:
    return _BODY


def template(pairs: int, experts: int, share: int, tensors: int, align16: bool) -> list:
    return [
        ("P", pairs),
        ("E", experts),
        ("N", share),
        ("T", tensors),
        ("NT", THREADS),
        ("ALIGN16", align16),
    ]


def route_reference(ids, slot_of, owner, stamp, meta):
    """One call's step on the host: (slot per id, new slot_of, owner, stamp, meta, misses
    [(expert, slot)] in read order). Same semantics as the kernel: SKIP ids (and ids out of
    range) get slot 0 and are not counted; a pair is a miss when its expert is read in this
    call (a second pair of that expert in the call too, as the host path counts prompts)."""
    slot_of = np.array(slot_of, dtype=np.int32)
    owner = np.array(owner, dtype=np.int32)
    stamp = np.array(stamp, dtype=np.uint32)
    meta = np.array(meta, dtype=np.uint32)
    clock = np.uint32(meta[0] + np.uint32(1))
    out = np.zeros(len(ids), dtype=np.uint32)
    misses: list[tuple[int, int]] = []
    fresh: dict[int, int] = {}
    hits = missed = 0
    for e in (int(x) for x in ids):  # the call's hits first: no miss may evict them
        if e < len(slot_of) and slot_of[e] >= 0 and owner[slot_of[e]] == e:
            stamp[slot_of[e]] = clock
    for j, e in enumerate(int(x) for x in ids):
        if e == SKIP or e >= len(slot_of):
            continue
        if e in fresh:
            s, new = fresh[e], True
        else:
            s, new = int(slot_of[e]), False
            if s < 0 or owner[s] != e:
                avail = np.flatnonzero(stamp != clock)
                if not len(avail):
                    continue
                v = int(avail[np.argmin(stamp[avail])])  # argmin: the first of equal stamps
                old = int(owner[v])
                if old >= 0:
                    slot_of[old] = -1
                slot_of[e] = v
                owner[v] = e
                fresh[e] = s = v
                misses.append((e, v))
                new = True
        stamp[s] = clock
        out[j] = s
        if new:
            missed += 1
        else:
            hits += 1
    meta[0] = clock
    meta[1] += hits
    meta[2] += missed
    meta[3] += len(misses)
    return out, slot_of, owner, stamp, meta, misses


class LayerState:
    """One layer's device-side tables and where its share of the slots starts in its pool."""

    def __init__(self, experts: int, share: int, lo: int):
        import mlx.core as mx

        self.experts, self.share, self.lo = experts, share, lo
        self.slot_of = mx.full((experts,), -1, dtype=mx.int32)
        self.owner = mx.full((share,), -1, dtype=mx.int32)
        self.stamp = mx.zeros((share,), dtype=mx.uint32)
        self.meta = mx.zeros((META,), dtype=mx.uint32)
        self.ptrs = None  # mx.uint64 [1 + T]: the record file's device address, slot bases
        self.geom = None  # mx.int64 [1 + 2T]: record stride, (offset, bytes) per tensor
        self.tensors = 0  # T: tensors a record holds
        self.align16 = False
        mx.eval(self.slot_of, self.owner, self.stamp, self.meta)

    def tables(self):
        return self.slot_of, self.owner, self.stamp, self.meta

    def set_tables(self, slot_of, owner, stamp, meta) -> None:
        self.slot_of, self.owner, self.stamp, self.meta = slot_of, owner, stamp, meta


def shares(pool_slots: int, layers: list[int]) -> int:
    """Slots each layer of a pool owns on the device path (an equal share, the rest unused)."""
    return pool_slots // max(1, len(layers))


_KERNEL = None


def kernel():
    """The CUDA step (built once), or None where MLX has no CUDA backend."""
    global _KERNEL
    if _KERNEL is not None:  # the decode path: one call a paged layer
        return _KERNEL
    import mlx.core as mx

    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        return None
    from ..kvcache import jit

    _KERNEL = jit.BakedKernel(
        "rq_pager_route", INPUTS, OUTPUTS, _BODY, "", ensure_row_contiguous=True
    )
    return _KERNEL


def step(state: LayerState, ids):
    """The CUDA step for `ids` (mx.uint32 [P], lazy): the slots (in the layer's share) per
    id; the layer's tables move on to the step's outputs."""
    import mlx.core as mx

    p = int(ids.size)
    outs = kernel()(
        inputs=[ids, *state.tables(), state.ptrs, state.geom],
        template=template(p, state.experts, state.share, state.tensors, state.align16),
        grid=(BLOCKS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(p,), (state.experts,), (state.share,), (state.share,), (META,)],
        output_dtypes=[mx.uint32, mx.int32, mx.int32, mx.uint32, mx.uint32],
    )
    slot_idx, *tables = outs
    state.set_tables(*tables)
    return slot_idx
