"""`rotaryquant plan` and `rotaryquant sizes`: the auto-planner and the size calculator on the
command line. Registered by app/cli.py through `add_commands(subparsers)`."""

from __future__ import annotations

import argparse
import json

from . import kvcache


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan widths, expert budget, KV mode and context for a model on this (or a described) machine",
        description="MODEL is a model folder, a config.json, or the name of a config in the configs folder "
        "(e.g. qwen3-30b-a3b). Sizes in GB mean GiB.",
    )
    p.add_argument("model")
    p.add_argument(
        "--ram", help="plan for a machine with this much RAM (e.g. 32GB) instead of this one"
    )
    p.add_argument(
        "--backend",
        choices=("metal", "cuda", "cpu"),
        help="plan for this backend (default: this machine's; with --ram on another backend, a simulated machine)",
    )
    p.add_argument(
        "--context", type=int, help="wanted context in tokens (default 8192; given: must fit)"
    )
    p.add_argument(
        "--kv-mode",
        choices=kvcache.names(offered=True),
        help="override the KV mode of full-attention layers",
    )
    p.add_argument("--expert-budget", help="override the resident expert budget (e.g. 12GB)")
    p.add_argument(
        "--widths", help="override widths before conversion, e.g. dense=4,routed=3,shared=8"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--hosts", help="plan for the machines of hosts.json (split, paging, tok/s)")
    p.add_argument(
        "--split",
        choices=("auto", "pipeline", "experts"),
        help="with --hosts: pipeline (layers per host), experts (each host a share of every MoE "
        "layer's experts) or auto (the planner's pick; default: hosts.json's `split`)",
    )
    p.set_defaults(func=cmd_plan)

    s = subparsers.add_parser(
        "sizes", help="per-role parameters and bytes of a model from its config.json"
    )
    s.add_argument("model")
    s.add_argument("--widths", help="e.g. dense=4,routed=2,shared=8")
    s.add_argument("--json", action="store_true", help="print every figure as JSON")
    s.set_defaults(func=cmd_sizes)


def machine_for(args: argparse.Namespace):
    from .backend import detect
    from .planner import Machine

    here = detect().name
    if args.backend and args.backend != here:
        if args.ram is None:
            import psutil

            return Machine.simulate(psutil.virtual_memory().total, args.backend)
        return Machine.simulate(args.ram, args.backend)
    return Machine.detect(ram=args.ram)


def cmd_plan(args: argparse.Namespace) -> int:
    from .errors import EngineError
    from .planner import plan_model

    if getattr(args, "hosts", None):
        from .distributed.commands import cmd_plan_hosts

        return cmd_plan_hosts(args)
    try:
        plan = plan_model(
            args.model,
            machine_for(args),
            args.context,
            kv_mode=args.kv_mode,
            expert_budget=args.expert_budget,
            widths=args.widths,
        )
    except ValueError as e:  # a bad --ram / --widths / --expert-budget value
        if isinstance(e, EngineError):
            raise
        raise EngineError(str(e)) from e
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.summary())
    return 0


def cmd_sizes(args: argparse.Namespace) -> int:
    from .errors import EngineError
    from .quant.widths import RoleWidths
    from .sizes import sizes_for

    try:
        widths = RoleWidths.parse(args.widths) if args.widths else None
    except ValueError as e:
        raise EngineError(f"--widths: {e}") from e
    s = sizes_for(args.model, widths)
    print(json.dumps(s.to_dict(), indent=2) if args.json else format_sizes(s))
    return 0


def format_sizes(s) -> str:
    """The sizes as a table a person reads (every figure is in `--json`)."""
    from ..units import size

    def width(r) -> str:
        w = s.widths[r]
        return "float" if w.bits is None else f"{w.bits}-bit"

    rows = [
        f"{s.name} ({s.architecture}): {s.total_params / 1e9:.2f}B parameters, "
        f"{s.active_params / 1e9:.2f}B active a token",
        f"{'role':12s} {'width':>6s} {'parameters':>16s} {'bytes':>11s}",
    ]
    for r in s.params:
        if s.params[r]:
            rows.append(f"{r:12s} {width(r):>6s} {s.params[r]:16,d} {size(s.bytes[r], 2):>11s}")
    rows.append(f"{'total':12s} {'':6s} {s.total_params:16,d} {size(s.total_bytes, 2):>11s}")
    if s.moe_layers:
        rows.append(
            f"experts: {s.moe_layers} MoE layers x {s.experts_per_layer}, "
            f"{s.experts_per_token} a token, {size(s.bytes_per_expert)} each, "
            f"{size(s.expert_bytes, 2)} in all; always resident {size(s.resident_bytes, 2)}"
        )
    ctx = f", up to {s.max_context:,d} tokens" if s.max_context else ""
    rows.append(f"KV cache (fp16): {size(s.kv_bytes_per_token)} a token{ctx}")
    rows += [f"note: {n}" for n in s.notes]
    return "\n".join(rows)
