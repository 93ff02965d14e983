"""What every benchmark writes beside its figures: the machine, the date and the commit.

    from record import write_result
    write_result("pager_speed", {"runs": [...]})   # -> benchmarks/results/pager_speed.json

One current run per benchmark file; older runs live in git history.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def commit() -> str:
    """The checked-out commit (with "+dirty" when the tree has uncommitted changes), or
    "unknown" outside a git checkout. A copy of the tree run elsewhere (a GPU machine) may carry
    stale git metadata: ROTARYQUANT_COMMIT names the commit it was copied from."""
    if os.environ.get("ROTARYQUANT_COMMIT"):
        return os.environ["ROTARYQUANT_COMMIT"]
    root = Path(__file__).parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def header(machine: dict | None = None) -> dict:
    """`machine` defaults to the engine's description of this one (backend, device, RAM)."""
    if machine is None:
        from app.engine.bench import machine as describe

        machine = describe()
    return {"machine": machine, "date": datetime.date.today().isoformat(), "commit": commit()}


def write_result(
    name: str, payload: dict, machine: dict | None = None, path: Path | None = None
) -> Path:
    out = path or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**header(machine), **payload}, indent=2) + "\n")
    print(f"wrote {out}")
    return out
