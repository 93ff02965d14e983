"""Weight widths by role (SPEC §2): dense 4-bit, routed experts 2-bit, shared experts 8-bit,
keep-float unquantized. Shared by the converter, the size calculator and the planner."""

from __future__ import annotations

from dataclasses import dataclass, replace

ROLES = ("dense", "routed", "shared", "keep_float")
_VALID_BITS = (2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class RoleWidth:
    bits: int | None  # None = kept in floating point
    group_size: int = 64
    mode: str = "affine"

    def __post_init__(self):
        if self.bits is not None and self.bits not in _VALID_BITS:
            raise ValueError(f"bits must be one of {_VALID_BITS} or None, got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {self.group_size}")

    def bytes_for(self, n_params: int, float_bytes: int = 2) -> int:
        """Bytes of `n_params` weights at this width (affine: an fp16 scale and bias per group)."""
        if self.bits is None:
            return n_params * float_bytes
        groups = -(-n_params // self.group_size)
        return n_params * self.bits // 8 + groups * 2 * 2


@dataclass(frozen=True)
class RoleWidths:
    dense: RoleWidth = RoleWidth(4, 64)
    routed: RoleWidth = RoleWidth(2, 64)
    shared: RoleWidth = RoleWidth(8, 64)
    keep_float: RoleWidth = RoleWidth(None)

    def __getitem__(self, role: str) -> RoleWidth:
        if role not in ROLES:
            raise KeyError(f"unknown role {role!r}; roles are {ROLES}")
        return getattr(self, role)

    def with_bits(self, **bits: int | None) -> RoleWidths:
        """`widths.with_bits(routed=3)` -> a copy with those roles' bits changed."""
        changes = {}
        for role, b in bits.items():
            if role not in ROLES:
                raise KeyError(f"unknown role {role!r}; roles are {ROLES}")
            changes[role] = replace(self[role], bits=b)
        return replace(self, **changes)

    @classmethod
    def parse(cls, spec: str) -> RoleWidths:
        """Parse 'dense=4,routed=2,shared=8' (also 'routed=3/32' for a group size, 'x=16' or
        'x=float' for unquantized)."""
        w = cls()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise ValueError(f"bad width {part!r}: expected role=bits, e.g. routed=2")
            role, val = (s.strip() for s in part.split("=", 1))
            if role not in ROLES:
                raise ValueError(
                    f"bad width {part!r}: unknown role {role!r}; roles are {', '.join(ROLES)}"
                )
            group = w[role].group_size
            try:
                if "/" in val:
                    val, g = val.split("/", 1)
                    group = int(g)
                bits = None if val in ("16", "float", "fp16", "bf16") else int(val)
            except ValueError:
                raise ValueError(
                    f"bad width {part!r}: expected role=bits[/group], e.g. routed=2 or routed=3/32"
                ) from None
            w = replace(w, **{role: RoleWidth(bits, group)})
        return w

    def to_dict(self) -> dict:
        return {r: {"bits": self[r].bits, "group_size": self[r].group_size} for r in ROLES}

    @classmethod
    def from_dict(cls, d: dict) -> RoleWidths:
        return cls(
            **{
                r: RoleWidth(v.get("bits"), v.get("group_size", 64))
                for r, v in d.items()
                if r in ROLES
            }
        )
