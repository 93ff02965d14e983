"""The catalog of supported models (app/downloads/catalog.json), free entry of any repo id,
and the disk-space check shown before a download."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from . import transfer

CATALOG_PATH = Path(__file__).with_name("catalog.json")
CATALOG_FORMAT = "rotaryquant-catalog"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    repo: str
    architecture: str
    params: float
    active_params: float
    approx_bytes: float  # download size, approximate (the hub listing gives the exact one)
    format: str = "bf16"
    config: str = ""  # stem of the matching config in the shared configs folder
    gated: bool = False
    alternatives: tuple = ()

    def __post_init__(self):
        if "/" not in self.repo:
            raise ValueError(f"catalog entry {self.name!r}: repo {self.repo!r} is not owner/name")
        if not (0 < self.active_params <= self.params) or self.approx_bytes <= 0:
            raise ValueError(f"catalog entry {self.name!r}: inconsistent sizes")

    @property
    def is_moe(self) -> bool:
        return self.active_params < self.params


@cache
def load_catalog(path: Path = CATALOG_PATH) -> tuple[CatalogEntry, ...]:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable catalog: {e}") from e
    if d.get("format") != CATALOG_FORMAT or d.get("format_version") != 1:
        raise ValueError(f"{path}: not a version-1 RotaryQuant catalog")
    out = []
    for m in d["models"]:
        m = dict(m)
        m["alternatives"] = tuple(m.get("alternatives", ()))
        out.append(CatalogEntry(**m))
    return tuple(out)


def find(name_or_repo: str) -> CatalogEntry | None:
    """A catalog entry by display name or repo id (case-insensitive); None for a free repo id."""
    key = name_or_repo.strip().lower()
    for e in load_catalog():
        if key in (e.name.lower(), e.repo.lower()):
            return e
    return None


@dataclass(frozen=True)
class DiskCheck:
    folder: str
    free: int
    needed: int  # bytes the download and conversion will add at their peak
    keep_free: int = transfer.DEFAULT_RESERVE
    parts: dict = field(default_factory=dict)  # what `needed` is made of, for the UI

    @property
    def fits(self) -> bool:
        return self.needed + self.keep_free <= self.free

    @property
    def message(self) -> str:
        parts = ", ".join(f"{k} {transfer.gib(v)}" for k, v in self.parts.items())
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"needs {transfer.gib(self.needed)} ({parts}), {transfer.gib(self.free)} free in "
            f"{self.folder}: {verdict} (keeping {transfer.gib(self.keep_free)} free)"
        )


def disk_check(folder: str | Path, parts: dict[str, int], reserve: int | None = None) -> DiskCheck:
    """Room for `parts` in `folder`, keeping the download's reserve free (the same figure the
    download itself keeps: transfer.disk_reserve())."""
    free = transfer.free_bytes(folder)
    keep = transfer.disk_reserve() if reserve is None else reserve
    return DiskCheck(str(folder), free, sum(parts.values()), keep, dict(parts))
