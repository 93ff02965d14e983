"""`rotaryquant convert SRC DST [--bits dense=4,routed=2,shared=8]` and `rotaryquant inspect DST`."""

from __future__ import annotations

import json
import sys
import time


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("convert", help="role-quantize a checkpoint into the app's format")
    p.add_argument("src", help="Hugging Face or mlx-lm model folder")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument(
        "--bits",
        default="",
        help="widths per role, e.g. dense=4,routed=2,shared=8 (role=bits[/group]; "
        "'float' keeps a role unquantized). Default: dense=4,routed=2,shared=8",
    )
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    p.set_defaults(func=cmd_convert)
    p = subparsers.add_parser("inspect", help="roles, widths, bytes and kurtosis of a model")
    p.add_argument("dst", help="model folder, or a name from `rotaryquant models`")
    p.add_argument("--verify", action="store_true", help="check every expert record's CRC")
    p.add_argument("--json", action="store_true", help="print the manifest's roles as JSON")
    p.set_defaults(func=cmd_inspect)


def _progress_printer():
    last = [0.0]

    def show(p) -> None:
        now = time.monotonic()
        if p.stage != "finish" and now - last[0] < 0.5:  # throttle at the source
            return
        last[0] = now
        pct = 100.0 * p.done / max(p.total, 1)
        print(
            f"\r{p.stage:8s} {pct:5.1f}%  {p.done / 2**30:7.2f} / {p.total / 2**30:.2f} GiB  "
            f"{p.item[:60]:60s}",
            end="" if p.stage != "finish" else "\n",
            file=sys.stderr,
            flush=True,
        )

    return show


def cmd_convert(args) -> int:
    from ..errors import EngineError
    from .convert import convert
    from .widths import RoleWidths

    try:
        widths = RoleWidths.parse(args.bits)
    except (KeyError, ValueError) as e:
        print(f"error: --bits {args.bits!r}: {e}", file=sys.stderr)
        return 2
    try:
        man = convert(
            args.src,
            args.dst,
            widths=widths,
            overwrite=args.overwrite,
            progress=None if args.quiet else _progress_printer(),
        )
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_manifest(man))
    return 0


def format_manifest(man) -> str:
    lines = [
        f"{man.name}  ({man.architecture}, from {man.source})",
        f"{'role':10s} {'bits':>5s} {'group':>5s} {'params':>15s} {'bytes':>12s} "
        f"{'kurtosis':>9s} {'median/tensor':>13s}",
    ]
    for role, r in man.roles.items():
        bits = "float" if r.get("bits") is None else str(r["bits"])

        def k(x):
            return "-" if x is None else f"{x:.3f}"

        lines.append(
            f"{role:10s} {bits:>5s} {r.get('group_size', 0):5d} {r.get('params', 0):15,d} "
            f"{r.get('bytes', 0) / 2**20:10.1f}Mi {k(r.get('kurtosis')):>9s} "
            f"{k(r.get('kurtosis_median_tensor')):>13s}"
        )
    lines.append(f"total {man.total_bytes / 2**30:.3f} GiB")
    if man.experts:
        lays = man.experts["layers"]
        first = next(iter(lays.values()))
        lines.append(
            f"experts: {len(lays)} MoE layers x {first['num_experts']} records of "
            f"{first['record_size']:,d} bytes (stride {first['stride']:,d}) in "
            f"{man.experts['dir']}/"
        )
    else:
        lines.append("experts: none in records")
    return "\n".join(lines)


def _model_folder(arg: str) -> str:
    """A folder as given, else the folder of the library model of that name."""
    from pathlib import Path

    if Path(arg).is_dir():
        return arg
    from ...downloads.library import Library

    lib = Library()
    e = lib.builtin() if lib.is_builtin(arg) else lib.store.get(arg)
    return e.folder if e is not None and e.folder else arg


def cmd_inspect(args) -> int:
    from ..errors import EngineError
    from ..manifest import Manifest
    from ..offload.records import ExpertStore

    try:
        args.dst = _model_folder(args.dst)
        man = Manifest.load(args.dst)
        if man is None:
            print(
                f"error: {args.dst}: no rotaryquant.json (not a converted model)", file=sys.stderr
            )
            return 1
        if args.json:
            print(
                json.dumps(
                    {
                        "architecture": man.architecture,
                        "roles": man.roles,
                        "total_bytes": man.total_bytes,
                    },
                    indent=2,
                )
            )
        else:
            print(format_manifest(man))
        if args.verify and man.experts:
            with ExpertStore(args.dst, man.experts) as store:
                store.verify_all()
            n = sum(v["num_experts"] for v in man.experts["layers"].values())
            print(f"verified {n} expert records", file=sys.stderr)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
