"""One rank's process, started by mlx.launch on each host (`rotaryquant chat --hosts` builds the
command): `python -m app.engine.distributed.rank MODEL [--chat | --check SPEC.json]`.

--chat   rank 0 reads one user message per line from stdin and prints the answer; every rank
         generates alongside (the prompt's ids are broadcast from rank 0).
--serve  rank 0 serves the OpenAI-compatible API on --host/--port, one request at a time;
         the other ranks follow it (serve.py; `rotaryquant serve --hosts` builds the command).
--check  runs the greedy generations listed in SPEC.json and writes each rank's tokens,
         log-probabilities and traffic to OUT/rank{r}.json (tests and benchmarks/distributed.py).

A lost host ends every other rank with `error: rank R (host): lost rank K on host H: …` on stderr
and exit status 3, within the step timeout at worst.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

EXIT_PEER_LOST = 3
EXIT_ERROR = 2


def run_greedy(model, prompt: list[int], cache: list, max_tokens: int, on_token=None):
    """Greedy tokens and each step's log-probabilities through mlx-lm's generate_step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    toks, lps = [], []
    for tok, lp in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache
    ):
        toks.append(int(tok))
        lps.append(lp)
        if on_token is not None:
            on_token(len(toks))
    return toks, lps


def message_seconds(group, n: int) -> float | None:
    """Median time of a one-element all_sum over the group (the link's latency, measured)."""
    import mlx.core as mx

    if n <= 0 or group.size() == 1:
        return None
    times = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _labels(hosts_path: str | None, size: int) -> list[str]:
    from .hosts import load_hosts, ring_labels

    if hosts_path:
        hosts = load_hosts(hosts_path)
        return [hosts.label(r) for r in range(size)]
    labels = ring_labels()
    return labels if len(labels) == size else [f"rank {r}" for r in range(size)]


def _check(engine, spec: dict, out: Path, watchdog) -> None:
    """Every run of `spec`: {"runs": [{"model", "kv_mode", "kv_window", "expert_budget",
    "split", "agree_each_token"}], "prompt": [ids], "max_tokens": n}."""
    import mlx.core as mx

    from ..generate import GenerationSettings

    rank = engine.group.rank()
    results = []
    probe = message_seconds(engine.group, spec.get("latency_probe", 0))
    for run in spec["runs"]:
        engine.load(
            run["model"],
            {
                "split": run.get("split"),
                "kv_mode": run.get("kv_mode"),
                "expert_budget": run.get("expert_budget"),
                "cpu_float_weights": run.get("cpu_float_weights", False),
            },
        )
        model = engine.loaded.model
        stage = model.rq_stage
        cache = engine.make_cache(
            GenerationSettings(kv_mode=run.get("kv_mode", "fp16"), kv_window=run.get("kv_window"))
        )
        sent0 = stage.traffic.sent
        first = {}  # time and bytes sent when the first token came out (decode starts)
        watchdog.arm()

        from .serve import Agreement

        # as serve.py's ranks do: the stop-or-go-on all_sum after every token
        agreement = Agreement(engine.group) if run.get("agree_each_token") else None

        def beat(i, first=first, stage=stage, agreement=agreement):
            watchdog.beat()
            if agreement is not None:
                agreement()
            if i == 1:
                first.update(t=time.perf_counter(), sent=stage.traffic.sent)
            print(f"rank {rank} token {i}", flush=True)

        t0 = time.perf_counter()
        toks, lps = run_greedy(model, spec["prompt"], cache, spec["max_tokens"], beat)
        t1 = time.perf_counter()
        watchdog.disarm()
        mx.eval(lps)
        results.append(
            {
                "tokens": toks,
                "logprobs": [lp.astype(mx.float32).tolist() for lp in lps]
                if spec.get("logprobs", True)
                else None,
                "bytes_sent": stage.traffic.sent - sent0,
                "decode_bytes": stage.traffic.sent - first["sent"],
                "decode_seconds": t1 - first["t"],
                "seconds": t1 - t0,
                "stage": stage.to_dict(),
                "weight_bytes": engine.info.weight_bytes,
                "kv_bytes": engine.cache_nbytes(engine.local_cache(cache)),
                "pager": model.rq_pager.stats() if hasattr(model, "rq_pager") else None,
            }
        )
    watchdog.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "runs": results, "message_seconds": probe})
    )


