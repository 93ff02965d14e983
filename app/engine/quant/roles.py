"""The role of every weight (SPEC §2): dense, routed expert, shared expert or keep-float.

Roles are decided on mlx-lm parameter paths (after `sanitize`), from a small rule table per
architecture; an architecture without rules is an error, never a guess:
- routed: the weights of the stacked expert module (`switch_mlp`, `switch_glu`, gpt_oss
  `mlp.experts`), i.e. every `SwitchLinear`; their float `bias` (gpt_oss) is keep-float.
- shared: the always-on shared expert MLP (`shared_expert`, `shared_experts`).
- keep-float: norms, routers/gates (even when they are `nn.Linear`), biases, SSM A/D/dt, conv,
  and every parameter of a module that has no quantized form.
- dense: every other weight of a quantizable module (attention, dense MLP, Mamba/linear-attention
  projections, Nemotron 3's latent projections `fc1_latent_proj`/`fc2_latent_proj`,
  embeddings, lm_head).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import UnsupportedArchitectureError
from .widths import ROLES, RoleWidth, RoleWidths

_QUANT_LEAVES = ("weight", "scales", "biases")  # a quantized weight's three tensors


@dataclass(frozen=True)
class ArchRules:
    model_type: str
    experts: tuple[str, ...] = ()  # module-path suffixes of the stacked routed-expert modules
    routers: tuple[str, ...] = ()  # module-path suffixes of routers kept in float
    shared: tuple[str, ...] = ()  # module-path fragments of shared experts
    # How a Hugging Face checkpoint stores the routed experts:
    #   "per_expert": `<prefix>.experts.<e>.<proj>.weight` (qwen3_moe, mixtral, nemotron_h, ...)
    #   "fused": `<prefix>.experts.gate_up_proj` [E, 2I, H] + `.experts.down_proj` [E, H, I]
    #   "gpt_oss": MXFP4 `*_blocks`/`*_scales` with gate/up rows interleaved, plus biases
    hf_experts: str = "none"
    # HF per-expert projection name -> mlx-lm projection name (identity when absent)
    proj_names: dict = field(default_factory=dict)
    # where the expert module sits relative to the HF prefix before ".experts."
    expert_module: str = "switch_mlp"

    @property
    def has_experts(self) -> bool:
        return bool(self.experts)


_QWEN_SHARED = dict(
    experts=("mlp.switch_mlp",),
    routers=("mlp.gate", "mlp.shared_expert_gate"),
    shared=("mlp.shared_expert",),
)

RULES: dict[str, ArchRules] = {
    r.model_type: r
    for r in (
        ArchRules(
            "qwen3_moe", experts=("mlp.switch_mlp",), routers=("mlp.gate",), hf_experts="per_expert"
        ),
        ArchRules("qwen2_moe", **_QWEN_SHARED, hf_experts="per_expert"),
        ArchRules("qwen3_next", **_QWEN_SHARED, hf_experts="per_expert"),
        ArchRules("qwen3_5_moe", **_QWEN_SHARED, hf_experts="fused"),
        # Nemotron-H: MoEGate is not a Linear (float anyway); fc1/fc2_latent_proj are dense.
        ArchRules(
            "nemotron_h",
            experts=("mixer.switch_mlp",),
            routers=("mixer.gate",),
            shared=("mixer.shared_experts",),
            hf_experts="per_expert",
            proj_names={"up_proj": "fc1", "down_proj": "fc2"},
        ),
        # Gemma 4: the per-layer dense GeGLU MLP (`mlp`) runs beside the experts: dense role.
        ArchRules(
            "gemma4_text",
            experts=("experts.switch_glu",),
            routers=("router.proj",),
            hf_experts="fused",
            expert_module="experts.switch_glu",
        ),
        ArchRules(
            "gemma4",
            experts=("experts.switch_glu",),
            routers=("router.proj",),
            hf_experts="fused",
            expert_module="experts.switch_glu",
        ),  # multimodal wrapper
        ArchRules(
            "gpt_oss",
            experts=("mlp.experts",),
            routers=("mlp.router",),
            hf_experts="gpt_oss",
            expert_module="experts",
        ),
        ArchRules(
            "mixtral",
            experts=("block_sparse_moe.switch_mlp",),
            routers=("block_sparse_moe.gate",),
            hf_experts="per_expert",
            proj_names={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
        ),
        ArchRules(
            "deepseek_v3",
            experts=("mlp.switch_mlp",),
            routers=("mlp.gate",),
            shared=("mlp.shared_experts",),
            hf_experts="per_expert",
        ),
        ArchRules("llama"),  # dense only (SmolLM2, Llama 3)
        ArchRules("qwen3"),  # dense only
    )
}


def rules_for(model_type: str) -> ArchRules:
    try:
        return RULES[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"no role rules for architecture {model_type!r}: role quantization supports "
            f"{', '.join(sorted(RULES))}"
        ) from None


def _ends_with(path: str, suffix: str) -> bool:
    return path == suffix or path.endswith("." + suffix)


def expert_container(rules: ArchRules, module_path: str) -> str | None:
    """The expert module path if `module_path` is one of its projections, else None."""
    parent = module_path.rpartition(".")[0]
    if any(_ends_with(parent, s) for s in rules.experts):
        return parent
    return None


def module_role(rules: ArchRules, module_path: str) -> str:
    """Role of the weight of the quantizable module at `module_path`."""
    if expert_container(rules, module_path) is not None:
        return "routed"
    if any(_ends_with(module_path, r) for r in rules.routers):
        return "keep_float"
    if any(f".{s}." in f".{module_path}." for s in rules.shared):
        return "shared"
    return "dense"


def param_role(rules: ArchRules, path: str, quantizable: bool) -> str:
    """Role of the parameter `path` (e.g. `model.layers.0.mlp.switch_mlp.up_proj.weight`);
    `quantizable`: whether its module has a quantized form (Linear, Embedding, SwitchLinear)."""
    module, _, leaf = path.rpartition(".")
    if not quantizable or leaf not in _QUANT_LEAVES:
        return "keep_float"
    return module_role(rules, module)


def _is_quantizable(m) -> bool:
    return hasattr(m, "to_quantized") or ("scales" in m and "weight" in m)


def _is_switch(m) -> bool:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return isinstance(m, (SwitchLinear, QuantizedSwitchLinear))


def check_structure(model, model_type: str) -> ArchRules:
    """Check that the rules see every expert module of `model`: a SwitchLinear outside the
    declared expert modules means the rules no longer match mlx-lm's model."""
    rules = rules_for(model_type)
    for path, m in model.named_modules():
        if _is_switch(m) and expert_container(rules, path) is None:
            raise UnsupportedArchitectureError(
                f"{model_type}: expert layer {path!r} is not covered by the role rules "
                f"(experts at {rules.experts}); mlx-lm's model changed"
            )
    return rules


