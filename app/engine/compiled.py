"""Compiled feed-forward blocks: less host work per decode step.

A decode step is built op by op in Python (each op a call into MLX), and on a GPU that host
work is most of a step. A MoE block is ~15 ops a layer (router, softmax, top-k, gathers,
weighting) on shapes that never change during decode, so each block's `__call__` is wrapped in
`mx.compile`: traced once per input shape, replayed in C++, elementwise ops fused.

The module tree, parameter paths and call signature stay as mlx-lm built them: the block's
class is swapped for a subclass whose `__call__` runs the compiled function, with the block's
arrays passed as captured inputs (so a later `update` of its weights is seen). Only blocks made
wholly of MLX / mlx-lm modules are compiled: the pager's expert layers read routes on the host.

Attention modules of the architectures whose `__call__` is known (ATTENTION_CALLS) get the same
treatment for their part before the cache: a decode step's q/k/v projections, q/k norms, head
reshapes and RoPE are one compiled call, with RoPE's offset passed as an array (so the trace is
not tied to a position). The cache update, the attention op (whatever the model module's
`scaled_dot_product_attention` is at call time: IsoQuant's dispatch included) and the output
projection run as mlx-lm runs them. Multi-token calls (prefill, verify) run mlx-lm's own code.
"""

from __future__ import annotations

import functools
import os
import sys

import mlx.core as mx
import mlx.nn as nn

COMPILE_ENV = "ROTARYQUANT_COMPILE"  # "0": leave every block as mlx-lm built it
BLOCK_NAMES = ("mlp", "block_sparse_moe", "feed_forward")  # a decoder layer's feed-forward
ATTENTION_NAMES = ("self_attn",)
# RoPE classes that hand their offset to mx.fast.rope untouched (an array offset works);
# DynamicNTKScalingRoPE does host arithmetic on it, so its modules stay as mlx-lm built them
ROPE_CLASSES = ("RoPE", "Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")
# mlx-lm attention classes whose __call__ is: q/k/v projections, heads reshaped, (q/k norms,)
# transposed, RoPE at cache.offset, cache.update_and_fetch, the module's
# scaled_dot_product_attention, transpose, reshape, o_proj. Module -> whether it has q/k norms.
ATTENTION_CALLS = {"mlx_lm.models.qwen3_moe": True, "mlx_lm.models.qwen3": True,
                   "mlx_lm.models.llama": False}  # fmt: skip
_PURE_MODULES = ("mlx.nn.", "mlx_lm.models.")
# one matmul for a decode step's q/k/v projections (fuse_projections); "0" keeps three
FUSE_QKV = os.environ.get("ROTARYQUANT_FUSE_QKV", "1") != "0"
# decoder layers of known classes as two compiled calls a decode step; "0": blocks and
# attention modules compiled on their own
LAYERS = os.environ.get("ROTARYQUANT_COMPILE_LAYERS", "1") != "0"
# a one-token step's q and k heads normalised in one call and rotated in one (_qk_norm_rows);
# "0" keeps mlx-lm's two norms and two RoPEs
MERGE_QK = os.environ.get("ROTARYQUANT_MERGE_QK", "1") != "0"
_SUBCLASSES: dict[type, type] = {}


def enabled() -> bool:
    return os.environ.get(COMPILE_ENV, "1") != "0"


def compilable(block: nn.Module) -> bool:
    """A block whose every module is MLX's or mlx-lm's own (pure array code), not sharded."""
    for _, m in block.named_modules():
        if not type(m).__module__.startswith(_PURE_MODULES):
            return False
        if getattr(m, "sharding_group", None) is not None:
            return False
    return True


PREFILL_SYNC_TOKENS = 64  # a block that widens expert codes syncs on calls this large


def _compiled_call(self, x):
    out = self._rq_compiled_fn(x)
    if self.__dict__.get("_rq_prefill_sync") and x.size >= PREFILL_SYNC_TOKENS * x.shape[-1]:
        # a prefill call whose experts widened their codes (expert_widen.py): the host would
        # otherwise queue every layer's transient widened copy before the device frees the
        # first (on CUDA a 2048-token chunk of Qwen3-30B-A3B held +15 GB); one sync a layer
        # bounds it to about one layer's copy, at ~0.1 ms against a ~30 ms layer
        mx.eval(out)
    return out


