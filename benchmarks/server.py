"""Aggregate decode tok/s of `rotaryquant serve` against `mlx_lm.server` on the same model, with
1 / 4 / 8 concurrent clients, side by side in one run.

    python benchmarks/server.py                 # here: the embedded SmolLM2-135M, fp16 + isoquant3
    python benchmarks/server.py --qwen3         # Qwen3-30B-A3B shapes, random weights (4-bit), fp16 + isoquant3
    python benchmarks/server.py --qwen3 --small # the same code path at toy sizes (CPU check)

Each client sends one chat completion (greedy, `--tokens` at most) at the same moment; the
aggregate is all completion tokens (the servers' usage counts) over the wall time from the
first request to the last answer. mlx_lm.server runs as its own process with
--decode-concurrency / --prompt-concurrency at the largest client count (its continuous
batching, as ours) and no prompt cache (each request is new to both); it has no IsoQuant, so each isoquant3 row is compared with its fp16 figure.
Writes benchmarks/results/server.json ({"runs": [...]}, the issue's schema) unless --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

TOPICS = ["a lighthouse", "the sea", "a lost key", "the moon", "a small robot", "winter",
          "a train", "an old map"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer bench"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def measure(base: str, model: str, clients: int, tokens: int, ctx: str = "") -> dict:
    """One round: `clients` requests at once; aggregate completion tok/s."""
    results: list[int] = [0] * clients
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def one(i: int) -> None:
        body = {"model": model, "max_tokens": tokens, "temperature": 0.0,
                "messages": [{"role": "user", "content": f"{ctx}Write a long story about {TOPICS[i % 8]}."}]}  # fmt: skip
        try:
            start.wait()
            results[i] = int(_post(base + "/chat/completions", body)["usage"]["completion_tokens"])
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]!r}")
    return {"tokens": sum(results), "seconds": wall, "tps": sum(results) / wall}


def warm(base: str, model: str, ctx: str) -> None:
    measure(base, model, 1, 8, ctx)  # kernels, caches, the first compile


def wait_up(base: str, proc: subprocess.Popen | None, timeout: float = 900) -> None:
    """Wait for a server's /v1/models to answer 200 (mlx_lm.server answers 200 and then fails
    to list models outside a hub cache, so only the status is read)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{base} did not come up in {timeout:.0f} s")


