"""The app's manifest, `rotaryquant.json`, kept beside a model's weights.

It carries a format version (never a class name), the architecture, and the per-role widths and
bytes that the converter fills in. Unknown keys are kept but ignored, so older apps can read
newer manifests of the same major version.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

MANIFEST_NAME = "rotaryquant.json"
FORMAT = "rotaryquant-model"
FORMAT_VERSION = 1


@dataclass
class Manifest:
    architecture: str
    name: str = ""
    source: str = ""  # where the weights came from: a hub repo id, a GGUF file, "random" for tests
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    created: float = field(default_factory=time.time)
    # role -> {"bits", "group_size", "params", "bytes", "kurtosis"}; filled by the converter
    roles: dict = field(default_factory=dict)
    # per-expert record layout for the pager (None when experts live in the safetensors)
    experts: dict | None = None
    total_bytes: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.format != FORMAT:
            raise ValueError(f"not a RotaryQuant manifest (format {self.format!r})")
        if not isinstance(self.format_version, int) or self.format_version < 1:
            raise ValueError(f"bad manifest format_version {self.format_version!r}")
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"manifest format {self.format_version} is newer than this app reads "
                f"({FORMAT_VERSION}): update RotaryQuant"
            )
        if not self.architecture:
            raise ValueError("manifest has no architecture")

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known}
        m = cls(**kw)
        m.extra.update(extra)
        return m

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}

    def save(self, folder: str | os.PathLike) -> Path:
        path = Path(folder) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))
        os.replace(tmp, path)  # atomic: a crash never leaves half a manifest
        return path

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Manifest | None:
        path = Path(folder) / MANIFEST_NAME
        if not path.exists():
            return None
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            from .errors import ModelLoadError

            raise ModelLoadError(f"corrupt manifest: {e}", str(path)) from e
