"""A server's batch step by step: 8 prompts at once through mlx-lm's BatchGenerator (as the
server's batcher drives it), fp16 against isoquant3, and through ZipFusion's scheduler (as the
batcher drives it for that mode), on the --qwen3 model of server.py.

    python benchmarks/batch_steps.py            # Qwen3-30B-A3B shapes, random 4-bit weights
    python benchmarks/batch_steps.py --small    # the same code path at toy sizes (CPU check)

Per round and mode: the time to the first token of the batch (the prompts' prefill), the decode
steps' median, mean and slowest (each `next()` that returned tokens after the first), and the
aggregate tok/s. IsoQuant caches compress every 16 tokens: the steps in which the batch cache
compressed are also reported apart (their median, and the host time of the compressions
themselves, all layers), so what a compression costs the batch stands out of the median. The
first compression after the prompts takes all their tokens past the window and is left out of
those figures. ZipFusion's steps that compressed pages are reported apart the same way, and
its commit's time a step (writing the step's K/V into the pool, compressing the pages that
filled) with the commit's own host time. Modes alternate per round. Writes
benchmarks/results/batch_steps.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

MODES = ("fp16", "isoquant3", "zipfusion")


class _Compressions:
    """Counts the batch caches' compressions and their host time (the patched method's own)."""

    def __init__(self):
        from app.engine.kvcache.isoquant.batch import BatchIsoQuantKVCache

        self.calls, self.seconds = 0, 0.0
        self.cls, self.orig = BatchIsoQuantKVCache, BatchIsoQuantKVCache._compress

        def timed(cache, k):
            t = time.perf_counter()
            self.orig(cache, k)
            self.seconds += time.perf_counter() - t
            self.calls += 1

        self.cls._compress = timed

    def take(self) -> tuple[int, float]:
        out = (self.calls, self.seconds)
        self.calls, self.seconds = 0, 0.0
        return out


class _Commits:
    """Times ZipFusion's `commit` per step: its wall time, and its host time (the wall less the
    evaluations and synchronizations inside it, which wait for the device)."""

    def __init__(self):
        import mlx.core as mx

        from app.engine.kvcache.zipfusion.store import ZipStore

        self.wall, self.host, waits = [], [], [0.0]
        orig, ev, sync = ZipStore.commit, mx.eval, mx.synchronize

        def waiting(fn):
            def run(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    waits[0] += time.perf_counter() - t

            return run

        def timed(store):
            waits[0] = 0.0
            mx.eval, mx.synchronize = waiting(ev), waiting(sync)
            t = time.perf_counter()
            try:
                orig(store)
            finally:
                mx.eval, mx.synchronize = ev, sync
            self.wall.append(time.perf_counter() - t)
            self.host.append(self.wall[-1] - waits[0])

        ZipStore.commit = timed

    def take(self) -> tuple[list[float], list[float]]:
        out = (self.wall, self.host)
        self.wall, self.host = [], []
        return out


def _prompts(rows: int, prompt: int) -> list[list[int]]:
    # rows 3 tokens apart in length: their code counts differ, as real clients' do
    return [[(i * 31 + j * 7 + 1) % 900 for j in range(prompt + 3 * i)] for i in range(rows)]


def _summary(mode, first, total, n, steps, comp, comp_host) -> dict:
    ms = sorted(1e3 * s for s in steps)
    med = lambda v: round(1e3 * statistics.median(v), 2) if v else None  # noqa: E731
    return {
        "mode": mode, "first_token_s": round(first, 3), "total_s": round(total, 3), "tokens": n,
        "tps": round(n / total, 2), "step_ms_median": round(statistics.median(ms), 2),
        "step_ms_mean": round(statistics.mean(ms), 2), "slowest_steps_ms": [round(x, 1) for x in ms[-8:]],
        "compressing_steps": len(comp), "compressing_step_ms_median": med(comp),
        "compression_host_ms_median": med(comp_host),
    }  # fmt: skip


def one_zip(model, rows: int, prompt: int, tokens: int, commits: _Commits) -> dict:
    """The batch through ZipFusion's scheduler with the server's settings (prefill chunks of
    512, growth horizon 512): the first step prefills every row (one at a time) and decodes once;
    the first token's time is that step less its decode."""
    from app.engine.kvcache import zipfusion as zf
    from app.server.batcher import PREFILL_STEP, ZIP_HORIZON

    prompts = _prompts(rows, prompt)
    longest = max(map(len, prompts)) + 64 + tokens
    # a pool that holds every row, as the server's (sized for its whole context) does
    sched = zf.make_scheduler(model, rows, longest, zf.raw_budget(model, rows * longest),
                              prefill_step=PREFILL_STEP, growth_horizon=ZIP_HORIZON)  # fmt: skip
    commits.take()
    t0 = time.perf_counter()
    for p in prompts:
        sched.submit(zf.Request(p, tokens))
    first, n, steps, comp, seen, commit_wall, commit_host = None, 0, [], [], 0, [], []
    st = sched.store.stats
    while sched.waiting or sched.running:
        pages = st["pages_compressed"]
        rep = sched.step()
        n += sum(len(t) for t in rep.tokens.values())
        wall, host = commits.take()
        if first is None:
            first = time.perf_counter() - t0 - rep.decode_s
        elif rep.batch:
            commit_wall.append(wall[-1])
            commit_host.append(host[-1])
            steps.append(rep.decode_s)
            compressed = st["pages_compressed"] > pages
            seen += compressed
            if compressed and seen > 1:
                comp.append(rep.decode_s)
    total = time.perf_counter() - t0
    ms = lambda v: round(1e3 * statistics.median(v), 2)  # noqa: E731
    return {**_summary("zipfusion", first, total, n, steps, comp, []),
            "commit_ms_median": ms(commit_wall), "commit_host_ms_median": ms(commit_host)}  # fmt: skip