def call_subclass(cls: type, call, marker: str, cache: dict) -> type:
    """`cls` with `call` as its __call__ (made once per class, kept in `cache`): swapped into
    an instance's __class__. `marker` names the original class; __module__ is kept, so the
    subclass still reads as mlx-lm's module (compilable() and repr see the original)."""
    if cls not in cache:
        cache[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__call__": call,
                marker: cls,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
    return cache[cls]


def _subclass(cls: type, call=_compiled_call) -> type:
    return call_subclass(cls, call, "_rq_original", _SUBCLASSES)


_OFFSETS: dict[int, mx.array] = {}  # RoPE offsets as arrays: one per position, shared by layers


def _offset_array(offset) -> mx.array:
    if isinstance(offset, mx.array):
        return offset
    a = _OFFSETS.get(offset)
    if a is None:
        if len(_OFFSETS) >= 64:
            _OFFSETS.clear()
        a = _OFFSETS[offset] = mx.array(offset, mx.int32)
    return a


PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _fusable(projections: list) -> tuple | None:
    """The array names and matmul settings the q/k/v projections share, if one matrix can do
    all three: the same class (float Linear, or QuantizedLinear of one width, group and mode),
    the same arrays, none of them sharded."""
    kinds = {type(p) for p in projections}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, nn.QuantizedLinear):
        return None
    names = {tuple(sorted(p.keys())) for p in projections}
    settings = {
        (getattr(p, "group_size", None), getattr(p, "bits", None), getattr(p, "mode", None))
        for p in projections
    }
    if len(names) != 1 or len(settings) != 1:
        return None
    return names.pop(), settings.pop()


def fuse_projections(module: nn.Module) -> bool:
    """One matrix for the q/k/v projections of a decode step: their arrays concatenated along
    the output rows, and each projection's arrays made views of it (a row range: no copy), so
    memory is as before and the module tree, parameter paths and prefill calls are mlx-lm's.
    A single-token, single-row step then runs one matmul for three (two fewer graph nodes a
    layer) and takes q, k and v as column ranges of its output: each output is the same dot
    product as before. Batched steps run three matmuls over row ranges of the fused arrays.
    Returns whether it fused."""
    projections = [getattr(module, n, None) for n in PROJECTIONS]
    if any(p is None for p in projections) or (found := _fusable(projections)) is None:
        return False
    names, settings = found
    fused = {k: mx.concatenate([p[k] for p in projections], axis=0) for k in names}
    mx.eval(fused)
    bounds, start = [], 0
    for p in projections:
        rows = p["weight"].shape[0]
        bounds.append((start, start + rows))
        for k in names:
            p[k] = fused[k][start : start + rows]
        start += rows
    mx.eval([p[k] for p in projections for k in names])
    held = [(module, n, p) for n, p in zip(PROJECTIONS, projections, strict=True)]
    held += [(p, k, p[k]) for p in projections for k in names]
    norms = _qk_norm_rows(module, bounds)
    if norms is not None:
        fused[QK_NORM] = norms[0]
        held += norms[1]
    object.__setattr__(
        module,
        "_rq_qkv",
        {
            "arrays": fused,
            "settings": settings,
            "bounds": bounds,
            # (container, key, object) that must still hold: the projections in the module,
            # the views in the projections and the q/k norms' weights (plain dict lookups,
            # ~0.1 µs each a step)
            "held": held,
        },
    )
    return True


QK_NORM = "qk_norm"  # in the fused arrays: the q and k norms' weights, one row per head


