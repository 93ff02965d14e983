"""`rotaryquant plan MODEL --hosts hosts.json`, `rotaryquant chat --hosts hosts.json` and
`rotaryquant serve --hosts hosts.json`: the entry points app/cli.py, planner_commands.py and
app/server/commands.py hand over to when --hosts is given."""

from __future__ import annotations

import json

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
            split=getattr(args, "split", None),
        )
    except ValueError as e:
        if isinstance(e, EngineError):
            raise
        raise EngineError(str(e)) from e
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.summary())
    return 0


def _split_arg(split: list[int] | str | None) -> list[str]:
    if not split:
        return []
    return ["--split", split if isinstance(split, str) else ",".join(map(str, split))]


def rank_args(
    args, split: list[int] | str | None, budgets: list[int] | None, kv_mode: str = "fp16"
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
    out += _split_arg(split)
    if budgets:
        out += ["--expert-budget", ",".join(str(b) for b in budgets)]
    return out


def _planned(model: str, hosts, use_plan: bool, split: str | None = None):
    """(split, budgets, kv_mode) for the ranks: the plan's with `use_plan` (`split`, else
    hosts.json's, else the planner's pick), else every expert resident and FP16 KV, split
    evenly by layers or, asked for, by experts."""
    split = split or hosts.split
    if not use_plan:
        return ("experts" if split == "experts" else None), None, "fp16"
    from .plan import plan_hosts

    plan = plan_hosts(model, hosts, split=split)
    budgets = [s.expert_budget if s.paging else None for s in plan.stages]
    print(plan.summary(), flush=True)
    return (
        plan.split,
        budgets if any(b is not None for b in budgets) else None,
        plan.kv_modes.get("full", "fp16"),
    )


def _local(hosts) -> bool:
    """Every rank on this machine (a trial run): ports must be free ones, not mlx.launch's
    fixed default."""
    return all(ip.startswith("127.") for h in hosts.hosts for ip in h.ips)


def serve_rank_args(
    model: str,
    hosts_path: str,
    *,
    host: str,
    port: int,
    kv_mode: str = "fp16",
    context: int | None = None,
    split: list[int] | str | None = None,
    budgets: list[int | None] | None = None,
    api_key: bool = False,
) -> list[str]:
    """The rank processes' arguments for `serve` (every rank gets the same line; only rank 0
    listens). The API key, if any, goes through stdin, not the command line."""
    out = [model, "--serve", "--hosts", str(hosts_path), "--kv-mode", kv_mode]
    out += ["--host", host, "--port", str(port)]
    if context:
        out += ["--context", str(context)]
    out += _split_arg(split)
    if budgets:
        out += ["--expert-budget", ",".join(str(b) for b in budgets)]
    if api_key:
        out.append("--api-key-stdin")
    return out


def cmd_serve_hosts(args, model: str) -> int:
    """`rotaryquant serve --hosts`: mlx.launch starts one rank per host; rank 0 (the first host)
    serves the API on --host/--port. `model`: a folder at the same path on every host."""
    from .launch import free_port_base, launch_argv, run_launch

    hosts = load_hosts(args.hosts)
    split, budgets, kv_mode = _planned(model, hosts, args.plan, getattr(args, "split", None))
    ranks = serve_rank_args(
        model,
        args.hosts,
        host=args.host,
        port=args.port,
        kv_mode=kv_mode if args.kv_mode == "auto" else args.kv_mode,
        context=args.context,
        split=split,
        budgets=budgets,
        api_key=bool(args.api_key),
    )
    argv = launch_argv(
        ranks,
        hostfile=args.hosts,
        backend=hosts.backend,
        port=free_port_base(len(hosts)) if _local(hosts) else None,
    )
    return run_launch(argv, stdin_text=f"{args.api_key}\n" if args.api_key else None)


def cmd_chat_hosts(args) -> int:
    """Start one rank per host with mlx.launch; rank 0 reads this terminal (mlx.launch forwards
    stdin) and prints the answers. The model folder must be at the same path on every host."""
    from .launch import free_port_base, launch_argv, run_launch

    if not args.model:
        raise EngineError("--hosts needs --model: a folder present at the same path on every host")
    hosts = load_hosts(args.hosts)
    split, budgets, kv_mode = _planned(args.model, hosts, args.plan, getattr(args, "split", None))
    argv = launch_argv(
        rank_args(args, split, budgets, kv_mode),
        hostfile=args.hosts,
        backend=hosts.backend,
        port=free_port_base(len(hosts)) if _local(hosts) else None,
    )
    return run_launch(argv, terminal=True)
