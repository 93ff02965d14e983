"""Per-role parameter and byte counts from a `config.json` alone (no weights).

The planner needs sizes before a model is downloaded, so this module rebuilds each supported
architecture's tensor list from its config, following mlx-lm's model modules (the layout the
app loads): every tensor is counted once, with its role (SPEC §2) and its input dimension
(quantization groups run along it). Totals match a built mlx-lm model parameter for parameter
(tested on the tiny random models).

Excluded from the totals, and reported apart in `ModelSizes.excluded`: multi-token-prediction
layers (mlx-lm drops `mtp.*` weights when loading) and vision towers (text-only path).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import kvcache
from .errors import EngineError
from .quant.widths import ROLES, RoleWidth, RoleWidths

# Where the real configs live beside the repo; tests use their copy in tests/data/configs.
SHARED_CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "configs"

# Bytes per fp16 KV value; mlx-lm's caches hold K and V in the activation dtype.
KV_VALUE_BYTES = 2


class SizeError(EngineError, ValueError):
    """A config that the calculator cannot size: names the file and the reason."""

    def __init__(self, reason: str, path: str | None = None):
        self.reason = reason
        self.path = path
        super().__init__(f"{path}: {reason}" if path else reason)


@dataclass(frozen=True)
class KVKind:
    """The KV cache of one kind of attention layer.

    kind: "full" (grows with context), "sliding" (capped at `window`) or "mla" (DeepSeek's
    latent cache: one shared "head" of kv_lora_rank + rope dims, not compressible here).
    """

    kind: str
    layers: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None = None
    value_bytes: int = KV_VALUE_BYTES  # the activation dtype's size: 2 (bf16/fp16) or 4 (fp32)

    def __post_init__(self):
        if self.kind not in ("full", "sliding", "mla"):
            raise ValueError(f"unknown KV layer kind {self.kind!r}")
        if self.layers < 0 or self.kv_heads < 1 or self.k_head_dim < 1 or self.v_head_dim < 0:
            raise ValueError(f"bad KV geometry {self}")
        if self.kind == "sliding" and not self.window:
            raise ValueError("a sliding KV kind needs its window")

    @property
    def bytes_per_token(self) -> int:
        """fp16 bytes per token for one layer of this kind (K and V)."""
        return self.kv_heads * (self.k_head_dim + self.v_head_dim) * self.value_bytes

    def tokens(self, context: int, extra: int = 0) -> int:
        """Tokens one layer holds at `context`; a sliding cache briefly holds `extra` more
        (mlx-lm's rotating cache keeps window + prompt chunk - 1 during prefill)."""
        if self.window is None:
            return context
        return min(context, self.window + max(extra - 1, 0))

    @property
    def dims(self) -> kvcache.AttentionDims:
        return kvcache.AttentionDims(
            self.kv_heads, self.k_head_dim, self.v_head_dim, self.value_bytes
        )

    def compressible(self, mode: str) -> bool:
        """Whether `mode` applies to this kind: sliding layers stay fp16 (their cache is bounded,
        SPEC §4), MLA latents are not per-head K/V."""
        return mode == kvcache.FLOAT or self.kind == "full"

    def nbytes(self, context: int, mode: str = kvcache.FLOAT, extra: int = 0) -> int:
        """Bytes of this kind's cache, all its layers, at `context` tokens (one sequence): the
        mode's row in the KV modes table counts one layer."""
        row = kvcache.mode(mode)
        if not self.compressible(mode):
            raise ValueError(f"KV mode {mode} does not apply to {self.kind} layers")
        t = self.tokens(context, extra)
        if self.window is not None:  # float; mlx-lm's rotating cache stops at window + chunk - 1
            cap = (self.window + max(extra - 1, 0)) * self.bytes_per_token
            return self.layers * min(kvcache.mode(kvcache.FLOAT).nbytes(self.dims, t), cap)
        return self.layers * row.nbytes(self.dims, t)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "k_head_dim": self.k_head_dim,
            "v_head_dim": self.v_head_dim,
            "window": self.window,
            "value_bytes": self.value_bytes,
            "bytes_per_token_per_layer": self.bytes_per_token,
        }


@dataclass(frozen=True)
class Tensor:
    """One weight tensor (or `count` identical ones, e.g. a layer's stacked experts)."""

    name: str
    role: str
    params: int  # parameters of one copy
    in_dim: int  # the quantization axis; 0 for vectors (never quantized)
    count: int = 1
    expert: bool = False  # part of a routed expert's pager record (its weights and biases)

    def nbytes(self, width: RoleWidth, float_bytes: int) -> int:
        # mlx-lm quantizes a matrix only when its input dim splits into whole groups
        if width.bits is None or self.in_dim == 0 or self.in_dim % width.group_size:
            return self.params * float_bytes * self.count
        return width.bytes_for(self.params, float_bytes) * self.count


