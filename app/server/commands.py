"""`rotaryquant serve`: the API over one model, in the foreground (on this machine, or split over
the machines of --hosts)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _resolve(model: str | None) -> str:
    """A folder, or the name of a model in the library; None: the embedded model."""
    from ..engine.errors import EngineError
    from ..engine.generate import DEFAULT_MODEL_REF
    from ..paths import models_dir

    if not model:
        return DEFAULT_MODEL_REF
    if Path(model).is_dir():
        return model
    if (models_dir() / model).is_dir():
        return str(models_dir() / model)
    raise EngineError(
        f"no model folder or library model named {model!r} (see `rotaryquant models`)"
    )


def cmd_serve(args) -> int:
    from ..engine.generate import Engine
    from .address import is_loopback
    from .run import ApiServer

    path = _resolve(args.model)
    if args.hosts:
        return _serve_hosts(args, path)
    options = {"plan": bool(args.plan)}
    if args.kv_mode != "auto":
        options["kv_mode"] = args.kv_mode

    def load():
        eng = Engine()
        eng.load(path, options)
        return eng

    if not is_loopback(args.host):
        print(f"warning: listening on {args.host}: other machines on the network can use "
              "this model" + ("" if args.api_key else " (no --api-key set)"), file=sys.stderr)  # fmt: skip
    srv = ApiServer(load, args.host, args.port, api_key=args.api_key, max_batch=args.max_batch,
                    context=args.context)  # fmt: skip
    print(f"serving on {srv.url} (loading the model…)", flush=True)
    try:
        srv.run()
    except KeyboardInterrupt:
        pass
    return 0


def _serve_hosts(args, path: str) -> int:
    """The model split over the machines of hosts.json (app/engine/distributed/serve.py)."""
    from ..engine.distributed.commands import cmd_serve_hosts
    from ..engine.generate import DEFAULT_MODEL_REF
    from .address import is_loopback

    if path == DEFAULT_MODEL_REF:
        from ..engine.embedded import ensure_default_model

        path = str(ensure_default_model())  # the same folder must exist on every host
    if not is_loopback(args.host):
        print(f"warning: rank 0 listens on {args.host}: other machines on the network can use "
              "this model" + ("" if args.api_key else " (no --api-key set)"), file=sys.stderr)  # fmt: skip
    return cmd_serve_hosts(args, path)


def add_commands(sub) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve", help="an OpenAI-compatible API (and Anthropic's /v1/messages) on this model"
    )
    p.add_argument("--model", help="model folder or library name (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument("--api-key", help="require this key (Authorization: Bearer KEY)")
    p.add_argument(
        "--kv-mode", default="auto", help="auto (the plan's, else fp16) | fp16 | isoquant3 ..."
    )
    p.add_argument("--plan", action="store_true", help="apply the auto-planner's choices")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--context", type=int, help="longest prompt + completion (default: the model's)")
    p.add_argument(
        "--hosts",
        help="hosts.json: split the model over these machines (mlx.launch; the first host "
        "serves the API, one request at a time; --plan applies the plan for the machines)",
    )
    p.add_argument(
        "--split",
        choices=("auto", "pipeline", "experts"),
        help="with --hosts: pipeline (layers per host), experts (each host a share of every MoE "
        "layer's experts) or auto (the planner's pick; default: hosts.json's `split`)",
    )
    p.set_defaults(func=cmd_serve)
