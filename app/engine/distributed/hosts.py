"""hosts.json: mlx.launch's hostfile with what the planner needs added.

The file is read unchanged by `mlx.launch --hostfile` (it ignores keys it does not know), so one
file both plans and launches:

    {"backend": "ring",                      # mlx.launch's: ring | jaccl | mpi | nccl
     "link": "thunderbolt5",                 # a preset of plan.LINKS, or {"gbps": .., "latency_us": ..}
     "split": "auto",                        # auto (the planner's pick) | pipeline | experts
     "hosts": [{"ssh": "studio.local", "ips": ["10.0.0.1"], "ram": "32GB", "name": "studio"},
               {"ssh": "mbp.local", "ips": ["10.0.0.2"], "ram": "32GB"}]}

Host i is rank i. `name` (optional) is how errors and plans call the host; default `ssh`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EngineError

SPLITS = ("auto", "pipeline", "experts")


@dataclass(frozen=True)
class Host:
    ssh: str
    ips: tuple[str, ...] = ()
    ram: int | None = None  # bytes; None: unknown (the planner then needs --ram)
    name: str = ""

    def __post_init__(self):
        if not self.ssh:
            raise ValueError("a host needs an `ssh` name")
        if self.ram is not None and self.ram <= 0:
            raise ValueError(f"host {self.ssh}: ram must be positive")

    @property
    def label(self) -> str:
        return self.name or self.ssh


@dataclass(frozen=True)
class Hosts:
    hosts: tuple[Host, ...]
    backend: str = "ring"
    link: str | dict = "thunderbolt5"
    path: str = ""
    raw: dict = field(default_factory=dict, compare=False)
    split: str = "auto"  # auto (the planner's choice) | pipeline | experts

    def __post_init__(self):
        if not self.hosts:
            raise ValueError("hosts.json lists no hosts")
        if self.split not in SPLITS:
            raise ValueError(f"split {self.split!r}: one of {', '.join(SPLITS)}")

    def __len__(self) -> int:
        return len(self.hosts)

    def label(self, rank: int) -> str:
        return self.hosts[rank].label if 0 <= rank < len(self.hosts) else f"rank {rank}"


def _ram(v) -> int | None:
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return int(v)
    from ..planner import parse_size

    return parse_size(str(v))


def parse_hosts(data, path: str = "") -> Hosts:
    """A hosts.json document (a dict with `hosts`, or mlx's plain list) -> Hosts."""
    items = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError('expected a list of hosts (or {"hosts": [...]})')
    hosts = []
    for i, h in enumerate(items):
        if not isinstance(h, dict):
            raise ValueError(f"host {i}: expected an object with `ssh`")
        hosts.append(
            Host(
                ssh=str(h.get("ssh", "")),
                ips=tuple(h.get("ips", ())),
                ram=_ram(h.get("ram")),
                name=str(h.get("name", "")),
            )
        )
    meta = data if isinstance(data, dict) else {}
    return Hosts(
        tuple(hosts),
        backend=meta.get("backend") or "ring",
        link=meta.get("link", "thunderbolt5"),
        path=path,
        raw=meta,
        split=str(meta.get("split") or "auto"),
    )


def load_hosts(path: str | os.PathLike) -> Hosts:
    """Read hosts.json. Raises EngineError naming the file and what is wrong."""
    p = Path(path)
    try:
        return parse_hosts(json.loads(p.read_text()), str(p))
    except OSError as e:
        raise EngineError(f"{p}: cannot read the hosts file ({e.strerror or e})") from e
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise EngineError(f"{p}: not a valid hosts file: {e}") from e


def ring_labels() -> list[str]:
    """Host labels from the ring hostfile mlx.launch hands each rank (MLX_HOSTFILE): the IPs."""
    f = os.environ.get("MLX_HOSTFILE")
    if not f or not Path(f).exists():
        return []
    try:
        nodes = json.loads(Path(f).read_text())
        return [str(n[0]).rsplit(":", 1)[0] for n in nodes]
    except (json.JSONDecodeError, IndexError, TypeError):
        return []
