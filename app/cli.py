"""`rotaryquant` command line: headless chat, generation, models, benchmarks.

Other parts of the app add their own subcommands through `add_commands(subparsers)` in the
modules listed in COMMAND_MODULES.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .engine import kvcache
from .units import size

COMMAND_MODULES = (
    "app.engine.quant.commands",  # convert, inspect
    "app.engine.planner_commands",  # plan
    "app.downloads.commands",  # download, models, remove, verify
    "app.server.commands",  # serve
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("rotaryquant")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _setup_env() -> None:
    # Quiet tokenizers' fork warning; the engine never forks after loading.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _model_path(arg: str | None) -> str:
    from .engine.embedded import ensure_default_model

    if arg:
        return arg
    return str(ensure_default_model())


def _settings(args) -> dict:
    d = {"max_tokens": args.max_tokens, "temperature": args.temp, "kv_mode": args.kv_mode}
    if args.seed is not None:
        d["seed"] = args.seed
    return d


def _add_gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--kv-mode",
        default="auto",
        help="auto (the plan's, else fp16) | a KV mode: " + ", ".join(kvcache.names()),
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="apply the auto-planner's choices for this machine (paging, KV mode)",
    )
    p.add_argument("--expert-budget", help="page routed experts within this many bytes, e.g. 4GB")


def _load_options(args) -> dict:
    opts = {"plan": bool(getattr(args, "plan", False))}
    if getattr(args, "expert_budget", None):
        from .engine.planner import parse_size

        opts["expert_budget"] = parse_size(args.expert_budget)
    if getattr(args, "kv_mode", "auto") != "auto":
        opts["kv_mode"] = args.kv_mode
    return opts


def cmd_prepare_default(args) -> int:
    from .engine.embedded import ensure_default_model

    print(ensure_default_model(force=args.force))
    return 0


def cmd_generate(args) -> int:
    prompt = [{"role": "user", "content": args.prompt}] if not args.raw else args.prompt
    settings = _settings(args)
    if args.worker:
        from .engine import messages as M
        from .engine.worker import WorkerClient

        with WorkerClient() as c:
            c.load(_model_path(args.model), _load_options(args))
            done = None
            for m in c.generate(prompt, settings):
                if isinstance(m, M.Token):
                    print(m.text, end="", flush=True)
                elif isinstance(m, M.Done):
                    done = m
        print()
        if args.verbose and done:
            print(
                f"[{done.prompt_tokens} prompt tokens at {done.prompt_tps:.1f} tok/s, "
                f"{done.generated_tokens} generated at {done.decode_tps:.1f} tok/s, "
                f"peak {done.peak_memory / 2**20:.0f} MiB]",
                file=sys.stderr,
            )
        return 0
    from .engine.generate import Engine, Finished, GenerationSettings, TokenEvent

    eng = Engine()
    eng.load(_model_path(args.model), _load_options(args))
    fin = None
    for ev in eng.generate(prompt, GenerationSettings.from_dict(settings)):
        if isinstance(ev, TokenEvent):
            print(ev.text, end="", flush=True)
        elif isinstance(ev, Finished):
            fin = ev
    print()
    if args.verbose and fin:
        print(
            f"[{fin.prompt_tokens} prompt tokens at {fin.prompt_tps:.1f} tok/s, "
            f"{fin.generated_tokens} generated at {fin.decode_tps:.1f} tok/s, "
            f"peak {fin.peak_memory / 2**20:.0f} MiB, KV {fin.kv_bytes / 2**20:.1f} MiB]",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args) -> int:
    if getattr(args, "hosts", None):
        from .engine.distributed.commands import cmd_chat_hosts

        return cmd_chat_hosts(args)
    from .engine import messages as M
    from .engine.worker import WorkerClient

    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    with WorkerClient() as c:
        info = c.load(_model_path(args.model), _load_options(args))
        print(
            f"{info['name']} ({info['architecture']}, {info['backend']}). "
            "Empty line or /quit to leave, /reset to forget the conversation."
        )
        while True:
            try:
                line = input("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if line in ("", "/quit", "/exit"):
                return 0
            if line == "/reset":
                history = history[:1] if args.system else []
                continue
            history.append({"role": "user", "content": line})
            rid_text = []
            try:
                for m in c.generate(history, _settings(args)):
                    if isinstance(m, M.Token):
                        print(m.text, end="", flush=True)
                        rid_text.append(m.text)
            except KeyboardInterrupt:
                pass  # leave what was generated so far
            print()
            history.append({"role": "assistant", "content": "".join(rid_text)})


def cmd_models(args) -> int:
    from .engine.manifest import Manifest
    from .paths import models_dir

    rows = []
    for d in sorted(p for p in models_dir().iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            m = Manifest.load(d)
        except Exception as e:  # a damaged folder is listed, not fatal
            rows.append((d.name, "broken", str(e)))
            continue
        rows.append(
            (d.name, m.architecture if m else "?", f"{(m.total_bytes if m else 0) / 2**20:.0f} MiB")
        )
    for r in rows:
        print("\t".join(r))
    return 0


def cmd_bench(args) -> int:
    from .engine.bench import bench_generate, machine
    from .engine.generate import Engine

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    say("loading the model…")
    eng = Engine()
    info = eng.load(_model_path(args.model), _load_options(args))

    def progress(i: int, n: int) -> None:
        say(
            f"warm-up run ({args.prompt_tokens} prompt tokens, {args.gen_tokens} generated)…"
            if i == 0
            else f"trial {i} of {n}…"
        )

    res = bench_generate(
        eng, args.prompt_tokens, args.gen_tokens, args.trials, args.kv_mode, progress
    )
    res = {"model": info.name, "machine": machine(), **res}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(bench_text(res))
    return 0


def bench_text(res: dict) -> str:
    """`rotaryquant bench`'s table; a paged model adds its hit rate, SSD reads and ms per
    token by part (the last trial's)."""
    m = res["machine"]
    lines = [
        f"{res['model']} on {m['device']} ({m['backend']}), KV {res['kv_mode']}, "
        f"median of {res['trials']} trials"
    ]
    rows = [
        ("prompt", f"{res['prompt_tokens']} tokens", f"{res['prompt_tps']:.1f} tok/s"),
        ("decode", f"{res['generated_tokens']:g} tokens", f"{res['decode_tps']:.1f} tok/s"),
        ("peak memory", "", size(res["peak_memory_bytes"], 2)),
        ("KV cache", "", size(res["kv_bytes"], 2)),
    ]
    p = res.get("pager")
    if p:
        hit = "—" if p.get("hit_rate") is None else f"{p['hit_rate']:.1%}"
        rows.append(("expert hits", "", hit))
        if p.get("MB_read_per_token") is not None:
            via = {
                "pinned": "page-locked files",
                "zero_copy": "into slots",
                "device_route": "by the GPU",
                "device_route_reference": "device step",
            }.get(p.get("read_path"), p.get("read_path") or "")
            rows.append(("SSD reads", via, f"{p['MB_read_per_token']:.1f} MB/token"))
        if p.get("read_MBps"):
            rows.append(("", "", f"{p['read_MBps']:.0f} MB/s"))
    lines += [f"  {name:12s} {n:>12s} {v:>12s}" for name, n, v in rows]
    ms = p.get("ms_per_token") if p else None
    if ms and p.get("read_path") == "device_route":
        lines.append(
            "  paging: misses resolved and copied on the GPU inside the step (no read-backs)"
        )
    elif ms:
        lines.append(
            f"  paging ms/token: reads {ms['reads']:.1f} · read-backs {ms['readbacks']:.1f} · "
            f"pager {ms['pager_host']:.1f} · rest {ms['rest']:.1f} (of {ms['total']:.1f})"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rotaryquant", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for mod in COMMAND_MODULES:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue  # that part of the app is not in this build
            raise
        m.add_commands(sub)

    def add(name, fn, help):
        if name in sub.choices:
            return None  # a feature module provides a richer version
        sp = sub.add_parser(name, help=help)
        sp.set_defaults(func=fn)
        return sp

    sp = add("generate", cmd_generate, "generate a reply to one prompt")
    if sp:
        sp.add_argument("prompt")
        _add_gen_args(sp)
        sp.add_argument("--raw", action="store_true", help="no chat template")
        sp.add_argument("--worker", action="store_true", help="run the engine in a worker process")
        sp.add_argument("-v", "--verbose", action="store_true", help="print speed and memory")
    sp = add("chat", cmd_chat, "interactive chat with streaming")
    if sp:
        _add_gen_args(sp)
        sp.add_argument("--system", help="system prompt")
        sp.add_argument(
            "--hosts",
            help="hosts.json: run the model split over these machines "
            "(mlx.launch's hostfile; see docs/distributed.md)",
        )
        sp.add_argument(
            "--split",
            choices=("auto", "pipeline", "experts"),
            help="with --hosts: pipeline (layers per host), experts (each host a share of every MoE "
            "layer's experts) or auto (the planner's pick; default: hosts.json's `split`)",
        )
    add("models", cmd_models, "list local models")
    sp = add("bench", cmd_bench, "prompt/decode tok/s and peak memory")
    if sp:
        _add_gen_args(sp)
        sp.add_argument("--json", action="store_true", help="print the result as JSON")
        sp.add_argument("--prompt-tokens", type=int, default=256)
        sp.add_argument("--gen-tokens", type=int, default=64)
        sp.add_argument("--trials", type=int, default=3)
    sp = add("prepare-default", cmd_prepare_default, "convert the embedded model (once)")
    if sp:
        sp.add_argument("--force", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    _setup_env()
    args = build_parser().parse_args(argv)
    from .engine.errors import EngineError

    try:
        return int(args.func(args) or 0)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
