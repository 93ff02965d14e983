"""`rotaryquant plan MODEL --hosts hosts.json` and `rotaryquant chat --hosts hosts.json`: the
entry points app/cli.py and planner_commands.py hand over to when --hosts is given."""

from __future__ import annotations

import json
import subprocess

from ..errors import EngineError
from .hosts import load_hosts


def cmd_plan_hosts(args) -> int:
    from .plan import plan_hosts

    hosts = load_hosts(args.hosts)
    try:
        plan = plan_hosts(
            args.model,
            hosts,
            args.context,
            args.kv_mode,
            backend=args.backend or "metal",
            ram=args.ram,
        )
    except ValueError as e:
        if isinstance(e, EngineError):
            raise
        raise EngineError(str(e)) from e
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.summary())
    return 0


def rank_args(
    args, split: list[int] | None, budgets: list[int] | None, kv_mode: str = "fp16"
) -> list[str]:
    """The rank processes' arguments for a chat (every rank gets the same line)."""
    out = [
        str(args.model),
        "--chat",
        "--hosts",
        str(args.hosts),
        "--max-tokens",
        str(args.max_tokens),
        "--temp",
        str(args.temp),
        "--kv-mode",
        kv_mode if args.kv_mode == "auto" else args.kv_mode,
    ]
    if args.seed is not None:
        out += ["--seed", str(args.seed)]
    if split:
        out += ["--split", ",".join(map(str, split))]
    if budgets:
        out += ["--expert-budget", ",".join(str(b) for b in budgets)]
    return out


def cmd_chat_hosts(args) -> int:
    """Start one rank per host with mlx.launch; rank 0 reads this terminal (mlx.launch forwards
    stdin) and prints the answers. The model folder must be at the same path on every host."""
    from .launch import free_port_base, launch_argv
    from .plan import plan_hosts

    if not args.model:
        raise EngineError("--hosts needs --model: a folder present at the same path on every host")
    hosts = load_hosts(args.hosts)
    split = budgets = None
    kv_mode = "fp16"
    if args.plan:
        plan = plan_hosts(args.model, hosts)
        split = plan.split
        budgets = [s.expert_budget if s.paging else None for s in plan.stages]
        budgets = budgets if any(b is not None for b in budgets) else None
        kv_mode = plan.kv_modes.get("full", "fp16")
        print(plan.summary())
    # all ranks on this machine (a trial run): a free port, not mlx.launch's fixed default
    local = all(ip.startswith("127.") for h in hosts.hosts for ip in h.ips)
    argv = launch_argv(
        rank_args(args, split, budgets, kv_mode),
        hostfile=args.hosts,
        backend=hosts.backend,
        port=free_port_base(len(hosts)) if local else None,
    )
    return subprocess.call(argv)
