"""The engine's generation API: a generator of small dataclass events.

The loop (`token_stream`) is mlx-lm's `generate_step` — chunked prefill, then each step's graph
built while the device runs the previous one — with the prefill chunk sized by the planner and
the sampling ops compiled; it uses mlx-lm's streaming detokenizer. The app adds chat templates,
cancellation, KV modes and honest statistics.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from . import kvcache, prompts
from . import loader as _loader
from .errors import EngineError

DEFAULT_MODEL_REF = "embedded:default"  # the embedded SmolLM2, prepared on first use


@dataclass
class GenerationSettings:
    max_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    kv_mode: str = "auto"  # auto (the plan's) | a row of the KV modes table (kvcache/modes.py)
    kv_window: int | None = None  # IsoQuant's recent FP16 window (None = the cache's default)
    prefill_step_size: int | None = None  # tokens per prefill step (None = the plan's chunk)

    def __post_init__(self):
        for name, f in self.__dataclass_fields__.items():
            v = getattr(self, name)
            if (
                f.type in ("int", "int | None")
                and v is not None
                and (not isinstance(v, int) or isinstance(v, bool))
            ):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if f.type == "float" and not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError("seed must be in 0..2**64-1")
        if self.prefill_step_size is not None and self.prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")
        if self.max_tokens == 0 or self.max_tokens < -1:
            raise ValueError("max_tokens must be positive (or -1 for no limit)")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or self.min_p < 0 or self.repetition_penalty <= 0:
            raise ValueError("top_k, min_p must be >= 0 and repetition_penalty > 0")

    @classmethod
    def from_dict(cls, d: dict) -> GenerationSettings:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)


# Events: the engine's whole output. Plain data, picklable, no MLX arrays.
@dataclass
class PromptProcessed:
    prompt_tokens: int
    prompt_tps: float
    kind: str = "prompt"


@dataclass
class TokenEvent:
    text: str
    token: int
    kind: str = "token"


@dataclass
class Finished:
    reason: str  # "stop" (end of sequence) | "length" | "cancelled"
    prompt_tokens: int
    generated_tokens: int
    prompt_tps: float
    decode_tps: float
    peak_memory: int  # bytes, MLX's peak since the request started
    kv_bytes: int
    text: str = ""
    kind: str = "finished"


@dataclass
class ModelInfo:
    path: str
    name: str
    architecture: str
    num_layers: int
    weight_bytes: int
    kv_modes: tuple[str, ...]
    backend: str
    load_seconds: float
    extra: dict = field(default_factory=dict)


def _weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _load_any(path, expert_budget: int | None) -> _loader.LoadedModel:
    """Plain mlx-lm folders and converted folders (experts in records), resident or paged."""
    if expert_budget is None:
        return _loader.load(path)
    _, manifest = _loader.check_folder(path)
    if manifest is None or not manifest.experts:
        raise EngineError("an expert budget needs a converted MoE model (rotaryquant convert)")
    from .offload import load_paged

    return load_paged(path, int(expert_budget))


def prepare_model(model, *, float_dense: bool = True, compile_blocks: bool = True) -> dict:
    """What the engine does to a loaded model before generating: float32 dense weights on the
    CPU backend, resident expert layers that widen their codes for prefill calls
    (expert_widen.py), compiled feed-forward blocks and attention decode steps (compiled.py).
    Returns facts for ModelInfo.extra."""
    from . import expert_widen
    from .backend import detect
    from .compiled import ATTENTION_NAMES

    float_bytes = 0
    if detect().name == "cpu" and float_dense:
        from .cpu_weights import dequantize_dense

        float_bytes = dequantize_dense(model)
    widen_to = expert_widen.prefill_bits()  # a bad override fails here, not mid-prefill
    widening = expert_widen.install(model)
    blocks = []
    if compile_blocks:
        from .compiled import compile_blocks as compile_all

        blocks = compile_all(model)
        if widen_to is not None:
            expert_widen.sync_compiled_blocks(model)
    attention = [p for p in blocks if p.rpartition(".")[2] in ATTENTION_NAMES]
    return {
        "cpu_float_dense_bytes": float_bytes,
        "compiled_blocks": len(blocks) - len(attention),
        "compiled_attention": len(attention),
        "expert_prefill_layers": widening,  # layers that widen when the width is set
        "expert_prefill_bits": widen_to,
    }


# Sampling after the model: log-probabilities as mlx-lm's loop takes them (the same ops, so
# the same tokens), compiled into one graph node per step.
_logprobs = mx.compile(lambda logits: logits - mx.logsumexp(logits, keepdims=True))
_greedy = mx.compile(lambda logits: mx.argmax(_logprobs(logits), axis=-1))


def sample(logits: mx.array, sampler: Callable | None = None) -> mx.array:
    """logits: [B, V] -> tokens [B]; sampler: mlx-lm's (takes log-probabilities), None: greedy."""
    return _greedy(logits) if sampler is None else sampler(_logprobs(logits))