def _qk_norm_rows(module: nn.Module, bounds: list) -> tuple | None:
    """The q and k norms' weights as one [Hq + Hkv, 1, D] array (each head's row its norm's
    weight) and the (container, key, object) entries they were made from, where both norms are
    RMSNorms of one eps over whole heads: a one-token step then normalises q and k heads in one
    call (fused_heads). None otherwise."""
    if not MERGE_QK:
        return None
    if not ATTENTION_CALLS.get(type(module).__dict__.get("_rq_original", type(module)).__module__):
        return None
    qn, kn = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if type(qn) is not nn.RMSNorm or type(kn) is not nn.RMSNorm or qn.eps != kn.eps:
        return None
    qw, kw = qn.get("weight"), kn.get("weight")
    hq, hkv = module.n_heads, module.n_kv_heads
    d = bounds[0][1] // hq
    if qw is None or kw is None or qw.shape != (d,) or kw.shape != (d,) or qw.dtype != kw.dtype:
        return None
    rows = mx.concatenate(
        [mx.broadcast_to(qw, (hq, 1, d)), mx.broadcast_to(kw, (hkv, 1, d))], axis=0
    )
    mx.eval(rows)
    return rows, [(qn, "weight", qw), (kn, "weight", kw)]


def _unprojected(module: nn.Module) -> dict:
    """The attention module's parts a fused step captures: all but its q/k/v projections, and
    but its q/k norms where their weights are in the fused arrays (it reads those arrays as
    arguments, so the arrays it was made from stay the objects fuse_projections() saw: their
    identity is how a later update is noticed, and a compiled function's captured inputs are
    rewrapped on every call)."""
    skip = PROJECTIONS
    fused = module.__dict__.get("_rq_qkv")
    if fused is not None and QK_NORM in fused["arrays"]:
        skip += ("q_norm", "k_norm")
    return {k: v for k, v in module.children().items() if k not in skip}


def _qkv_arrays(module) -> dict | None:
    """The fused q/k/v arrays, while the projections still hold the views made of them (a
    later update of their weights drops the fusion)."""
    fused = module.__dict__.get("_rq_qkv")
    if fused is None:
        return None
    for container, key, obj in fused["held"]:
        if container.get(key) is not obj:
            object.__delattr__(module, "_rq_qkv")
            return None
    return fused["arrays"]


def _project(x, arrays: dict, settings: tuple):
    """x through a projection given by its arrays, as nn.Linear / nn.QuantizedLinear do."""
    group_size, bits, mode = settings
    if "scales" in arrays:
        y = mx.quantized_matmul(
            x,
            arrays["weight"],
            scales=arrays["scales"],
            biases=arrays.get("biases"),
            transpose=True,
            group_size=group_size,
            bits=bits,
            mode=mode,
        )
        return y + arrays["bias"] if "bias" in arrays else y
    if "bias" in arrays:
        return mx.addmm(arrays["bias"], x, arrays["weight"].T)
    return x @ arrays["weight"].T


def _fused_projections(self, x, arrays: dict):
    """q, k, v from the fused arrays: one matmul for a one-row step, else three over row
    ranges of the arrays (views: column ranges of several output rows would be strided)."""
    fused = self._rq_qkv
    if x.shape[0] * x.shape[1] == 1:
        y = _project(x, arrays, fused["settings"])
        q_end, k_end = fused["bounds"][0][1], fused["bounds"][1][1]
        return y[..., :q_end], y[..., q_end:k_end], y[..., k_end:]
    return tuple(
        _project(x, {k: a[lo:hi] for k, a in arrays.items() if k != QK_NORM}, fused["settings"])
        for lo, hi in fused["bounds"]
    )


