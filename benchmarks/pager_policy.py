"""Cache policy by measurement: LRU vs segmented LRU (frequency-aware) vs leaning on the OS
page cache, on trace and uniform random routing, at 10 / 25 / 50% of experts resident.

Hit rates come from the pure-Python simulation (app.engine.offload.policy) of Nemotron 3
Super's routing shape (512 experts, 22 a token; 8 MoE layers sharing one pool like the
pager's); tok/s from the expected step time with the per-record costs measured by
benchmarks/pager_speed.py in its current JSON (this machine's rows: compute + read-backs +
host of the resident-equivalent step, read GB/s of misses, the warm pread bound as the copy
speed out of the page cache), so the policies are compared at the costs this machine has.

    python benchmarks/pager_policy.py          # -> benchmarks/results/pager_policy.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LAYERS, EXPERTS, K, STEPS, WARMUP = 8, 512, 22, 400, 150
RECORD = 1720320  # Super's 2-bit fc1 + fc2 record


def measured_costs() -> dict:
    """Per-token base (compute + host + read-backs) and read speeds from pager_speed.json's
    CPU rows (records of Super's size)."""
    from record import RESULTS

    runs = json.loads((RESULTS / "pager_speed.json").read_text())["runs"]
    rows = [
        r
        for r in runs
        if r["model"].endswith("-records")
        and r["cache"] == "warm"
        and r.get("variant", "current") == "current"
    ]
    if not rows:
        raise SystemExit("run benchmarks/pager_speed.py first (its CPU rows)")
    base = (
        min(
            r["ms_per_token"]["compute"]
            + r["ms_per_token"]["host"]
            + r["ms_per_token"]["readbacks"]
            for r in rows
        )
        / 1000
    )
    read = max(r["read_GBps"] for r in rows if r["read_GBps"]) * 1e9
    cold = [r for r in runs if r["model"].endswith("-records") and r["cache"] == "cold"]
    disk = max(r["read_GBps"] for r in cold) * 1e9 if cold else read / 4
    copy = max(r["pread_bound_GBps"] for r in rows) * 1e9
    return {
        "base_s": base,
        "warm_read_Bps": read,
        "disk_Bps": disk,
        "copy_Bps": copy,
        "machine": rows[0]["machine"],
        "layers_measured": rows[0].get("layers"),
    }


def main():
    import numpy as np
    from record import write_result

    from app.engine.offload.policy import POLICIES, simulate, token_seconds
    from app.engine.offload.trace import model_traces

    costs = measured_costs()
    rng = np.random.default_rng(0)
    traces = {
        "trace": model_traces(list(range(LAYERS)), EXPERTS, K, STEPS),
        "random": {
            x: np.stack([rng.choice(EXPERTS, K, replace=False) for _ in range(STEPS)])
            for x in range(LAYERS)
        },
    }
    # base scaled from the measured layers to these: the step's non-read part per layer
    base = costs["base_s"] * LAYERS / (costs["layers_measured"] or LAYERS)
    rows = []
    t0 = time.perf_counter()
    for routing, tr in traces.items():
        for frac in (0.1, 0.25, 0.5):
            slots = int(frac * LAYERS * EXPERTS)
            for pol in POLICIES:
                r = simulate(pol, tr, slots, warmup=WARMUP)
                warm = token_seconds(r, base, RECORD, costs["warm_read_Bps"], costs["copy_Bps"])
                cold = token_seconds(r, base, RECORD, costs["disk_Bps"], costs["copy_Bps"])
                rows.append(
                    {
                        "routing": routing,
                        "budget_fraction": frac,
                        "policy": pol,
                        "hit_rate": r.hit_rate,
                        "misses_per_token": r.misses_per_token,
                        "copies_per_token": r.copies_per_token,
                        "expected_tps_warm": 1 / warm,
                        "expected_tps_cold": 1 / cold,
                    }
                )
    print(
        f"{'routing':7} {'budget':>6} {'policy':5} {'hit':>6} {'tok/s warm':>10} {'tok/s cold':>10}"
    )
    for r in rows:
        print(
            f"{r['routing']:7} {r['budget_fraction']:>6.0%} {r['policy']:5} "
            f"{r['hit_rate']:>6.1%} {r['expected_tps_warm']:>10.2f} "
            f"{r['expected_tps_cold']:>10.2f}"
        )
    best = {}
    for r in rows:
        k = (r["routing"], r["budget_fraction"])
        if k not in best or r["expected_tps_cold"] > best[k]["expected_tps_cold"]:
            best[k] = r
    write_result(
        "pager_policy",
        {
            "settings": {
                "layers": LAYERS,
                "experts": EXPERTS,
                "k": K,
                "steps": STEPS,
                "warmup": WARMUP,
                "record_bytes": RECORD,
                "sim_seconds": round(time.perf_counter() - t0, 1),
            },
            "costs": costs,
            "rows": rows,
            "best_by_cold_tps": {f"{k[0]} {k[1]:.0%}": v["policy"] for k, v in best.items()},
        },
    )


if __name__ == "__main__":
    main()
