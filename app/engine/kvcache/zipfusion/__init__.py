"""ZipFusion: lossless BF16 KV compression decoded inside attention (SPEC §5), NVIDIA only.

- `codec`: the block format, a bit-exact reference in MLX ops
- `memory`: arenas + shared pool + page table, admission numbers (plain Python)
- `store`: the device pool, page compression at commit, paged decode attention
- `cache`: the mlx-lm cache protocol and the attention dispatch
- `scheduler`: a batched decode loop that admits requests by what fits (the server's, on NVIDIA)
"""

from __future__ import annotations

import math

from .cache import ZipFusionCache, install_attention, zipfusion_sdpa
from .codec import PAGE_TOKENS
from .memory import OutOfPages, PoolGeometry, ZipMemory
from .scheduler import Request, ZipScheduler
from .store import ZipConfig, ZipStore

__all__ = [
    "PAGE_TOKENS",
    "OutOfPages",
    "PoolGeometry",
    "Request",
    "ZipConfig",
    "ZipFusionCache",
    "ZipMemory",
    "ZipScheduler",
    "ZipStore",
    "available",
    "batch_refusal",
    "install_attention",
    "make_cache",
    "make_scheduler",
    "make_zipfusion_cache",
    "make_zipfusion_store",
    "model_kv_shape",
    "raw_budget",
    "zipfusion_sdpa",
]


def available() -> tuple[bool, str]:
    """Whether ZipFusion can run here, and why not (the UI shows the reason)."""
    from ...backend import detect

    b = detect()
    if b.cuda_kernels:
        return True, f"ZipFusion runs on {b.device}"
    return False, b.unavailable_reason("zipfusion") or "ZipFusion needs MLX's CUDA backend"


def model_kv_shape(model) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of an mlx-lm model whose layers all use full attention."""
    args = getattr(model, "args", None)
    layers = getattr(model, "layers", None)
    if args is None or layers is None:
        raise ValueError(f"{type(model).__name__}: no `args`/`layers`; not an mlx-lm decoder model")
    n_heads = getattr(args, "num_attention_heads", None)
    n_kv = getattr(args, "num_key_value_heads", None) or n_heads
    head_dim = getattr(args, "head_dim", None) or (args.hidden_size // n_heads)
    kinds = set(getattr(args, "layer_types", None) or ["full_attention"])
    if (
        kinds != {"full_attention"}
        or getattr(args, "sliding_window", None)
        and "sliding_attention" in kinds
    ):
        raise ValueError(
            f"ZipFusion supports full-attention layers only, this model has {sorted(kinds)}"
        )
    return len(_kv_positions(model)), int(n_kv), int(head_dim)


def _kv_positions(model) -> list[int]:
    """Indices of mlx-lm's prompt cache that hold growing full-attention KV (hybrid models such
    as nemotron_h interleave SSM layers, whose caches stay as they are)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    if not hasattr(model, "make_cache"):
        return list(range(len(model.layers)))
    return [i for i, c in enumerate(make_prompt_cache(model)) if type(c) is KVCache]


def make_zipfusion_store(model, budget_bytes: int, **kw) -> ZipStore:
    """A store sized for `model` with a KV pool of `budget_bytes`; `kw` go to ZipConfig
    (max_seqs, max_tokens_per_seq, compress, ...) except `use_kernel`."""
    use_kernel = kw.pop("use_kernel", None)
    n_layers, n_kv, head_dim = model_kv_shape(model)
    return ZipStore(ZipConfig(n_layers, n_kv, head_dim, budget_bytes, **kw), use_kernel=use_kernel)


def raw_budget(model, max_tokens: int) -> int:
    """Pool bytes that hold one sequence of `max_tokens` at raw size: every page raw, plus per
    layer the partial raw chunk, the compression reserve and the unused end of the current
    compressed chunk. What the plan reserves for the KV of one request at its context."""
    n_layers, n_kv, head_dim = model_kv_shape(model)
    probe = ZipConfig(n_layers, n_kv, head_dim, 1 << 62, max_seqs=1, max_tokens_per_seq=max_tokens)
    chunks = math.ceil(math.ceil(max_tokens / PAGE_TOKENS) / probe.pages_per_chunk) + 3
    return n_layers * chunks * probe.pages_per_chunk * probe.raw_page_bytes


def batch_refusal(model) -> str | None:
    """Why `model`'s requests cannot share one ZipFusion batch (None: they can). The scheduler
    pages every layer; a hybrid model's SSM layers keep per-sequence state it does not batch."""
    try:
        model_kv_shape(model)
    except ValueError as e:
        return str(e)
    if len(_kv_positions(model)) != len(model.layers):
        return "ZipFusion batches models whose layers all keep full-attention KV (not hybrid ones)"
    return None


def make_scheduler(
    model, max_seqs: int, max_tokens: int, budget_bytes: int | None = None, **kw
) -> ZipScheduler:
    """A batched decode loop over one pool for up to `max_seqs` sequences of up to `max_tokens`
    each. The pool defaults to `raw_budget(model, max_tokens)`: serving several requests takes
    no more KV memory than one request at the full context, and what compression frees admits
    more of them. `kw` go to ZipScheduler (prefill_step, eos, growth_horizon) and `use_kernel`
    to the store. Refuses models with other layers than full attention (hybrid, sliding)."""
    use_kernel = kw.pop("use_kernel", None)
    reason = batch_refusal(model)
    if reason:
        raise ValueError(reason)
    if budget_bytes is None:
        budget_bytes = raw_budget(model, max_tokens)
    store = make_zipfusion_store(
        model, budget_bytes, max_seqs=max_seqs, max_tokens_per_seq=max_tokens,
        use_kernel=use_kernel,
    )  # fmt: skip
    return ZipScheduler(model, store, **kw)


def make_zipfusion_cache(
    model, budget_bytes: int | None = None, max_tokens: int = 32768, **kw
) -> list[ZipFusionCache]:
    """A per-layer cache list for one sequence, usable as mlx-lm's `prompt_cache`; installs the
    attention dispatch into the model's modules. The pool defaults to `max_tokens` at raw size."""
    if budget_bytes is None:
        budget_bytes = raw_budget(model, max_tokens)
    store = make_zipfusion_store(
        model, budget_bytes, max_seqs=1, max_tokens_per_seq=max_tokens, **kw
    )
    store.single_sequence()
    install_attention(model)
    if not hasattr(model, "make_cache"):
        return [ZipFusionCache(store, i) for i in range(store.cfg.n_layers)]
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    for j, i in enumerate(_kv_positions(model)):
        caches[i] = ZipFusionCache(store, j)
    return caches


def make_cache(
    model, max_tokens: int | None = None, max_kv_size: int | None = None, **_
) -> list[ZipFusionCache]:
    """The modes table's factory (kvcache/modes.py): ZipFusion has no per-request knobs, so other
    modes' options (IsoQuant's window) are ignored; max_kv_size is refused (no rotating pages)."""
    if max_kv_size is not None:
        raise ValueError(
            f"max_kv_size={max_kv_size}: ZipFusion keeps every token; use the fp16 KV mode for a "
            "bounded rotating cache"
        )
    return make_zipfusion_cache(model, max_tokens=max_tokens or 32768)