def _fused_heads(self, x, offset, arrays: dict):
    """A one-row, one-token step's (queries, keys, values) as [1, heads, 1, D] from one matmul
    over the fused arrays: its output reshaped to (query, key, value) heads at once (the general
    path's splits, reshapes and transposes are nine views a layer), the q and k heads rotated
    in one call and, where the norms' weights are in the arrays (_qk_norm_rows), normalised in
    one. None (the general path) where the bounds are not whole heads of one head dim, the
    module has q/k norms that cannot be merged, or MERGE_QK is off.

    The same values as mlx-lm's ops: mx.fast.rms_norm scales x by its norm in float32, rounds
    to the dtype, then multiplies by the weight in the dtype, so rms_norm(x, None) times the
    weight is the same product; RoPE acts on each head's row alone."""
    fused = self._rq_qkv
    (_, q_end), (_, k_end), (_, v_end) = fused["bounds"]
    hq, hkv = self.n_heads, self.n_kv_heads
    d = q_end // hq
    if d * hq != q_end or k_end - q_end != d * hkv or v_end - k_end != d * hkv:
        return None
    rows = arrays.get(QK_NORM)
    norms = ATTENTION_CALLS[type(self)._rq_original.__module__]
    if (norms and rows is None) or not MERGE_QK:
        return None  # two norms, or two RoPEs: the general path
    y = _project(x, arrays, fused["settings"]).reshape(x.shape[0], hq + 2 * hkv, 1, d)
    if rows is None:
        qk = y[:, : hq + hkv]
    elif rows.dtype == y.dtype:
        qk = mx.fast.rms_norm(y[:, : hq + hkv], None, self.q_norm.eps) * rows
    else:
        return None
    qk = self.rope(qk, offset=offset)
    return qk[:, :hq], qk[:, hq:], y[:, hq + hkv :]


def _attention_pre(self, x, offset, arrays=None):
    """The module's decode step up to its cache: (queries, keys, values), as mlx-lm's code;
    with `arrays` (fuse_projections) the projections read the fused arrays. A one-token step
    shapes its heads as [B, heads, 1, D] at once: for one token, mlx-lm's [B, 1, heads, D]
    transposed is the same elements in the same order, so every op gives the same values."""
    b, n, _ = x.shape
    if arrays is not None and b * n == 1:  # (several rows: their heads would be strided)
        heads = _fused_heads(self, x, offset, arrays)
        if heads is not None:
            return heads
    if arrays is not None:
        queries, keys, values = _fused_projections(self, x, arrays)
    else:
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if n == 1:  # heads as [B, heads, 1, D] at once
        queries = queries.reshape(b, self.n_heads, 1, -1)
        keys = keys.reshape(b, self.n_kv_heads, 1, -1)
        values = values.reshape(b, self.n_kv_heads, 1, -1)
    else:
        queries = queries.reshape(b, n, self.n_heads, -1)
        keys = keys.reshape(b, n, self.n_kv_heads, -1)
    if ATTENTION_CALLS[type(self)._rq_original.__module__]:
        queries, keys = self.q_norm(queries), self.k_norm(keys)
    if n != 1:
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        values = values.reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return self.rope(queries, offset=offset), self.rope(keys, offset=offset), values


def _merge_heads(out, b: int, n: int):
    """The attention op's [B, heads, n, D] as [B, n, heads * D]: for one token a reshape (the
    same elements in the same order as mlx-lm's transpose and reshape), one view fewer."""
    if n == 1:
        return out.reshape(b, 1, -1)
    return out.transpose(0, 2, 1, 3).reshape(b, n, -1)


def _cached_attention(owner, attn, x, mask, cache, plain: str, fused: str):
    """A decode step's attention up to its output projection: `owner`'s compiled part before
    the cache (its `fused` function while the q/k/v fusion holds, else its `plain` one), the
    cache update and the model module's attention op (IsoQuant's dispatch included)."""
    offset = _offset_array(cache.offset)
    arrays = _qkv_arrays(attn)
    fn = owner.__dict__.get(fused) if arrays is not None else None
    if fn is None:
        queries, keys, values = owner.__dict__[plain](x, offset)
    else:
        queries, keys, values = fn(x, offset, arrays)
    step = getattr(cache, "attend_step", None)  # IsoQuant: the update and its kernel in one
    if step is not None:
        out = step(queries, keys, values, attn.scale, mask)
        if out is not None:
            return out
    keys, values = cache.update_and_fetch(keys, values)
    sdpa = sys.modules[type(attn).__module__].scaled_dot_product_attention
    return sdpa(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)