class _Builder:
    """Collects tensors with the names mlx-lm gives them (the names are for messages only)."""

    def __init__(self):
        self.tensors: list[Tensor] = []

    def mat(self, name, role, out_dim, in_dim, count=1, bias=False):
        ex = role == "routed"
        self.tensors.append(Tensor(name, role, out_dim * in_dim, in_dim, count, ex))
        if bias:
            self.tensors.append(Tensor(name + ".bias", "keep_float", out_dim, 0, count, ex))

    def vec(self, name, n, count=1):
        self.tensors.append(Tensor(name, "keep_float", n, 0, count))

    def table(self, name, rows, width):
        """An embedding table: quantized along its width."""
        self.tensors.append(Tensor(name, "dense", rows * width, width))

    def attention(
        self, p, h, nq, nkv, hd, bias=False, o_bias=None, qk_norm=False, q_gate=False, v=True
    ):
        o_bias = bias if o_bias is None else o_bias
        self.mat(f"{p}.q_proj", "dense", nq * hd * (2 if q_gate else 1), h, bias=bias)
        self.mat(f"{p}.k_proj", "dense", nkv * hd, h, bias=bias)
        if v:
            self.mat(f"{p}.v_proj", "dense", nkv * hd, h, bias=bias)
        self.mat(f"{p}.o_proj", "dense", h, nq * hd, bias=o_bias)
        if qk_norm:
            self.vec(f"{p}.q_norm", hd)
            self.vec(f"{p}.k_norm", hd)

    def glu(self, p, role, h, i, bias=False, count=1):
        self.mat(f"{p}.gate_proj", role, i, h, count, bias)
        self.mat(f"{p}.up_proj", role, i, h, count, bias)
        self.mat(f"{p}.down_proj", role, h, i, count, bias)