def decode_step(
    model,
    tokens: mx.array,
    cache: list,
    sampler: Callable | None = None,
    processors: list | None = None,
    history: mx.array | None = None,
) -> mx.array:
    """One step's graph (lazy): tokens [L] -> the next token [1]."""
    logits = model(tokens[None], cache=cache)[:, -1, :]
    for proc in processors or ():
        logits = proc(history, logits)
    return sample(logits, sampler)


def token_stream(
    model,
    ids: list[int] | mx.array,
    cache: list,
    *,
    max_tokens: int = 256,
    sampler: Callable | None = None,
    processors: list | None = None,
    prefill_chunk: int = 512,
    between_chunks: Callable[[int, int], None] | None = None,
) -> Iterator[int]:
    """Token ids from `ids` on: the prompt but its last token in chunks of `prefill_chunk`
    (`between_chunks(done, total)` after each), then one step a token, step n+1's graph built
    while the device runs step n (as mlx-lm's generate_step, whose tokens these are).
    max_tokens -1: no limit."""
    from mlx_lm.generate import generation_stream

    prompt = ids if isinstance(ids, mx.array) else mx.array(ids)
    if prompt.size == 0:
        raise EngineError("empty prompt")
    history = prompt if processors else None
    total, done = prompt.size, 0
    with mx.stream(generation_stream):
        while prompt.size > 1:
            n = min(prefill_chunk, prompt.size - 1)
            model(prompt[:n][None], cache=cache)
            mx.eval([c.state for c in cache])
            prompt = prompt[n:]
            done += n
            if between_chunks is not None:
                between_chunks(done, total)
            mx.clear_cache()
        y = decode_step(model, prompt, cache, sampler, processors, history)
        mx.async_eval(y)
        n = 0
        while True:
            if n != max_tokens:
                if processors:
                    history = mx.concatenate([history, y])
                nxt = decode_step(model, y, cache, sampler, processors, history)
                mx.async_eval(nxt)
            if n == max_tokens:
                break
            yield y.item()
            if n % 256 == 0:
                mx.clear_cache()
            y = nxt
            n += 1