def _attention_call(self, x, mask=None, cache=None):
    b, n, _ = x.shape
    if cache is None or n != 1:
        return type(self)._rq_original.__call__(self, x, mask=mask, cache=cache)
    output = _cached_attention(self, self, x, mask, cache, "_rq_compiled_fn", "_rq_fused_fn")
    return self.o_proj(_merge_heads(output, b, n))


# mlx-lm decoder layer classes whose __call__ is: r = self_attn(input_layernorm(x), mask,
# cache); h = x + r; out = h + mlp(post_attention_layernorm(h)). Module -> class name.
LAYER_CALLS = {"mlx_lm.models.qwen3_moe": "Qwen3MoeDecoderLayer",
               "mlx_lm.models.qwen3": "TransformerBlock",
               "mlx_lm.models.llama": "TransformerBlock"}  # fmt: skip
_LAYER_SUBCLASSES: dict[type, type] = {}


def _layer_pre(self, x, offset, arrays=None):
    """A decode step's layer up to its cache: the input norm and the attention's part."""
    return _attention_pre(self.self_attn, self.input_layernorm(x), offset, arrays)


def _layer_post(self, out, x):
    """A decode step's layer after its attention op: the output projection, both residuals,
    the post-attention norm and the feed-forward block (its own uncompiled call, inlined)."""
    b, n, _ = x.shape
    h = x + self.self_attn.o_proj(_merge_heads(out, b, n))
    mlp = self.mlp
    call = type(mlp).__dict__.get("_rq_original", type(mlp)).__call__
    return h + call(mlp, self.post_attention_layernorm(h))


def _layer_call(self, x, mask=None, cache=None):
    attn = self.self_attn
    if cache is None or x.shape[1] != 1 or not is_compiled(attn):
        return type(self)._rq_layer_original.__call__(self, x, mask=mask, cache=cache)
    out = _cached_attention(self, attn, x, mask, cache, "_rq_pre_fn", "_rq_pre_fused_fn")
    return self._rq_post_fn(out, x)


def layer_compilable(layer: nn.Module) -> bool:
    """A decoder layer of a known class (LAYER_CALLS) whose attention module is compiled and
    whose feed-forward block is pure (not the pager's expert layers)."""
    cls = type(layer)
    cls = cls.__dict__.get("_rq_layer_original", cls)
    if LAYER_CALLS.get(cls.__module__) != cls.__name__:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return attn is not None and is_compiled(attn) and mlp is not None and compilable(mlp)


def compile_layer(layer: nn.Module) -> None:
    """One decode step of the layer as two compiled calls around its cache and attention op:
    (input norm, q/k/v, norms, RoPE) and (output projection, residuals, post norm,
    feed-forward). The same ops in the same order as mlx-lm's layer and modules."""
    d = layer.__dict__
    attn = layer.self_attn
    if "_rq_pre_fn" not in d:
        pre = functools.partial(_layer_pre, layer)
        parts = {"input_layernorm": layer.input_layernorm, "self_attn": attn}
        object.__setattr__(layer, "_rq_pre_fn", mx.compile(pre, inputs=parts))
        if "_rq_qkv" in attn.__dict__:  # the fused projections are read as arguments
            rest = {**_unprojected(attn), "input_layernorm": layer.input_layernorm}
            object.__setattr__(layer, "_rq_pre_fused_fn", mx.compile(pre, inputs=rest))
        post = functools.partial(_layer_post, layer)
        parts = {
            "o_proj": attn.o_proj,
            "post_attention_layernorm": layer.post_attention_layernorm,
            "mlp": layer.mlp,
        }
        object.__setattr__(layer, "_rq_post_fn", mx.compile(post, inputs=parts))
    original = type(layer).__dict__.get("_rq_layer_original", type(layer))
    layer.__class__ = call_subclass(original, _layer_call, "_rq_layer_original", _LAYER_SUBCLASSES)


def attention_compilable(module: nn.Module) -> bool:
    """An attention module of a known class (ATTENTION_CALLS) with a RoPE that takes an array
    offset, made wholly of MLX / mlx-lm modules, not sharded."""
    cls = type(module)
    cls = cls.__dict__.get("_rq_original", cls)
    if cls.__name__ != "Attention" or cls.__module__ not in ATTENTION_CALLS:
        return False
    return type(getattr(module, "rope", None)).__name__ in ROPE_CLASSES and compilable(module)


