"""The share of decode time spent in KV attention (the planner's ">20% rule", SPEC §4, §6).

Two sources, and the planner says which one it used:
- `estimate_share`: bytes read per decoded token, KV (at the context) against weights (every
  resident weight + the top-k experts + recurrent state). Decode is bandwidth-bound, so this is
  a floor-level guess; it ignores kernel efficiency, which is why a measurement replaces it.
- `measure_share`: on the loaded model, the time of one decode step with a KV cache of T tokens
  against the same step with an (almost) empty cache, at a few T; the extra time is attention.
  Results are cached per model, backend and contexts in `app.paths.cache_dir()/profiles`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import paths
from .sizes import ModelSizes

PROFILE_VERSION = 1
DEFAULT_CONTEXTS = (512, 2048, 8192)


@dataclass(frozen=True)
class ShareSource:
    """An attention share at one context, with where it came from."""

    share: float  # fraction of decode time in KV attention, 0..1
    context: int
    measured: bool  # False: an estimate from bytes read per token
    detail: str = ""

    def __post_init__(self):
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"attention share must be in [0, 1], got {self.share}")

    @property
    def label(self) -> str:
        return "measured" if self.measured else "estimated from bytes read per token"


def bytes_read_per_token(
    s: ModelSizes, context: int, kv_modes: dict | str = "fp16"
) -> tuple[int, int]:
    """(attention KV bytes, other bytes) one decoded token reads at `context`."""
    kv = s.kv_bytes(context, kv_modes)
    weights = s.resident_bytes - s.embedding_bytes + s.active_expert_bytes
    return kv, weights + 2 * s.recurrent_state_bytes  # recurrent state is read and written


def estimate_share(s: ModelSizes, context: int) -> ShareSource:
    kv, other = bytes_read_per_token(s, context)
    share = kv / (kv + other) if kv + other else 0.0
    return ShareSource(
        share,
        context,
        False,
        f"KV {kv / 2**20:.0f} MiB vs weights {other / 2**20:.0f} MiB read per token",
    )


@dataclass
class Profile:
    """Measured decode step times (seconds) by cache length, for one model and backend."""

    key: dict
    times: dict  # context (str, JSON keys) -> median seconds per decode step
    base: float  # seconds per step with a 1-token cache
    version: int = PROFILE_VERSION
    created: float = field(default_factory=time.time)

    def __post_init__(self):
        self.key = json.loads(json.dumps(self.key))  # as it reads back from the cache file
        if self.base <= 0 or any(t <= 0 for t in self.times.values()):
            raise ValueError("profile times must be positive")

    def fit(self) -> tuple[float, float]:
        """Least-squares t(T) = a + b*T over the measured points and the base (T = 1)."""
        pts = [(1, self.base)] + [(int(k), v) for k, v in self.times.items()]
        n = len(pts)
        mx_ = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        var = sum((p[0] - mx_) ** 2 for p in pts)
        b = sum((p[0] - mx_) * (p[1] - my) for p in pts) / var if var else 0.0
        b = max(b, 0.0)  # attention never makes a step faster; noise can suggest so
        return my - b * mx_, b

    def share(self, context: int) -> ShareSource:
        a, b = self.fit()
        a = max(a, 1e-9)
        att = b * context
        detail = ", ".join(
            f"T={k}: {v * 1e3:.2f} ms"
            for k, v in sorted(self.times.items(), key=lambda kv: int(kv[0]))
        )
        return ShareSource(
            min(att / (a + att), 1.0),
            context,
            True,
            f"decode step {self.base * 1e3:.2f} ms at T=1; {detail}",
        )


def profile_key(model_path: str | os.PathLike, backend_name: str, device: str) -> dict:
    """What a profile depends on: the model's files (path, size, mtime), the backend, MLX."""
    import mlx.core as mx

    p = Path(model_path).resolve()
    files = sorted(p.glob("*.safetensors")) + sorted(p.glob("rotaryquant.json"))
    stamp = [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in files]
    return {
        "model": str(p),
        "files": stamp,
        "backend": backend_name,
        "device": device,
        "mlx": mx.__version__,
    }


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    d = paths.cache_dir() / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{digest}.json"


def load_profile(key: dict) -> Profile | None:
    path = _cache_path(key)
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        prof = Profile(**{k: d[k] for k in ("key", "times", "base", "version", "created")})
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None  # a bad cache entry is re-measured, not an error
    if prof.version != PROFILE_VERSION or prof.key != json.loads(json.dumps(key)):
        return None
    return prof


def save_profile(prof: Profile) -> Path:
    path = _cache_path(prof.key)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(prof), indent=1))
    os.replace(tmp, path)
    return path


def _filled_cache(model, context: int, seed: int = 0):
    """A fresh prompt cache whose attention layers hold `context` random tokens (K/V shapes
    learnt from one real step); recurrent layers keep their fixed-size state."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    probe = make_prompt_cache(model)
    model(mx.array([[1]]), cache=probe)
    mx.eval([c.state for c in probe])
    cache = make_prompt_cache(model)
    rng = mx.random.split(mx.random.key(seed), 2 * len(cache))
    for i, (p, c) in enumerate(zip(probe, cache, strict=True)):
        k = getattr(p, "keys", None)
        if k is None or not hasattr(c, "update_and_fetch"):
            continue
        v = p.values
        kk, kv = rng[2 * i], rng[2 * i + 1]
        # k: [B, H, T, Dk], v: [B, H, T, Dv]
        keys = mx.random.normal((k.shape[0], k.shape[1], context, k.shape[3]), key=kk).astype(
            k.dtype
        )
        vals = mx.random.normal((v.shape[0], v.shape[1], context, v.shape[3]), key=kv).astype(
            v.dtype
        )
        c.update_and_fetch(keys, vals)
    mx.eval([c.state for c in cache if getattr(c, "keys", None) is not None])
    return cache


def _step(model, cache) -> float:
    import mlx.core as mx

    t0 = time.perf_counter()
    out = model(mx.array([[7]]), cache=cache)
    mx.eval(out, [c.state for c in cache if getattr(c, "keys", None) is not None])
    return time.perf_counter() - t0


def measure_share(
    model,
    key: dict,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    steps: int = 5,
    warmup: int = 2,
    use_cache: bool = True,
) -> Profile:
    """Time decode steps of a loaded mlx-lm model at each cache length; cached by `key`.

    Steps at the different lengths are interleaved (round-robin) and the fastest of `steps`
    is kept per length, so that other processes' noise does not land on one length only."""
    if use_cache:
        prof = load_profile(key)
        if prof is not None and set(prof.times) >= {str(c) for c in contexts}:
            return prof
    lengths = (1, *contexts)
    caches = {t: _filled_cache(model, t) for t in lengths}
    for _ in range(warmup):
        for t in lengths:
            _step(model, caches[t])
    best = dict.fromkeys(lengths, float("inf"))
    for _ in range(steps):
        for t in lengths:
            best[t] = min(best[t], _step(model, caches[t]))
    prof = Profile(key=key, times={str(t): best[t] for t in contexts}, base=best[1])
    if use_cache:
        save_profile(prof)
    return prof


def share_for(
    s: ModelSizes,
    context: int,
    model_path: str | os.PathLike | None = None,
    backend_name: str = "",
    device: str = "",
) -> ShareSource:
    """The measured share if a profile of this model on this backend is cached, else the
    estimate (labelled as such)."""
    if model_path is not None and Path(model_path).is_dir():
        try:
            prof = load_profile(profile_key(model_path, backend_name, device))
        except OSError:
            prof = None
        if prof is not None:
            return prof.share(context)
    return estimate_share(s, context)