def expert_modules(model, model_type: str) -> dict[str, list[str]]:
    """Stacked routed-expert modules of `model`: module path -> its projection names."""
    rules = check_structure(model, model_type)
    found: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        if _is_switch(m):
            found.setdefault(expert_container(rules, path), []).append(path.rpartition(".")[2])
    return {k: sorted(v) for k, v in sorted(found.items())}


def param_roles(model, model_type: str) -> dict[str, str]:
    """Role of every parameter of `model` (float or quantized; built lazily from a config,
    nothing is allocated)."""
    from mlx.utils import tree_flatten

    rules = check_structure(model, model_type)
    quantizable = {p for p, m in model.named_modules() if _is_quantizable(m)}
    roles = {}
    for name, _ in tree_flatten(model.parameters()):
        module = name.rpartition(".")[0]
        roles[name] = param_role(rules, name, module in quantizable)
    return roles


def width_for(widths: RoleWidths, role: str, in_dims: int) -> RoleWidth | None:
    """The quantization of a module of `role` with `in_dims` inputs, None to keep it float
    (a width of None, or an input size the group does not divide, as mlx-lm's convert)."""
    w = widths[role]
    if w.bits is None or in_dims % w.group_size:
        return None
    return w


def role_predicate(model_type: str, widths: RoleWidths | None = None) -> Callable:
    """`class_predicate` for `nn.quantize` / mlx-lm's `quantize_model`: per-role widths."""
    rules = rules_for(model_type)
    widths = widths or RoleWidths()

    def predicate(path: str, module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        w = width_for(widths, module_role(rules, path), module.weight.shape[-1])
        if w is None:
            return False
        return {"group_size": w.group_size, "bits": w.bits, "mode": w.mode}

    return predicate


@dataclass(frozen=True)
class ParamPlan:
    """One parameter of the converted model: its role and, if quantized, its width."""

    name: str
    role: str
    shape: tuple[int, ...]
    width: RoleWidth | None  # None: stored in float

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: unknown role {self.role!r}")

    @property
    def params(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def nbytes(self, float_bytes: int = 2) -> int:
        """Bytes of weight + scales + biases once converted (affine: fp16/bf16 scale and bias
        per group of each row; float parameters at `float_bytes`)."""
        if self.width is None:
            return self.params * float_bytes
        rows = self.params // self.shape[-1]
        groups = self.shape[-1] // self.width.group_size
        return rows * (self.shape[-1] * self.width.bits // 8 + groups * 2 * float_bytes)


def plan_params(model, model_type: str, widths: RoleWidths | None = None) -> list[ParamPlan]:
    """Role and width of every parameter of an unquantized `model` (mlx-lm, built from a
    config); the converter and the size calculator both count bytes from this."""
    from mlx.utils import tree_flatten

    widths = widths or RoleWidths()
    rules = check_structure(model, model_type)
    modules = dict(model.named_modules())
    plans = []
    for name, p in tree_flatten(model.parameters()):
        module, _, leaf = name.rpartition(".")
        m = modules.get(module)
        quantizable = m is not None and hasattr(m, "to_quantized") and leaf == "weight"
        role = param_role(rules, name, quantizable)
        width = width_for(widths, role, p.shape[-1]) if quantizable else None
        plans.append(ParamPlan(name, role, tuple(p.shape), width))
    return plans