def compile_block(block: nn.Module) -> None:
    original = type(block)
    if "_rq_compiled_fn" not in block.__dict__:  # kept by uncompile(): its traces stay valid
        fn = mx.compile(functools.partial(original.__call__, block), inputs=block)
        object.__setattr__(block, "_rq_compiled_fn", fn)
    block.__class__ = _subclass(original)


def compile_attention(module: nn.Module) -> None:
    original = type(module)
    module.__class__ = _subclass(original, _attention_call)
    if "_rq_compiled_fn" not in module.__dict__:
        fn = mx.compile(functools.partial(_attention_pre, module), inputs=module)
        object.__setattr__(module, "_rq_compiled_fn", fn)
    if FUSE_QKV and "_rq_fused_fn" not in module.__dict__ and fuse_projections(module):
        fn = mx.compile(functools.partial(_attention_pre, module), inputs=_unprojected(module))
        object.__setattr__(module, "_rq_fused_fn", fn)


def use_traces(model: nn.Module, key) -> int:
    """Switch every compiled feed-forward block to its set of traces named `key` (a fresh
    compiled function the first time), keeping the current set under its own key; returns how
    many. A setting read while a block is traced (the experts' prefill width, expert_widen.py)
    can then be compared side by side in one process, each side traced once."""
    n = 0
    for _, m in model.named_modules():
        if type(m).__dict__.get("__call__") is not _compiled_call:
            continue
        d = m.__dict__
        sets = d.get("_rq_trace_sets")
        if sets is None:
            sets = {}
            object.__setattr__(m, "_rq_trace_sets", sets)
        sets[d.get("_rq_trace_key")] = d["_rq_compiled_fn"]
        fn = sets.get(key)
        if fn is None:
            fn = mx.compile(functools.partial(type(m)._rq_original.__call__, m), inputs=m)
        object.__setattr__(m, "_rq_compiled_fn", fn)
        object.__setattr__(m, "_rq_trace_key", key)
        n += 1
    return n


def is_compiled(block: nn.Module) -> bool:
    return "_rq_original" in type(block).__dict__


def restore_classes(model: nn.Module, marker: str) -> int:
    """Put every module swapped by call_subclass(..., marker, ...) back to its original class;
    returns how many."""
    n = 0
    for _, m in model.named_modules():
        original = type(m).__dict__.get(marker)
        if original is not None:
            m.__class__ = original
            n += 1
    return n


def uncompile(model: nn.Module) -> int:
    """Put every compiled block, attention module and decoder layer back to its mlx-lm class
    (side-by-side benchmarks); returns how many blocks and attention modules. compile_blocks()
    turns them back on without tracing again."""
    restore_classes(model, "_rq_layer_original")
    return restore_classes(model, "_rq_original")


def compiled_layers(model: nn.Module) -> int:
    return sum("_rq_layer_original" in type(m).__dict__ for _, m in model.named_modules())


def compile_blocks(model: nn.Module) -> list[str]:
    """Compile each decoder layer's feed-forward block where it is pure, and its attention
    module's part before the cache where the architecture is known; returns their paths.
    Idempotent; a no-op with ROTARYQUANT_COMPILE=0."""
    if not enabled():
        return []
    done = []
    for path, m in model.named_modules():
        name = path.rpartition(".")[2]
        if ".layers." not in f".{path}" or name not in BLOCK_NAMES + ATTENTION_NAMES:
            continue
        if is_compiled(m):
            done.append(path)
        elif name in BLOCK_NAMES and compilable(m):
            compile_block(m)
            done.append(path)
        elif name in ATTENTION_NAMES and attention_compilable(m):
            compile_attention(m)
            done.append(path)
    if LAYERS:
        for path, m in model.named_modules():
            if path.rpartition(".")[0].endswith("layers") and layer_compilable(m):
                compile_layer(m)
    return sorted(done)