def _chat(engine, args, watchdog) -> None:
    from ..generate import Finished, GenerationSettings, TokenEvent
    from .engine import broadcast_ids

    group = engine.group
    root = group.rank() == 0
    settings = GenerationSettings(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        seed=args.seed if args.seed is not None else 0,
        kv_mode=args.kv_mode,
    )
    messages: list[dict] = []
    while True:
        ids = None
        if root:
            print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if line.strip() in ("", "/quit"):
                ids = None
            else:
                messages.append({"role": "user", "content": line.strip()})
                ids = engine.encode_chat(messages)
        ids = broadcast_ids(ids, group)
        if not ids:
            watchdog.close()
            return
        watchdog.arm()
        answer = ""
        for ev in engine.generate(ids, settings):
            watchdog.beat()
            if isinstance(ev, TokenEvent) and root:
                print(ev.text, end="", flush=True)
            elif isinstance(ev, Finished):
                answer = ev.text
                if root:
                    print(
                        f"\n[{ev.generated_tokens} tokens, {ev.decode_tps:.1f} tok/s]", flush=True
                    )
        watchdog.disarm()
        messages.append({"role": "assistant", "content": answer})


def _split(text: str | None) -> list[int] | str | None:
    """--split: "experts", "pipeline" (an even split) or layers per rank."""
    if not text or text == "pipeline":
        return None
    if text == "experts":
        return text
    from ..errors import EngineError

    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise EngineError(f"--split {text}: `experts`, `pipeline` or layers per rank") from None


def _budget(text: str | None, rank: int, parse_size) -> int | None:
    """--expert-budget: one size for every rank, or one per rank ("None" keeps all resident)."""
    if not text:
        return None
    parts = text.split(",")
    part = parts[rank] if len(parts) > 1 else parts[0]
    return None if part in ("", "None") else parse_size(part)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.engine.distributed.rank")
    p.add_argument("model")
    p.add_argument("--hosts", help="hosts.json (names the hosts in errors)")
    p.add_argument(
        "--split",
        help="layers per rank, rank 0 first, e.g. 20,28; or `experts`: every rank runs every "
        "layer with a share of each MoE layer's experts",
    )
    p.add_argument(
        "--expert-budget", help="routed-expert budget, e.g. 12GB, or one per rank: 12GB,None"
    )
    p.add_argument("--kv-mode", default="fp16")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--backend", default=os.environ.get("RQ_DIST_BACKEND", "ring"))
    p.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="seconds a step may take before this rank gives up on the others",
    )
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is present")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--chat", action="store_true")
    mode.add_argument("--serve", action="store_true")
    mode.add_argument("--check", help="SPEC.json of greedy runs (writes --out/rank{r}.json)")
    p.add_argument("--out", default=".")
    p.add_argument("--host", default="127.0.0.1", help="--serve: rank 0's address to listen on")
    p.add_argument("--port", type=int, default=8080, help="--serve: rank 0's port (0: any)")
    p.add_argument("--context", type=int, help="--serve: longest prompt + completion")
    p.add_argument(
        "--api-key-stdin",
        action="store_true",
        help="--serve: rank 0 reads the API key from the first line of stdin",
    )
    args = p.parse_args(argv)

    from ..errors import EngineError
    from .engine import StageEngine
    from .group import Peers, Watchdog, init_group, is_link_error, report

    peers = None
    if args.serve and os.environ.get("MLX_RANK", "0") != "0":
        # Ctrl+C reaches every local rank: rank 0 ends the session, the others follow it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.cpu:
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
    try:
        group = init_group(args.backend)
        peers = Peers(group, _labels(args.hosts, group.size()))
        watchdog = Watchdog(peers, args.step_timeout, EXIT_PEER_LOST)
        engine = StageEngine(group)
        if args.check:
            _check(engine, json.loads(Path(args.check).read_text()), Path(args.out), watchdog)
            return 0
        from ..planner import parse_size

        opts = {
            "kv_mode": args.kv_mode,
            "split": _split(args.split),
            "expert_budget": _budget(args.expert_budget, group.rank(), parse_size),
        }
        if args.serve:
            from .serve import follow, serve_root

            if group.rank() == 0:
                return serve_root(args, engine, opts, peers, watchdog)
            engine.load(args.model, opts)
            follow(engine, group, watchdog)
            return 0
        engine.load(args.model, opts)
        _chat(engine, args, watchdog)
        return 0
    except RuntimeError as e:
        if peers is None or not is_link_error(e):
            raise
        report(peers.failure(str(e)))
        time.sleep(1.0)  # the other survivors read their sockets before this one closes
        return EXIT_PEER_LOST
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