def first_model(base: str) -> str:
    with urllib.request.urlopen(base + "/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


class Server:
    """A server in its own process (both are: neither shares the clients' interpreter)."""

    def __init__(self, argv: list[str], name: str, model: str = ""):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.name = name
        path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]  # keep the caller's
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.proc = subprocess.Popen([sys.executable, *argv, "--port", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        self.model = model  # "" = the first the server lists

    def wait(self) -> Server:
        wait_up(self.base, self.proc)
        self.model = self.model or first_model(self.base)
        return self

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ours(folder: str, kv_mode: str, max_batch: int) -> Server:
    argv = ["-c", "import sys; from app.cli import main; sys.exit(main())", "serve",
            "--model", folder, "--kv-mode", kv_mode, "--max-batch", str(max_batch)]  # fmt: skip
    return Server(argv, f"ours {kv_mode}")


def mlx_lm_server(folder: str, tokens: int, max_batch: int) -> Server:
    """mlx_lm.server batching up to the largest client count (as ours), no prompt cache."""
    n = str(max_batch)
    argv = ["-m", "mlx_lm.server", "--model", folder, "--decode-concurrency", n,
            "--prompt-concurrency", n, "--max-tokens", str(tokens), "--prompt-cache-size", "0",
            "--log-level", "WARNING"]  # fmt: skip
    return Server(argv, "mlx_lm.server", model="default_model")


def compare(a: Server, b: Server, clients: list[int], tokens: int, rounds: int, ctx: str):
    """Rounds alternate between the two servers (a, b, a, b, ...) at each client count, so a
    change in the machine's load falls on both; returns {clients: (a's runs, b's runs)}.
    Each client count starts with one unmeasured round on each server: the first batch of a
    new size compiles kernels for its shapes (on a GPU, seconds), and the server that meets a
    shape first would pay for both, since compiled kernels are cached on disk."""
    for s in (a, b):
        warm(s.base, s.model, ctx)
    out = {}
    for c in clients:
        for s in (a, b):
            measure(s.base, s.model, c, tokens, ctx)
        ra, rb = [], []
        for _ in range(rounds):
            ra.append(measure(a.base, a.model, c, tokens, ctx))
            rb.append(measure(b.base, b.model, c, tokens, ctx))
        out[c] = (ra, rb)
        print(f"  clients={c}: {a.name} {median(ra):8.1f} tok/s, {b.name} {median(rb):8.1f} tok/s "
              f"(medians of {rounds})", flush=True)  # fmt: skip
    return out


def median(runs: list[dict]) -> float:
    return statistics.median(r["tps"] for r in runs)


def qwen3_config(small: bool, layers: int | None) -> dict:
    cfg = json.loads((ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b.json").read_text())
    if small:  # the same architecture at toy sizes: checks the code path on a CPU
        cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                   num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=1000)  # fmt: skip
    if layers:
        cfg["num_hidden_layers"] = layers
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    # random weights sample random ids: end-of-sequence is the last id, so it is never the
    # favourite of the tiny tokenizer's ids and completions run to max_tokens
    cfg["eos_token_id"] = cfg["vocab_size"] - 1
    cfg["bos_token_id"] = None
    return cfg


def build_qwen3(folder: Path, small: bool, layers: int | None) -> dict:
    """Random Qwen3-30B-A3B-shaped weights, 4-bit (mlx-lm's format, which both servers load),
    with the app's tiny in-process tokenizer. Built once per folder."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    from app.engine.testing.random_models import _randomize, write_tiny_tokenizer

    cfg = qwen3_config(small, layers)
    if (folder / "config.json").exists():
        return cfg
    t0 = time.perf_counter()
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    _randomize(model, seed=0, scale=0.02)
    model, cfg = quantize_model(model, cfg, 64, 4)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(dict(cfg), folder / "config.json")
    write_tiny_tokenizer(folder)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    print(
        f"built {folder} in {time.perf_counter() - t0:.0f} s "
        f"(tokenizer eos {tok_cfg.get('eos_token')!r})",
        flush=True,
    )
    del model
    mx.clear_cache()
    return cfg


def float_copy(src: str, folder: Path) -> str:
    """The model with its dense layers in float32, as our engine runs them on a CPU
    (app/engine/cpu_weights.py): served by both, so the CPU rows compare servers, not MLX's slow
    CPU quantized matmul. Built once."""
    import shutil

    from mlx_lm.utils import load, save_config, save_model

    from app.engine.cpu_weights import dequantize_dense

    if not (folder / "config.json").exists():
        model, _ = load(src)
        dequantize_dense(model)
        folder.mkdir(parents=True, exist_ok=True)
        save_model(folder, model)
        cfg = json.loads((Path(src) / "config.json").read_text())
        cfg.pop("quantization", None)
        cfg.pop("quantization_config", None)
        save_config(cfg, folder / "config.json")
        for f in Path(src).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
                shutil.copy(f, folder / f.name)
    return str(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen3", action="store_true", help="Qwen3-30B-A3B shapes, random weights")
    ap.add_argument("--small", action="store_true", help="toy sizes of the --qwen3 model")
    ap.add_argument("--layers", type=int, help="--qwen3: fewer layers than the model's 48")
    ap.add_argument("--workdir", default="/tmp/rq-bench-server", help="where --qwen3 builds it")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--kv-modes", default="fp16,isoquant3")
    ap.add_argument("--tokens", type=int, help="max completion tokens per client")
    ap.add_argument("--context-words", type=int,
                    help="filler words before each question, so the KV holds compressed tokens "
                         "(default 0 here, 400 with --qwen3)")  # fmt: skip
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds per point (the median is kept)"
    )
    ap.add_argument("--out", help="JSON path (default benchmarks/results/server.json)")
    ap.add_argument("--include", help="a JSON this script wrote on another machine: its runs "
                                      "are kept beside this run's (e.g. the H200's)")  # fmt: skip
    args = ap.parse_args()

    from record import header, write_result

    from app.engine.bench import machine as describe

    clients = [int(c) for c in args.clients.split(",")]
    if args.qwen3:
        name = "qwen3-30b-a3b-shapes-random-4bit" + ("-small" if args.small else "")
        if args.layers:
            name += f"-{args.layers}layers"
        folder = Path(args.workdir) / name
        build_qwen3(folder, args.small, args.layers)
        folder = str(folder)
        tokens = args.tokens or 128
    else:
        from app.engine.embedded import ensure_default_model

        folder, name = str(ensure_default_model()), "SmolLM2-135M-Instruct (embedded)"
        from app.engine.backend import detect

        if detect().name == "cpu":
            folder = float_copy(folder, Path(args.workdir) / "smollm2-135m-float32")
            name += ", dense layers float32 for both servers"
        tokens = args.tokens or 64
    words = args.context_words if args.context_words is not None else (400 if args.qwen3 else 0)
    filler = "The quick brown fox jumps over the lazy dog. "
    ctx = (filler * (words // 9 + 1)).split(" ")[:words]
    ctx = " ".join(ctx) + "\n\n" if words else ""
    m = describe()
    machine = f"{m['backend']}: {m['device']}"
    print(
        f"{name} on {machine}; clients {clients}, {tokens} tokens each after a {words}-word filler",
        flush=True,
    )

    def save(runs: list[dict]) -> None:
        """Written after each KV mode, so a run cut short keeps what it measured."""
        payload = {"runs": list(runs), "tokens_per_client": tokens, "rounds": args.rounds,
                   "context_words": words,
                   "load_average_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                   "method": "each client one greedy chat completion, all sent at once; aggregate = "
                             "completion tokens (usage) / wall time; both servers in their own "
                             "processes, rounds alternating between them, medians; mlx_lm.server "
                             "with --decode-concurrency/--prompt-concurrency = the largest client "
                             "count, no prompt cache"}  # fmt: skip
        if args.include:
            other = json.loads(Path(args.include).read_text())
            payload["runs"] += [r for r in other["runs"] if r["machine"] != machine]
            payload["other_runs"] = {k: other[k] for k in ("machine", "date", "commit", "tokens_per_client",
                                                            "context_words") if k in other}  # fmt: skip
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({**header(m), **payload}, indent=2) + "\n")
            print(f"wrote {args.out}")
        else:
            write_result("server", payload, machine=m)

    load_before = os.getloadavg()[0]  # a shared machine: the figures are ratios at best
    top = max(clients)
    theirs = mlx_lm_server(folder, tokens, top)
    runs = []
    try:
        theirs.wait()
        for mode in args.kv_modes.split(","):
            mine = ours(folder, mode, top)
            try:
                res = compare(mine.wait(), theirs, clients, tokens, args.rounds, ctx)
            finally:
                mine.stop()
            for c in clients:
                ra, rb = res[c]
                runs.append({"machine": machine, "model": name, "kv_mode": mode, "clients": c,
                             "ours_tps": round(median(ra), 2),
                             "mlx_lm_server_tps": round(median(rb), 2),
                             "ours_rounds": [round(r["tps"], 2) for r in ra],
                             "mlx_lm_server_rounds": [round(r["tps"], 2) for r in rb],
                             "ours_tokens": ra[0]["tokens"], "mlx_lm_server_tokens": rb[0]["tokens"]})  # fmt: skip
            save(runs)
    finally:
        theirs.stop()

    print(
        "\n| kv_mode | clients | ours tok/s | mlx_lm.server tok/s (fp16) | ratio | vs our 1 client |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs:
        one = next(
            x["ours_tps"]
            for x in runs
            if x["kv_mode"] == r["kv_mode"] and x["clients"] == clients[0]
        )
        print(f"| {r['kv_mode']} | {r['clients']} | {r['ours_tps']:.1f} | {r['mlx_lm_server_tps']:.1f} "
              f"| {r['ours_tps'] / max(r['mlx_lm_server_tps'], 1e-9):.2f}x | {r['ours_tps'] / max(one, 1e-9):.2f}x |")  # fmt: skip
    save(runs)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
