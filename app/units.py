"""One size unit everywhere (the app, the CLI, the planner's reasons): binary, labelled as such.

A "32 GB" Mac has 32 GiB of RAM and the hub's file sizes are bytes; both are shown in GiB so
that every figure can be compared with every other.
"""

from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def parse_size(text: str | int) -> int:
    """'5GB', '512MB', '2g', '1.5 GiB' or a byte count -> bytes (GB means GiB, as in size)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "").removesuffix("b").removesuffix("i")
    mult = {"k": KiB, "m": MiB, "g": GiB, "t": GiB << 10}.get(s[-1:], 1)
    try:
        n = float(s[:-1] if mult != 1 else s)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 512MB)") from None
    if n < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(n * mult)


def size(n: float | int | None, digits: int = 1, none: str = "—") -> str:
    """'56.9 GiB', '94 MiB', '1.4 MiB', '512 B' (None: `none`)."""
    if n is None:
        return none
    if abs(n) >= GiB / 10:
        return f"{n / GiB:.{digits}f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.{1 if abs(n) < 10 * MiB else 0}f} MiB"
    if abs(n) >= KiB:
        return f"{n / KiB:.0f} KiB"
    return f"{int(n)} B"