class Engine:
    """Owns one loaded model. Not thread-safe: one generation at a time (MLX arrays never
    cross threads)."""

    def __init__(self):
        self.loaded: _loader.LoadedModel | None = None
        self.info: ModelInfo | None = None
        self.last_cache: list | None = None
        self.default_kv_mode = "fp16"
        self.last_kv_mode = "fp16"
        self.context_limit: int | None = None  # tokens (an applied plan's); None: no limit
        self.prefill_chunk = 512

    # -- loading ---------------------------------------------------------------------------
    def load(self, path: str | os.PathLike, options: dict | None = None) -> ModelInfo:
        """Load a model folder. `options`: {"expert_budget": bytes} pages the routed experts
        of a converted folder within that budget (the plan's choice); without it a converted
        folder loads fully resident."""
        from .backend import detect

        options = dict(options or {})
        t0 = time.perf_counter()
        if str(path) == DEFAULT_MODEL_REF:
            from .embedded import ensure_default_model

            path = ensure_default_model()
        plan = None
        if options.get("plan"):
            plan = self._plan(path, options)
            if plan.paging and options.get("expert_budget") is None:
                options["expert_budget"] = plan.expert_budget
        lm = _load_any(path, options.get("expert_budget"))
        facts = prepare_model(
            lm.model,
            float_dense=options.get("cpu_float_weights", True),
            compile_blocks=options.get("compile", True),
        )
        self.unload()
        self.loaded = lm
        if plan is not None and not plan.attention_share.measured and options.get("profile", True):
            # The KV rule needs the attention share measured on this machine: profile once
            # (cached per model, backend and device), then plan again with it.
            plan = self._profile_and_replan(lm, path, options, plan)
        self.default_kv_mode = options.get("kv_mode") or (plan.kv_mode if plan else "fp16")
        self.context_limit = int(options["context"]) if options.get("context") else None
        self.prefill_chunk, chunk_reason = self._prefill_chunk(lm.path, plan, options)
        backend = detect()
        self.info = ModelInfo(
            path=str(lm.path),
            name=(lm.manifest.name if lm.manifest and lm.manifest.name else Path(lm.path).name),
            architecture=lm.architecture,
            num_layers=len(getattr(lm.model, "layers", [])),
            weight_bytes=_weight_bytes(lm.model),
            kv_modes=kvcache.names(backend.name, offered=True),
            backend=backend.name,
            load_seconds=time.perf_counter() - t0,
            extra={
                "plan": plan.to_dict() if plan else None,
                **facts,
                "prefill_chunk": self.prefill_chunk,
                "prefill_chunk_reason": chunk_reason,
                "expert_budget": options.get("expert_budget"),
                "default_kv_mode": self.default_kv_mode,
            },
        )
        return self.info

    def _profile_and_replan(self, lm, path, options: dict, plan):
        from . import profile
        from .backend import detect

        b = detect()
        try:
            profile.measure_share(lm.model, profile.profile_key(lm.path, b.name, b.device))
        except Exception as e:  # a failed profile leaves the estimate in place, said so
            from dataclasses import replace

            return replace(
                plan, reasons=(*plan.reasons, f"attention profile failed ({e}); share estimated")
            )
        opts = dict(options)
        opts.setdefault("expert_budget", plan.expert_budget if plan.paging else None)
        return self._plan(path, opts)

    @staticmethod
    def _prefill_chunk(path, plan, options: dict) -> tuple[int, str]:
        """Tokens per prefill step: the plan's, else the planner's for this machine now."""
        from .planner import prefill_chunk_for

        if plan is not None:
            return plan.prefill_chunk, plan.prefill_reason
        return prefill_chunk_for(
            path, context=options.get("context"), expert_budget=options.get("expert_budget")
        )

    @staticmethod
    def _plan(path, options: dict):
        """The auto-planner's choice for this machine; explicit options override it."""
        from .planner import plan_model

        return plan_model(
            path,
            context=options.get("context"),
            kv_mode=options.get("kv_mode"),
            expert_budget=options.get("expert_budget"),
        )

    def unload(self) -> None:
        self.loaded = None
        self.info = None
        self.last_cache = None
        mx.clear_cache()

    def _require(self) -> _loader.LoadedModel:
        if self.loaded is None:
            raise EngineError("no model loaded")
        return self.loaded

    # -- prompts ---------------------------------------------------------------------------
    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[int]:
        """Chat messages through the model's template, within a time and size limit."""
        tok = self._require().tokenizer
        if getattr(tok, "chat_template", None):
            return prompts.render_chat(tok, messages, add_generation_prompt, should_stop)
        prompts.check_messages(messages)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return list(tok.encode(text))

    def encode_text(self, text: str) -> list[int]:
        return list(self._require().tokenizer.encode(prompts.check_text(text)))

    # -- caches ----------------------------------------------------------------------------
    def make_cache(self, settings: GenerationSettings, tokens: int = 8192) -> list:
        """A prompt cache for one request of up to `tokens` tokens in the settings' KV mode: any
        row of the modes table that runs on this backend (research rows included)."""
        from .backend import detect

        model = self._require().model
        mode = self.default_kv_mode if settings.kv_mode == "auto" else settings.kv_mode
        reason = kvcache.unavailable_reason(mode, detect().name)
        if reason:
            raise EngineError(reason)
        self.last_kv_mode = mode
        opts = {} if settings.kv_window is None else {"window": settings.kv_window}
        return kvcache.make_cache(model, mode, max_tokens=tokens, **opts)

    @staticmethod
    def cache_nbytes(cache: list | None) -> int:
        return kvcache.cache_nbytes(cache) if cache else 0

    def kv_stats(self) -> dict:
        """The last request's KV cache: mode, tokens held, bytes held for them (not spare
        capacity), the buffers' capacity, what the same tokens take in a float cache at the
        dtype the cache keeps float K/V in (for "KV saved" in the memory panel), and the layers
        a compressed mode keeps float, with why."""
        cache = self.last_cache or []
        tokens = max((int(getattr(c, "offset", 0) or 0) for c in cache), default=0)
        used = kvcache.cache_nbytes(cache)
        base = sum(kvcache.float_baseline_nbytes(c) for c in cache)
        return {
            "mode": self.last_kv_mode,
            "tokens": tokens,
            "bytes": used,
            "used_bytes": used,
            "capacity_bytes": kvcache.cache_capacity_nbytes(cache),
            "float_bytes": base,
            "fallbacks": kvcache.fallbacks(cache),
        }

    # -- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompt: list[int] | str | list[dict],
        settings: GenerationSettings | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[PromptProcessed | TokenEvent | Finished]:
        """Stream events for one request. `prompt` is token ids, raw text, or chat messages."""
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        lm = self._require()
        settings = settings or GenerationSettings()
        if isinstance(prompt, str):
            ids = self.encode_text(prompt)
        elif not isinstance(prompt, (list, tuple)):
            raise prompts.PromptError("a prompt is text, chat messages or token ids")
        elif prompt and isinstance(prompt[0], dict):
            try:
                ids = self.encode_chat(prompt, should_stop=should_stop)  # type: ignore[arg-type]
            except prompts.Cancelled:
                yield Finished("cancelled", 0, 0, 0.0, 0.0, int(mx.get_peak_memory()), 0)
                return
        else:
            ids = prompts.check_ids(prompt, prompts.vocab_size(lm.model, lm.config))
        if not ids:
            raise EngineError("empty prompt")
        plan = dict((self.info.extra or {}).get("plan") or {}) if self.info else {}
        if self.context_limit:  # the context of the plan the engine was loaded with
            plan["context_limit"] = min(self.context_limit, plan.get("context_limit") or 1 << 62)
        ctx, why = prompts.context_limit(lm.config, plan)
        max_tokens = prompts.fit_context(len(ids), settings.max_tokens, ctx, why)
        if settings.seed is not None:
            mx.random.seed(settings.seed)
        sampler = (
            None
            if settings.temperature == 0
            else make_sampler(
                temp=settings.temperature,
                top_p=settings.top_p if settings.top_p < 1 else 0.0,
                min_p=settings.min_p,
                top_k=settings.top_k,
            )
        )
        procs = (
            make_logits_processors(repetition_penalty=settings.repetition_penalty)
            if settings.repetition_penalty != 1.0
            else None
        )
        limit = max_tokens if max_tokens > 0 else 32768
        cache = self.make_cache(settings, len(ids) + limit)
        self.last_cache = cache
        tokenizer = lm.tokenizer
        detok = tokenizer.detokenizer
        detok.reset()
        eos = set(tokenizer.eos_token_ids)
        mx.reset_peak_memory()

        def between_chunks(done: int, total: int) -> None:  # after each prefill chunk
            if should_stop():
                raise prompts.Cancelled("cancelled during prefill")

        steps = token_stream(
            lm.model,
            ids,
            cache,
            max_tokens=max_tokens,
            sampler=sampler,
            processors=procs,
            prefill_chunk=settings.prefill_step_size or self.prefill_chunk,
            between_chunks=between_chunks,
        )
        t0 = time.perf_counter()
        prompt_tps = decode_tps = 0.0
        n = 0
        reason = "length"
        t_decode = t0
        text = []
        try:
            for token in steps:
                if n == 0:
                    t_decode = time.perf_counter()
                    prompt_tps = len(ids) / max(t_decode - t0, 1e-9)
                    yield PromptProcessed(len(ids), prompt_tps)
                if token in eos:
                    reason = "stop"
                    break
                n += 1
                detok.add_token(token)
                seg = detok.last_segment
                text.append(seg)
                yield TokenEvent(seg, token)
                if should_stop():
                    reason = "cancelled"
                    break
        except prompts.Cancelled:
            reason = "cancelled"
        finally:
            steps.close()
        detok.finalize()
        tail = detok.last_segment
        if tail:
            text.append(tail)
            yield TokenEvent(tail, -1)
        # The first token comes out of prefill; decode speed counts the tokens after it.
        elapsed = time.perf_counter() - t_decode
        decode_tps = (n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0
        yield Finished(
            reason=reason,
            prompt_tokens=len(ids),
            generated_tokens=n,
            prompt_tps=prompt_tps,
            decode_tps=decode_tps,
            peak_memory=int(mx.get_peak_memory()),
            kv_bytes=self.cache_nbytes(cache),
            text="".join(text),
        )

    def generate_text(self, prompt, settings: GenerationSettings | None = None) -> str:
        out = ""
        for ev in self.generate(prompt, settings):
            if isinstance(ev, Finished):
                out = ev.text
        return out
