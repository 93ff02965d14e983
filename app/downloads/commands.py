"""`rotaryquant download | models | remove | verify`: the library from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..units import size
from .errors import Cancelled, Paused
from .events import ConvertProgress, DownloadProgress, StateChanged
from .transfer import gib


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "download", help="download a model from the Hugging Face hub into the library"
    )
    p.add_argument(
        "repo", help="hub repo id (owner/name) or a catalog name (see `models --catalog`)"
    )
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument(
        "--convert",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="convert MoE models to the plan's widths (default: yes)",
    )
    p.add_argument("--keep-original", action="store_true", help="keep the downloaded original")
    p.add_argument("--name", help="name in the library (default: the repo's name)")
    p.add_argument("--token", help="hub token (default: HF_TOKEN or `hf auth login`)")
    p.add_argument(
        "--reserve",
        help="disk space to keep free, e.g. 5GB (default: $ROTARYQUANT_DISK_RESERVE, else 2GB)",
    )
    p.set_defaults(func=cmd_download)

    p = subparsers.add_parser("models", help="list the models in the library")
    p.add_argument("--catalog", action="store_true", help="list the supported models to download")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_models)

    p = subparsers.add_parser("remove", help="remove a model from the library (and its files)")
    p.add_argument("name")
    p.add_argument("--keep-files", action="store_true", help="forget it but leave its folders")
    p.set_defaults(func=cmd_remove)

    p = subparsers.add_parser(
        "verify", help="check a model's files against the recorded sizes/hashes"
    )
    p.add_argument("name")
    p.add_argument("--deep", action="store_true", help="also re-hash every file (slow)")
    p.set_defaults(func=cmd_verify)


class _Printer:
    """Progress on one rewritten line on a terminal, a line per 10% otherwise (logs, CI)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr  # looked up now: sys.stderr may be replaced (tests)
        self.tty = self.stream.isatty()
        self.last_step = -1
        self.last_t = 0.0

    def __call__(self, ev) -> None:
        if isinstance(ev, DownloadProgress):
            eta = f", {ev.eta:.0f} s left" if ev.eta else ""
            line = (
                f"downloading {ev.fraction * 100:5.1f}%  {gib(ev.done)} / {gib(ev.total)}  "
                f"{gib(int(ev.rate))}/s{eta}  [{ev.files_done}/{ev.files_total}] {ev.file}"
            )
            self._show(line, ev.fraction)
        elif isinstance(ev, ConvertProgress):
            self._show(f"converting {ev.fraction * 100:5.1f}%  {ev.stage}", ev.fraction)
        elif isinstance(ev, StateChanged):
            self._end()
            err = f" ({ev.error})" if ev.error else ""
            print(f"{ev.name}: {ev.state}{err}", file=self.stream)
            self.last_step = -1

    def _show(self, line: str, fraction: float) -> None:
        if self.tty:
            now = time.monotonic()
            if now - self.last_t > 0.2 or fraction >= 1.0:
                self.stream.write("\r" + line[:150].ljust(150))
                self.stream.flush()
                self.last_t = now
            return
        step = int(fraction * 10)
        if step != self.last_step:
            self.last_step = step
            print(line, file=self.stream)

    def _end(self) -> None:
        if self.tty:
            self.stream.write("\n")


def cmd_download(args) -> int:
    from ..units import parse_size
    from .library import Library

    lib = Library()
    try:
        reserve = parse_size(args.reserve) if args.reserve else None
    except ValueError as e:
        print(f"error: --reserve: {e}", file=sys.stderr)
        return 2
    plan = lib.plan(args.repo, args.revision, args.token, args.convert, reserve)
    print(
        f"{plan.listing.repo} @ {plan.listing.commit[:12]}: {len(plan.files)} files, "
        f"{gib(plan.download_bytes)}"
    )
    for f in plan.files:
        print(f"  {f.path:50s} {gib(f.size):>12s}  {'sha256 ' + f.sha256[:12] if f.sha256 else ''}")
    print(plan.disk.message)
    printer = _Printer()
    try:
        e = lib.download(
            plan.listing.repo,
            args.revision,
            name=args.name,
            convert=args.convert,
            keep_original=args.keep_original,
            tok=args.token,
            on_event=printer,
            transfer_options={"reserve": plan.disk.keep_free},
        )
    except KeyboardInterrupt:
        printer._end()
        print("paused: run the same command again to resume", file=sys.stderr)
        return 130
    except (Paused, Cancelled) as e:
        print(str(e), file=sys.stderr)
        return 1
    printer._end()
    print(f"{e.name}: {e.state} in {e.folder} ({gib(e.disk_bytes)})")
    return 0 if e.state == "ready" else 1


def cmd_models(args) -> int:
    if args.catalog:
        from .catalog import load_catalog
        from .library import Library

        lib = Library()
        rows = [(r, lib.catalog_plan(r)) for r in load_catalog()]
        if args.json:
            print(json.dumps([{**r.__dict__, "plan": p} for r, p in rows], indent=2))
            return 0
        for r, p in rows:
            conv = f", converted {size(p['converted_bytes'])}" if p.get("converted_bytes") else ""
            print(
                f"{r.name:28s} {r.repo:46s} {r.architecture:10s} {r.params / 1e9:6.1f}B "
                f"({r.active_params / 1e9:.1f}B active)  download ~{size(r.approx_bytes)}{conv}"
            )
            print(f"    this machine: {_verdict(p)}")
        return 0
    from .library import Library

    lib = Library()
    builtin = lib.builtin()
    entries = ([builtin] if builtin else []) + lib.entries()
    if args.json:
        print(json.dumps([{**e.to_dict(), "builtin": e is builtin} for e in entries], indent=2))
        return 0
    for e in entries:
        err = f"  ({e.error})" if e.error else ""
        where = "built in" if e is builtin else e.repo or e.folder
        print(
            f"{e.name:28s} {e.state:11s} {e.architecture:11s} {gib(e.disk_bytes):>10s}  "
            f"{where}{err}"
        )
    if len(entries) == (1 if builtin else 0):
        print("no downloaded models yet: `rotaryquant download REPO` (see `models --catalog`)")
    return 0


def _verdict(plan: dict) -> str:
    """One line of what the planner says (or why it can't say)."""
    if "planner" in plan:
        p = plan["planner"]
        experts = (
            f"experts paged, {gib(p['expert_budget'])} resident"
            if p["paging"]
            else "all experts resident"
        )
        kv = ", ".join(f"{k} {m}" for k, m in p["kv_modes"].items())
        return (
            f"runs: {experts}, KV {kv}, context {p['context_limit']}, peak {gib(p['process_peak'])}"
        )
    if "planner_refused" in plan:
        return f"does not run: {plan['planner_refused']}"
    return plan.get("planner_error", "no plan (the planner is not available)")


def cmd_remove(args) -> int:
    from .library import Library

    Library().remove(args.name, delete_files=not args.keep_files)
    print(f"removed {args.name}")
    return 0


def cmd_verify(args) -> int:
    from .library import Library

    r = Library().verify(args.name, deep=args.deep)
    if r.ok:
        checked = (", hashes checked" if r.deep else "") + (
            f", {r.records} expert records checked" if r.records else ""
        )
        print(f"{r.name}: OK ({r.files} files, {gib(r.bytes)}{checked})")
        return 0
    print(f"{r.name}: BROKEN", file=sys.stderr)
    for p in r.problems:
        print(f"  {p}", file=sys.stderr)
    return 1