@dataclass(frozen=True)
class ModelSizes:
    """Sizes of one model at given widths. Bytes are what the weights take in memory."""

    architecture: str
    name: str
    widths: RoleWidths
    float_bytes: int
    params: dict  # role -> parameters
    bytes: dict  # role -> bytes at `widths`
    layers: int
    moe_layers: int
    experts_per_layer: int
    experts_per_token: int
    params_per_expert: int
    bytes_per_expert: int  # one routed expert of one layer, with its biases (one pager record)
    active_params: int  # parameters read per token (all but the unchosen experts)
    embedding_bytes: int  # the input embedding table when untied (a decode step reads one row)
    kv: tuple  # KVKind per attention-layer kind
    recurrent_layers: int
    recurrent_state_bytes: int  # fixed Mamba / Gated-DeltaNet state per sequence, all layers
    hidden_size: int
    vocab_size: int
    max_context: int | None
    q_heads: int = 0  # query heads of the widest attention layer (unfused attention scores)
    max_head_dim: int = 0
    widest_per_token: int = 0  # largest per-token intermediate (elements) of one layer
    ssm_heads: int = 0  # Mamba-2 heads (their chunked prefill builds [heads, 256, 256] matrices)
    weights_on_disk: int | None = None  # measured from the folder's files, when there is one
    excluded: dict = field(
        default_factory=dict
    )  # part -> params (None: not sized), e.g. mtp, vision
    notes: tuple = ()

    def __post_init__(self):
        if set(self.params) != set(ROLES) or set(self.bytes) != set(ROLES):
            raise ValueError(f"params and bytes need every role {ROLES}")
        if self.moe_layers and (self.experts_per_layer < 1 or self.experts_per_token < 1):
            raise ValueError("a model with MoE layers needs experts per layer and per token")
        if self.experts_per_token > max(self.experts_per_layer, 0):
            raise ValueError("experts per token exceed experts per layer")

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def expert_bytes(self) -> int:
        """All routed experts (what the pager can leave on disk)."""
        return self.moe_layers * self.experts_per_layer * self.bytes_per_expert

    @property
    def resident_bytes(self) -> int:
        """Everything but the routed experts: always in memory."""
        return self.total_bytes - self.expert_bytes

    @property
    def active_expert_bytes(self) -> int:
        """Expert bytes one decoded token reads (top-k per MoE layer)."""
        return self.moe_layers * self.experts_per_token * self.bytes_per_expert

    @property
    def kv_bytes_per_token(self) -> int:
        """fp16 KV bytes per token over the layers whose cache grows with context."""
        return sum(k.layers * k.bytes_per_token for k in self.kv if k.window is None)

    @property
    def attention_layers(self) -> int:
        return sum(k.layers for k in self.kv)

    def kv_bytes(self, context: int, modes: dict | str = kvcache.FLOAT, extra: int = 0) -> int:
        """KV bytes at `context` tokens; `modes` maps kind -> mode (or one mode for the kinds
        it applies to, fp16 for the rest)."""
        total = 0
        for k in self.kv:
            m = modes if isinstance(modes, str) else modes.get(k.kind, kvcache.FLOAT)
            if not k.compressible(m):
                m = kvcache.FLOAT
            total += k.nbytes(context, m, extra)
        return total

    def to_dict(self) -> dict:
        return {
            "architecture": self.architecture,
            "name": self.name,
            "widths": self.widths.to_dict(),
            "float_bytes": self.float_bytes,
            "params": dict(self.params),
            "bytes": dict(self.bytes),
            "total_params": self.total_params,
            "total_bytes": self.total_bytes,
            "resident_bytes": self.resident_bytes,
            "expert_bytes": self.expert_bytes,
            "layers": self.layers,
            "moe_layers": self.moe_layers,
            "experts_per_layer": self.experts_per_layer,
            "experts_per_token": self.experts_per_token,
            "params_per_expert": self.params_per_expert,
            "bytes_per_expert": self.bytes_per_expert,
            "active_params": self.active_params,
            "embedding_bytes": self.embedding_bytes,
            "kv": [k.to_dict() for k in self.kv],
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "recurrent_layers": self.recurrent_layers,
            "recurrent_state_bytes": self.recurrent_state_bytes,
            "max_context": self.max_context,
            "weights_on_disk": self.weights_on_disk,
            "excluded": dict(self.excluded),
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------
# Per-architecture tensor lists. Each returns (builder, info) where info carries the MoE and
# cache geometry. They follow mlx-lm 0.32's modules of the same name.


@dataclass
class _Info:
    layers: int
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    kv: list = field(default_factory=list)
    recurrent_layers: int = 0
    recurrent_state: int = 0
    ssm_heads: int = 0
    excluded: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def _req(cfg: dict, *keys):
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise SizeError(f"config has no {', '.join(missing)} (needed for {cfg.get('model_type')})")
    return [cfg[k] for k in keys]


def _embeddings(b: _Builder, cfg: dict, h: int, prefix="model.", tie_default=False):
    vocab = cfg["vocab_size"]
    b.mat(f"{prefix}embed_tokens", "dense", vocab, h)
    b.vec(f"{prefix}norm", h)
    if not cfg.get("tie_word_embeddings", tie_default):
        b.mat("lm_head", "dense", vocab, h)


def _kv_from_counts(full: int, sliding: int, nkv: int, hd: int, window) -> list:
    kinds = []
    if full:
        kinds.append(KVKind("full", full, nkv, hd, hd))
    if sliding:
        kinds.append(KVKind("sliding", sliding, nkv, hd, hd, window))
    return kinds


def _dense(cfg: dict, arch: str):
    """llama / qwen3 / mistral-style dense transformers."""
    h, L, nq, inter = _req(
        cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"
    )
    nkv = cfg.get("num_key_value_heads") or nq
    hd = cfg.get("head_dim") or h // nq
    b = _Builder()
    qk_norm = arch == "qwen3"
    bias = bool(cfg.get("attention_bias", False)) if arch == "llama" else False
    for i in range(L):
        p = f"model.layers.{i}"
        b.attention(f"{p}.self_attn", h, nq, nkv, hd, bias=bias, qk_norm=qk_norm)
        b.glu(
            f"{p}.mlp",
            "dense",
            h,
            inter,
            bias=bool(cfg.get("mlp_bias", False)) if arch == "llama" else False,
        )
        b.vec(f"{p}.input_layernorm", h)
        b.vec(f"{p}.post_attention_layernorm", h)
    _embeddings(b, cfg, h, tie_default=(arch == "llama"))
    types = cfg.get("layer_types")
    sliding = (
        sum(t == "sliding_attention" for t in types) if types and cfg.get("sliding_window") else 0
    )
    return b, _Info(L, kv=_kv_from_counts(L - sliding, sliding, nkv, hd, cfg.get("sliding_window")))


def _qwen_moe(cfg: dict, arch: str):
    """qwen3_moe, qwen2_moe, mixtral: attention + a sparse MoE block (optionally a shared
    expert with its sigmoid gate)."""
    h, L, nq = _req(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads")
    nkv = cfg.get("num_key_value_heads") or nq
    hd = cfg.get("head_dim") or h // nq
    if arch == "mixtral":
        E, k, mi = _req(cfg, "num_local_experts", "num_experts_per_tok", "intermediate_size")
    else:
        E, k, mi = _req(cfg, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    b = _Builder()
    moe = 0
    for i in range(L):
        p = f"model.layers.{i}"
        b.attention(
            f"{p}.self_attn",
            h,
            nq,
            nkv,
            hd,
            bias=(arch == "qwen2_moe"),
            o_bias=False,
            qk_norm=(arch == "qwen3_moe"),
        )
        b.vec(f"{p}.input_layernorm", h)
        b.vec(f"{p}.post_attention_layernorm", h)
        sparse = True
        if arch == "qwen3_moe":
            step = cfg.get("decoder_sparse_step", 1) or 1
            sparse = i not in (cfg.get("mlp_only_layers") or []) and E > 0 and (i + 1) % step == 0
        if not sparse:
            b.glu(f"{p}.mlp", "dense", h, cfg["intermediate_size"])
            continue
        moe += 1
        b.mat(f"{p}.mlp.gate", "keep_float", E, h)
        b.glu(f"{p}.mlp.switch_mlp", "routed", h, mi, count=E)
        if arch == "qwen2_moe":
            b.glu(f"{p}.mlp.shared_expert", "shared", h, cfg["shared_expert_intermediate_size"])
            b.mat(f"{p}.mlp.shared_expert_gate", "keep_float", 1, h)
    _embeddings(b, cfg, h)
    return b, _Info(L, moe, E, k, kv=_kv_from_counts(L, 0, nkv, hd, None))


def _deepseek_v3(cfg: dict, arch: str):
    h, L, nh, inter = _req(
        cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"
    )
    E, k, mi = _req(cfg, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    qlr = cfg.get("q_lora_rank")
    kvr = cfg.get("kv_lora_rank", 512)
    nope, rope, vd = (
        cfg.get("qk_nope_head_dim", 128),
        cfg.get("qk_rope_head_dim", 64),
        cfg.get("v_head_dim", 128),
    )
    first_dense = cfg.get("first_k_dense_replace", 0)
    freq = cfg.get("moe_layer_freq", 1) or 1
    n_shared = cfg.get("n_shared_experts")
    b = _Builder()
    moe = 0

    def layer(b, p, is_moe):
        a = f"{p}.self_attn"
        if qlr is None:
            b.mat(f"{a}.q_proj", "dense", nh * (nope + rope), h)
        else:
            b.mat(f"{a}.q_a_proj", "dense", qlr, h, bias=cfg.get("attention_bias", False))
            b.vec(f"{a}.q_a_layernorm", qlr)
            b.mat(f"{a}.q_b_proj", "dense", nh * (nope + rope), qlr)
        b.mat(
            f"{a}.kv_a_proj_with_mqa", "dense", kvr + rope, h, bias=cfg.get("attention_bias", False)
        )
        b.vec(f"{a}.kv_a_layernorm", kvr)
        b.mat(f"{a}.embed_q", "dense", kvr, nope, count=nh)  # kv_b_proj's K half, per head
        b.mat(f"{a}.unembed_out", "dense", vd, kvr, count=nh)  # kv_b_proj's V half
        b.mat(f"{a}.o_proj", "dense", h, nh * vd, bias=cfg.get("attention_bias", False))
        b.vec(f"{p}.input_layernorm", h)
        b.vec(f"{p}.post_attention_layernorm", h)
        if is_moe:
            b.mat(f"{p}.mlp.gate.weight", "keep_float", E, h)
            b.vec(f"{p}.mlp.gate.e_score_correction_bias", E)
            b.glu(f"{p}.mlp.switch_mlp", "routed", h, mi, count=E)
            if n_shared:
                b.glu(f"{p}.mlp.shared_experts", "shared", h, mi * n_shared)
        else:
            b.glu(f"{p}.mlp", "dense", h, inter)

    for i in range(L):
        is_moe = i >= first_dense and i % freq == 0
        moe += is_moe
        layer(b, f"model.layers.{i}", is_moe)
    _embeddings(b, cfg, h)
    info = _Info(L, moe, E, k, kv=[KVKind("mla", L, 1, kvr, rope)])
    n_mtp = cfg.get("num_nextn_predict_layers") or 0
    if n_mtp:
        m = _Builder()
        for j in range(n_mtp):
            layer(m, f"mtp.{j}", True)
            m.mat(f"mtp.{j}.eh_proj", "dense", h, 2 * h)
            m.vec(f"mtp.{j}.enorm", h)
            m.vec(f"mtp.{j}.hnorm", h)
            # the checkpoint stores its own copies of the embedding and head for each MTP layer
            m.mat(f"mtp.{j}.embed_tokens", "dense", cfg["vocab_size"], h)
            m.mat(f"mtp.{j}.shared_head", "dense", cfg["vocab_size"], h)
        info.excluded["mtp"] = sum(t.params * t.count for t in m.tensors)
    return b, info


def _gpt_oss(cfg: dict, arch: str):
    h, L, nq = _req(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads")
    E, k, mi = _req(cfg, "num_local_experts", "num_experts_per_tok", "intermediate_size")
    nkv = cfg.get("num_key_value_heads") or nq
    hd = cfg.get("head_dim") or h // nq
    b = _Builder()
    for i in range(L):
        p = f"model.layers.{i}"
        b.attention(f"{p}.self_attn", h, nq, nkv, hd, bias=True)
        b.vec(f"{p}.self_attn.sinks", nq)
        b.glu(f"{p}.mlp.experts", "routed", h, mi, bias=True, count=E)
        b.mat(f"{p}.mlp.router", "keep_float", E, h, bias=True)
        b.vec(f"{p}.input_layernorm", h)
        b.vec(f"{p}.post_attention_layernorm", h)
    _embeddings(b, cfg, h)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)
    ]
    sliding = sum(t == "sliding_attention" for t in types)
    return b, _Info(
        L,
        L,
        E,
        k,
        kv=_kv_from_counts(L - sliding, sliding, nkv, hd, cfg.get("sliding_window", 128)),
    )


def _gemma4(cfg: dict, arch: str):
    h, L, nq, inter = _req(
        cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"
    )
    hd = cfg.get("head_dim", 256)
    ghd = cfg.get("global_head_dim") or hd
    nkv = cfg.get("num_key_value_heads", 1)
    gkv = cfg.get("num_global_key_value_heads")
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    n_shared_kv = cfg.get("num_kv_shared_layers", 0) or 0
    pli = cfg.get("hidden_size_per_layer_input", 0) or 0
    moe_on = bool(cfg.get("enable_moe_block", False))
    E, k, mi = (
        cfg.get("num_experts") or 0,
        cfg.get("top_k_experts") or 0,
        cfg.get("moe_intermediate_size") or 0,
    )
    types = cfg.get("layer_types")
    if not types:
        pat = cfg.get("sliding_window_pattern", 5)
        types = ((["sliding_attention"] * (pat - 1) + ["full_attention"]) * (L // pat + 1))[:L]
    first_shared = L - n_shared_kv
    b = _Builder()
    full_kv = sliding_kv = 0
    for i in range(L):
        p = f"model.layers.{i}"
        full = types[i] == "full_attention"
        d = ghd if full else hd
        eqv = k_eq_v and full
        kvh = gkv if (eqv and gkv is not None) else nkv
        has_kv = i < first_shared
        a = f"{p}.self_attn"
        b.mat(f"{a}.q_proj", "dense", nq * d, h)
        b.vec(f"{a}.q_norm", d)
        if has_kv:
            b.mat(f"{a}.k_proj", "dense", kvh * d, h)
            if not eqv:
                b.mat(f"{a}.v_proj", "dense", kvh * d, h)
            b.vec(f"{a}.k_norm", d)
            if full:
                full_kv += 1
            else:
                sliding_kv += 1
        b.mat(f"{a}.o_proj", "dense", h, nq * d)
        wide = cfg.get("use_double_wide_mlp", True) and first_shared <= i and first_shared > 0
        b.glu(f"{p}.mlp", "dense", h, inter * (2 if wide else 1))
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            b.vec(f"{p}.{n}", h)
        if moe_on:
            b.mat(f"{p}.router.proj", "keep_float", E, h)
            b.vec(f"{p}.router.scale", h)
            b.vec(f"{p}.router.per_expert_scale", E)
            b.glu(f"{p}.experts.switch_glu", "routed", h, mi, count=E)
            for n in (
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ):
                b.vec(f"{p}.{n}", h)
        if pli:
            b.mat(f"{p}.per_layer_input_gate", "dense", pli, h)
            b.mat(f"{p}.per_layer_projection", "dense", h, pli)
            b.vec(f"{p}.post_per_layer_input_norm", h)
        b.vec(f"{p}.layer_scalar", 1)
    _embeddings(b, cfg, h, tie_default=True)
    if pli:
        b.table(
            "model.embed_tokens_per_layer",
            cfg.get("vocab_size_per_layer_input", cfg["vocab_size"]),
            L * pli,
        )
        b.mat("model.per_layer_model_projection", "dense", L * pli, h)
        b.vec("model.per_layer_projection_norm", pli)
    kv = []
    if full_kv:
        fkv = gkv if (k_eq_v and gkv is not None) else nkv
        kv.append(KVKind("full", full_kv, fkv, ghd, ghd))
    if sliding_kv:
        kv.append(KVKind("sliding", sliding_kv, nkv, hd, hd, cfg.get("sliding_window", 512)))
    info = _Info(L, L if moe_on else 0, E if moe_on else 0, k if moe_on else 0, kv=kv)
    if k_eq_v:
        info.notes.append(
            "full-attention layers share one K/V projection (attention_k_eq_v); the cache still "
            "holds K and V separately (normalised differently), so KV counts both"
        )
    if moe_on:
        info.notes.append(
            "every layer runs a dense GeGLU MLP (role dense, 4-bit) beside its MoE block"
        )
    return b, info


def _gdn(b: _Builder, p: str, cfg: dict, h: int, split_proj: bool) -> int:
    """A Gated-DeltaNet layer (qwen3_next's fused in_proj_qkvz/ba, qwen3_5's split ones).
    Returns its fixed state bytes per sequence (fp32 state, activation-dtype conv state)."""
    nv, nk = cfg["linear_num_value_heads"], cfg["linear_num_key_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    kernel = cfg.get("linear_conv_kernel_dim", 4)
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    b.tensors.append(Tensor(f"{p}.conv1d.weight", "keep_float", conv_dim * kernel, 0))
    if split_proj:
        b.mat(f"{p}.in_proj_qkv", "dense", conv_dim, h)
        b.mat(f"{p}.in_proj_z", "dense", value_dim, h)
        b.mat(f"{p}.in_proj_b", "dense", nv, h)
        b.mat(f"{p}.in_proj_a", "dense", nv, h)
    else:
        b.mat(f"{p}.in_proj_qkvz", "dense", 2 * key_dim + 2 * value_dim, h)
        b.mat(f"{p}.in_proj_ba", "dense", 2 * nv, h)
    b.vec(f"{p}.dt_bias", nv)
    b.vec(f"{p}.A_log", nv)
    b.vec(f"{p}.norm", dv)
    b.mat(f"{p}.out_proj", "dense", h, value_dim)
    return nv * dv * dk * 4 + (kernel - 1) * conv_dim * KV_VALUE_BYTES


def _qwen3_next(cfg: dict, arch: str):
    """qwen3_next and qwen3_5(_moe): Gated-DeltaNet layers + gated full attention every
    `full_attention_interval` layers, MoE with one shared expert."""
    split = arch in ("qwen3_5", "qwen3_5_moe")
    h, L, nq = _req(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads")
    nkv = cfg.get("num_key_value_heads") or nq
    hd = cfg.get("head_dim") or h // nq
    interval = cfg.get("full_attention_interval", 4)
    E, k = cfg.get("num_experts", 0) or 0, cfg.get("num_experts_per_tok", 0) or 0
    mi = cfg.get("moe_intermediate_size", 0)
    si = cfg.get("shared_expert_intermediate_size", 0)
    b = _Builder()
    moe = full = lin = state = 0

    def mlp_block(b, p, i):
        if split:
            sparse = E > 0
        else:
            step = cfg.get("decoder_sparse_step", 1) or 1
            sparse = i not in (cfg.get("mlp_only_layers") or []) and E > 0 and (i + 1) % step == 0
        if not sparse:
            b.glu(f"{p}.mlp", "dense", h, cfg["intermediate_size"])
            return 0
        b.mat(f"{p}.mlp.gate", "keep_float", E, h)
        b.glu(f"{p}.mlp.switch_mlp", "routed", h, mi, count=E)
        b.glu(f"{p}.mlp.shared_expert", "shared", h, si)
        b.mat(f"{p}.mlp.shared_expert_gate", "keep_float", 1, h)
        return 1

    for i in range(L):
        p = f"model.layers.{i}"
        if (i + 1) % interval:
            lin += 1
            state += _gdn(b, f"{p}.linear_attn", cfg, h, split)
        else:
            full += 1
            b.attention(
                f"{p}.self_attn",
                h,
                nq,
                nkv,
                hd,
                bias=cfg.get("attention_bias", False),
                qk_norm=True,
                q_gate=True,
            )
        b.vec(f"{p}.input_layernorm", h)
        b.vec(f"{p}.post_attention_layernorm", h)
        moe += mlp_block(b, p, i)
    _embeddings(b, cfg, h)
    info = _Info(
        L, moe, E if moe else 0, k if moe else 0, kv=_kv_from_counts(full, 0, nkv, hd, None)
    )
    info.recurrent_layers, info.recurrent_state = lin, state
    n_mtp = cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0
    if n_mtp:
        m = _Builder()
        for j in range(n_mtp):
            m.attention(f"mtp.layers.{j}.self_attn", h, nq, nkv, hd, qk_norm=True, q_gate=True)
            mlp_block(m, f"mtp.layers.{j}", j)
        m.mat("mtp.fc", "dense", h, 2 * h)
        info.excluded["mtp"] = sum(t.params * t.count for t in m.tensors)
    return b, info


def _nemotron_h(cfg: dict, arch: str):
    """Nemotron-H: a per-layer pattern of Mamba-2 (M), attention (*), MLP (-) and MoE (E)
    blocks; Nemotron 3 Super's latent MoE runs its experts in a smaller latent space."""
    h, nq = _req(cfg, "hidden_size", "num_attention_heads")
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is None:
        raise SizeError("nemotron_h config has no hybrid_override_pattern")
    pattern = list(pattern)
    nkv = cfg.get("num_key_value_heads") or nq
    hd = cfg.get("head_dim") or h // nq
    E, k = cfg.get("n_routed_experts") or 0, cfg.get("num_experts_per_tok") or 0
    latent = cfg.get("moe_latent_size")
    mi = cfg.get("moe_intermediate_size")
    b = _Builder()
    state = 0

    def block(b, p, t):
        b.vec(f"{p}.norm", h)
        m = f"{p}.mixer"
        if t == "M":
            nh, hdm = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
            ng, ns, kern = cfg["n_groups"], cfg["ssm_state_size"], cfg["conv_kernel"]
            d_in = nh * hdm
            conv_dim = d_in + 2 * ng * ns
            b.tensors.append(Tensor(f"{m}.conv1d.weight", "keep_float", conv_dim * kern, 0))
            if cfg.get("use_conv_bias", True):
                b.vec(f"{m}.conv1d.bias", conv_dim)
            b.mat(
                f"{m}.in_proj",
                "dense",
                d_in + conv_dim + nh,
                h,
                bias=cfg.get("mamba_proj_bias", False),
            )
            for n in ("dt_bias", "A_log", "D"):
                b.vec(f"{m}.{n}", nh)
            b.vec(f"{m}.norm", d_in)
            b.mat(f"{m}.out_proj", "dense", h, d_in, bias=cfg.get("mamba_proj_bias", False))
            return nh * hdm * ns * 4 + (kern - 1) * conv_dim * KV_VALUE_BYTES
        if t == "*":
            b.attention(m, h, nq, nkv, hd, bias=cfg.get("attention_bias", False))
        elif t == "-":
            b.mat(
                f"{m}.up_proj",
                "dense",
                cfg["intermediate_size"],
                h,
                bias=cfg.get("mlp_bias", False),
            )
            b.mat(
                f"{m}.down_proj",
                "dense",
                h,
                cfg["intermediate_size"],
                bias=cfg.get("mlp_bias", False),
            )
        elif t == "E":
            d = latent or h
            b.mat(f"{m}.switch_mlp.fc1", "routed", mi, d, count=E)
            b.mat(f"{m}.switch_mlp.fc2", "routed", d, mi, count=E)
            b.mat(f"{m}.gate.weight", "keep_float", E, h)
            b.vec(f"{m}.gate.e_score_correction_bias", E)
            if cfg.get("n_shared_experts") is not None:
                si = cfg["moe_shared_expert_intermediate_size"]
                b.mat(
                    f"{m}.shared_experts.up_proj", "shared", si, h, bias=cfg.get("mlp_bias", False)
                )
                b.mat(
                    f"{m}.shared_experts.down_proj",
                    "shared",
                    h,
                    si,
                    bias=cfg.get("mlp_bias", False),
                )
            if latent:
                b.mat(f"{m}.fc1_latent_proj", "dense", latent, h, bias=cfg.get("mlp_bias", False))
                b.mat(f"{m}.fc2_latent_proj", "dense", h, latent, bias=cfg.get("mlp_bias", False))
        else:
            raise SizeError(f"unknown nemotron_h block type {t!r} in hybrid_override_pattern")
        return 0

    for i, t in enumerate(pattern):
        state += block(b, f"backbone.layers.{i}", t)
    vocab = cfg["vocab_size"]
    b.mat("backbone.embeddings", "dense", vocab, h)
    b.vec("backbone.norm_f", h)
    if not cfg.get("tie_word_embeddings", False):
        b.mat("lm_head", "dense", vocab, h)
    n_attn, n_moe, n_mamba = pattern.count("*"), pattern.count("E"), pattern.count("M")
    info = _Info(
        len(pattern),
        n_moe,
        E if n_moe else 0,
        k if n_moe else 0,
        kv=_kv_from_counts(n_attn, 0, nkv, hd, None),
    )
    info.recurrent_layers, info.recurrent_state = n_mamba, state
    info.ssm_heads = cfg.get("mamba_num_heads", 0) if n_mamba else 0
    mtp = cfg.get("mtp_hybrid_override_pattern")
    if mtp and cfg.get("num_nextn_predict_layers"):
        m = _Builder()
        for j in range(cfg["num_nextn_predict_layers"]):
            for n, t in enumerate(mtp):
                block(m, f"mtp.layers.{j}.{n}", t)
            m.mat(f"mtp.{j}.eh_proj", "dense", h, 2 * h)
        info.excluded["mtp"] = sum(t.params * t.count for t in m.tensors)
        info.notes.append(
            f"multi-token-prediction block ({mtp}) excluded: mlx-lm drops mtp.* weights when loading"
        )
    if latent:
        info.notes.append(
            f"latent MoE: routed experts run in a {latent}-d latent space (fc1/fc2_latent_proj are dense)"
        )
    return b, info


_ARCHS = {
    "llama": _dense,
    "mistral": _dense,
    "qwen2": _dense,
    "qwen3": _dense,
    "qwen3_moe": _qwen_moe,
    "qwen2_moe": _qwen_moe,
    "mixtral": _qwen_moe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "gemma4_text": _gemma4,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_next,
    "qwen3_5_moe": _qwen3_next,
    "nemotron_h": _nemotron_h,
}
SUPPORTED = tuple(sorted(_ARCHS) + ["gemma4"])


def _text_config(config: dict) -> tuple[str, dict, dict]:
    """(architecture, text config, excluded parts) for wrapper configs (gemma4, qwen3_5_moe)."""
    arch = config.get("model_type")
    excluded = {}
    if arch == "gemma4":
        text = dict(config.get("text_config") or {})
        text.setdefault("vocab_size", config.get("vocab_size", 262144))
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
        if config.get("vision_config"):
            excluded["vision"] = None  # not counted (text-only path); size unknown from config
        return "gemma4_text", text, excluded
    if arch in ("qwen3_5", "qwen3_5_moe") and "text_config" in config:
        text = dict(config["text_config"])
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        if config.get("vision_config"):
            excluded["vision"] = None
        return arch, text, excluded
    return arch, config, excluded


def float_bytes_of(config: dict) -> int:
    """Bytes per unquantized value: 4 for float32 checkpoints, else 2 (bf16/fp16)."""
    text = config.get("text_config") or {}
    dt = config.get("torch_dtype") or config.get("dtype") or text.get("dtype") or "bfloat16"
    return 4 if str(dt) in ("float32", "fp32") else 2


def widths_of(config: dict) -> RoleWidths | None:
    """Widths of an already-quantized mlx folder (`quantization` block), else None."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        return None
    w = RoleWidth(int(q["bits"]), int(q.get("group_size", 64)))
    return RoleWidths(dense=w, routed=w, shared=w)


# Config dimensions: every integer size, count or rank. Bounds far above any real model, so
# that a hostile config (num_hidden_layers 1e9) is refused before anything is built from it.
_DIM_KEY = re.compile(r"^(num_|n_)|(_size|_dim|_heads|_layers|_experts|_rank|_per_tok)$")
_NOT_DIMS = {"num_experts_per_tok_scale"}  # floats whose names look like counts
MAX_DIM = 1 << 24  # vocabularies and context lengths reach millions, no dimension 16M
MAX_LAYERS = 4096  # the deepest real models have a few hundred layers
_POSITIVE = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
)
_EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")


def check_dimensions(config: dict, where: str | None = None) -> None:
    """Refuse a config whose dimensions are not whole numbers in range, with the key and its
    value: the one check that sizes, the planner, the download pre-check and the loader share."""
    if not isinstance(config, dict):
        raise SizeError("config is not a JSON object", where)
    parts = [config] + [config[k] for k in ("text_config",) if isinstance(config.get(k), dict)]
    for part in parts:
        for key, v in part.items():
            if (
                v is None
                or isinstance(v, (list, dict))
                or key in _NOT_DIMS
                or not _DIM_KEY.search(key)
            ):
                continue  # lists of layer indices and nested blocks are not dimensions
            if isinstance(v, bool) or not isinstance(v, int):
                raise SizeError(f"config {key} must be a whole number, got {v!r}", where)
            top = MAX_LAYERS if key.endswith("_layers") else MAX_DIM
            low = 1 if key in _POSITIVE else 0
            if not low <= v <= top:
                raise SizeError(f"config {key} = {v} is out of range ({low}..{top})", where)
        k = part.get("num_experts_per_tok")
        n = next((part[c] for c in _EXPERT_COUNTS if part.get(c)), None)
        if k is not None and n is not None and k > n:
            raise SizeError(
                f"config num_experts_per_tok = {k} exceeds the {n} experts per layer", where
            )


def tensors(config: dict) -> tuple[list[Tensor], _Info, str]:
    """The tensor list of a config (for tests and the converter's cross-check)."""
    check_dimensions(config)
    arch, text, excluded = _text_config(config)
    fn = _ARCHS.get(arch)
    if fn is None:
        raise SizeError(
            f"no size rule for architecture {arch!r}; supported: {', '.join(SUPPORTED)}"
        )
    try:
        b, info = fn(text, arch)
    except KeyError as e:
        raise SizeError(f"config has no {e.args[0]} (needed for {arch})") from e
    info.excluded.update(excluded)
    return b.tensors, info, arch


def compute(
    config: dict,
    widths: RoleWidths | None = None,
    name: str = "",
    float_bytes: int | None = None,
) -> ModelSizes:
    """Sizes of the model described by `config` at `widths` (default: the config's own
    quantization if it has one, else SPEC §2's role widths)."""
    if not isinstance(config, dict) or "model_type" not in config:
        raise SizeError("config has no model_type", name or None)
    ts, info, arch = tensors(config)
    widths = widths or widths_of(config) or RoleWidths()
    fb = float_bytes or float_bytes_of(config)
    params = dict.fromkeys(ROLES, 0)
    nbytes = dict.fromkeys(ROLES, 0)
    for t in ts:
        params[t.role] += t.params * t.count
        nbytes[t.role] += t.nbytes(widths[t.role], fb)
    # one routed expert = its slice of every stacked routed tensor of one layer (+ its biases)
    routed = [t for t in ts if t.expert]
    moe_layers = info.moe_layers
    per_expert_params = sum(t.params for t in routed if t.role == "routed") // max(moe_layers, 1)
    per_expert_bytes = sum(t.nbytes(widths[t.role], fb) // t.count for t in routed) // max(
        moe_layers, 1
    )
    total = sum(params.values())
    active = total - moe_layers * (info.experts - info.top_k) * per_expert_params
    text = _text_config(config)[1]
    tied = not any(t.name == "lm_head" for t in ts)
    # widest per-token intermediate: a dense GLU's gate/up/product, or top-k experts' hidden
    big = [
        t
        for t in ts
        if t.in_dim
        and not t.expert
        and t.name not in ("lm_head", "model.embed_tokens", "backbone.embeddings")
    ]
    dense_w = max((t.params // t.in_dim for t in big), default=0)
    exp_w = info.top_k * sum(t.params // t.in_dim for t in routed if t.in_dim) // max(moe_layers, 1)
    kv = tuple(replace(k, value_bytes=fb) for k in info.kv)
    emb = [t for t in ts if t.name in ("model.embed_tokens", "backbone.embeddings")]
    embedding_bytes = 0 if tied else sum(t.nbytes(widths[t.role], fb) for t in emb)
    return ModelSizes(
        architecture=arch,
        name=name or config.get("_name_or_path", "") or arch,
        widths=widths,
        float_bytes=fb,
        params=params,
        bytes=nbytes,
        layers=info.layers,
        moe_layers=moe_layers,
        experts_per_layer=info.experts,
        experts_per_token=info.top_k,
        params_per_expert=per_expert_params,
        bytes_per_expert=per_expert_bytes,
        active_params=active,
        embedding_bytes=embedding_bytes,
        kv=kv,
        recurrent_layers=info.recurrent_layers,
        recurrent_state_bytes=info.recurrent_state,
        hidden_size=text.get("hidden_size", 0),
        vocab_size=text.get("vocab_size", 0),
        max_context=text.get("max_position_embeddings"),
        q_heads=text.get("num_attention_heads", 0),
        max_head_dim=max((max(k.k_head_dim, k.v_head_dim) for k in kv), default=0),
        ssm_heads=info.ssm_heads,
        widest_per_token=max(3 * dense_w, exp_w + info.top_k * text.get("hidden_size", 0)),
        excluded=info.excluded,
        notes=tuple(info.notes),
    )


def shared_configs_dir() -> Path | None:
    """The folder of real configs: $ROTARYQUANT_CONFIGS, ../shared/configs, or the repo's copy."""
    env = os.environ.get("ROTARYQUANT_CONFIGS")
    for p in (
        Path(env) if env else None,
        SHARED_CONFIGS,
        Path(__file__).resolve().parents[2] / "tests" / "data" / "configs",
    ):
        if p is not None and p.is_dir():
            return p
    return None


def load_config(model: str | os.PathLike) -> tuple[dict, str, Path]:
    """Resolve MODEL (a model folder, a config.json path, or a file name in the configs folder)
    to (config, display name, config path). Raises SizeError naming the file."""
    p = Path(model)
    if p.is_dir():
        name, p = p.name, p / "config.json"
        if not p.exists():
            raise SizeError("not a model folder: config.json is missing", str(p.parent))
    elif p.is_file():
        name = p.stem if p.name != "config.json" else p.parent.name
    else:
        folder = shared_configs_dir()
        cands = []
        if folder is not None:
            cands = [folder / str(model), folder / f"{model}.json"]
        hit = next((c for c in cands if c.is_file()), None)
        if hit is None:
            known = ", ".join(sorted(c.stem for c in folder.glob("*.json"))) if folder else "none"
            raise SizeError(
                f"no such model folder, config file or known config (known: {known})", str(model)
            )
        p, name = hit, hit.stem
    try:
        config = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SizeError(f"not valid JSON: {e}", str(p)) from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise SizeError("config has no model_type", str(p))
    return config, name, p


_FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}


def folder_weights(folder: Path) -> tuple[int, int | None] | None:
    """(bytes of every weight file's tensors, bytes of an unquantized norm's dtype) for a model
    folder with weights, else None. Expert record files (experts/*.bin) count whole."""
    from .loader import read_safetensors_header

    shards = sorted(folder.glob("model*.safetensors"))
    if not shards:
        return None
    total, norm_bytes = 0, None
    for shard in shards:
        header = read_safetensors_header(shard)
        for name, t in header.items():
            if name == "__metadata__":
                continue
            lo, hi = t["data_offsets"]
            total += hi - lo
            if norm_bytes is None and "norm" in name and t["dtype"] in _FLOAT_DTYPES:
                norm_bytes = _FLOAT_DTYPES[t["dtype"]]
    total += (
        sum(f.stat().st_size for f in (folder / "experts").glob("*.bin"))
        if (folder / "experts").is_dir()
        else 0
    )
    return total, norm_bytes


def sizes_for(model: str | os.PathLike, widths: RoleWidths | None = None) -> ModelSizes:
    """`compute` for a model folder / config path / config name, with errors naming the file.

    For a folder with weights: the widths come from its manifest (the conversion fixed them),
    the activation dtype from its norms, and `weights_on_disk` from its files."""
    config, name, path = load_config(model)
    folder = path.parent if path.name == "config.json" else None
    measured = None
    fb = None
    if folder is not None and widths is None:
        from .manifest import Manifest

        try:
            man = Manifest.load(folder)
        except Exception:  # a corrupt manifest is the loader's error to report, not ours
            man = None
        if man is not None and man.roles and all(r in man.roles for r in ROLES):
            widths = RoleWidths.from_dict(man.roles)
    if folder is not None:
        got = folder_weights(folder)
        if got is not None:
            measured, fb = got
    try:
        s = compute(config, widths, name=name, float_bytes=fb)
    except SizeError as e:
        raise SizeError(e.reason, str(path)) from e
    return replace(s, weights_on_disk=measured) if measured is not None else s