def one(model, mode: str, rows: int, prompt: int, tokens: int, counters: tuple) -> dict:
    """counters: (_Compressions, _Commits), made once (each patches a method)."""
    from mlx_lm.generate import BatchGenerator

    from app.engine import kvcache

    counter, commits = counters
    if mode == "zipfusion":
        return one_zip(model, rows, prompt, tokens, commits)
    gen = BatchGenerator(model, stop_tokens=[[10**9]], completion_batch_size=rows,
                         prefill_batch_size=rows, prefill_step_size=512)  # fmt: skip
    prompts = _prompts(rows, prompt)
    caches = [kvcache.make_cache(model, mode, max_tokens=prompt + 64 + tokens) for _ in prompts]
    t0 = time.perf_counter()
    gen.insert(prompts, [tokens] * rows, caches=caches)
    first, n, live, steps, comp, comp_host, seen = None, 0, rows, [], [], [], 0
    counter.take()
    while live:
        ts = time.perf_counter()
        _, out = gen.next()
        dt = time.perf_counter() - ts
        calls, host = counter.take()
        for r in out:
            n += 1
            live -= r.finish_reason is not None
        if out and first is None:
            first = time.perf_counter() - t0
        elif out:
            steps.append(dt)
            seen += calls > 0
            if calls and seen > 1:  # not the prompts' own first compression
                comp.append(dt)
                comp_host.append(host)
    total = time.perf_counter() - t0
    gen.close()
    return _summary(mode, first, total, n, steps, comp, comp_host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="toy sizes of the --qwen3 model")
    ap.add_argument("--workdir", default="/tmp/rq-bench-server", help="where the model is built")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=530, help="prompt tokens of the first row")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens per row")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args()
    modes = tuple(a.modes.split(","))

    from mlx_lm import load
    from record import write_result
    from server import build_qwen3

    name = "qwen3-30b-a3b-shapes-random-4bit" + ("-small" if a.small else "")
    folder = Path(a.workdir) / name
    build_qwen3(folder, a.small, None)
    model, _ = load(str(folder))
    counters = (_Compressions(), _Commits())
    for mode in modes:  # kernels and compiled graphs for these shapes, untimed
        one(model, mode, a.rows, a.prompt, 16, counters)
    runs = []
    for r in range(a.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            x = {**one(model, mode, a.rows, a.prompt, a.tokens, counters), "round": r}
            runs.append(x)
            print(f"round {r} {mode:10s} first token {x['first_token_s']:6.2f} s  step median "
                  f"{x['step_ms_median']:7.2f} ms  mean {x['step_ms_mean']:7.2f}  slowest "
                  f"{x['slowest_steps_ms']}  {x['tps']:7.1f} tok/s", flush=True)  # fmt: skip
            if "commit_ms_median" in x:
                print(f"    commit {x['commit_ms_median']} ms a step, of which host time "
                      f"{x['commit_host_ms_median']} ms", flush=True)  # fmt: skip
            if x["compressing_steps"]:
                print(f"    {x['compressing_steps']} compressing steps: median "
                      f"{x['compressing_step_ms_median']} ms, the compressions' host time "
                      f"{x['compression_host_ms_median']} ms", flush=True)  # fmt: skip
    med = {m: statistics.median(x["tps"] for x in runs if x["mode"] == m) for m in modes}
    print("\nmedian tok/s: " + ", ".join(f"{m} {v:.1f}" for m, v in med.items()))
    write_result("batch_steps", {
        "model": name, "rows": a.rows, "prompt_tokens": f"{a.prompt} + 3 per row",
        "decode_tokens": a.tokens, "runs": runs, "median_tps": med,
    })  # fmt: skip


if __name__ == "__main__":
    main()
