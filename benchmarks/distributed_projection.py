"""On paper: Nemotron 3 Super at default widths on 2 x 32 GB Macs over Thunderbolt 5 against one
32 GB Mac paging its experts. No measurement: the planner's arithmetic (app/engine/distributed/
plan.py) on the config, with every assumption written into the output.

    .venv/bin/python benchmarks/distributed_projection.py      # prints the table
    (benchmarks/distributed.py stores the same dict under "projection" in distributed.json)

Assumptions:
- each Mac: M4 Pro Mac mini, 32 GB, 273 GB/s memory bandwidth (Apple's spec), ~5 GB/s SSD
  reads; usable memory by the planner's Metal rules (OS/GUI reserve, ~2/3 working set);
- decode, one sequence, memory-bandwidth bound: a token costs its bytes read / bandwidth on
  each rank in turn (pipeline stages do not overlap for one sequence);
- link per message: ring (TCP/IP over Thunderbolt 5) ~300 us, JACCL (RDMA over Thunderbolt 5,
  macOS 26.2+) < 50 us by Apple's TN3205 coverage, ~3 us reported by exo; 80 Gb/s;
  2 (N-1) messages of one token's hidden state per token (sends + ring all_gather);
- paging: uniform routing, an LRU holding fraction f of a layer's experts misses 1 - f of
  the picks, each miss read from SSD (skewed routing misses less: a floor on tok/s).
Bounds quoted for each setting: memory-bandwidth bound (bytes read / 273 GB/s alone) and, for
the paging Mac, the SSD bound (expected miss bytes / 5 GB/s alone).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.engine.distributed.hosts import parse_hosts  # noqa: E402
from app.engine.distributed.plan import (  # noqa: E402
    DEFAULT_MEM_GBPS,
    DEFAULT_SSD_GBPS,
    LINKS,
    host_specs,
    plan_split,
)

MODEL = "nemotron-3-super-120b-a12b"
JACCL_BEST_US = 3.0  # exo's reported RDMA latency: the optimistic end


def _hosts(n: int):
    return parse_hosts({"hosts": [{"ssh": f"mac-{i}", "ram": "32GB"} for i in range(n)]})


def _row(name: str, plan) -> dict:
    mem = sum(s.read_per_token for s in plan.stages)
    ssd = sum(s.miss_per_token for s in plan.stages)
    return {
        "setting": name,
        "split": plan.split,
        "paging": plan.paging,
        "resident_expert_fraction": round(
            sum(s.expert_budget for s in plan.stages)
            / max(sum(s.expert_bytes for s in plan.stages), 1),
            3,
        ),
        "bytes_read_per_token": mem,
        "ssd_bytes_per_token": ssd,
        "link_bytes_per_token": plan.link_bytes_per_token,
        "link_ms_per_token": round(plan.link_seconds_per_token * 1e3, 3),
        "memory_bound_tok_s": round(DEFAULT_MEM_GBPS * 1e9 / mem, 1),
        "ssd_bound_tok_s": round(DEFAULT_SSD_GBPS * 1e9 / ssd, 1) if ssd else None,
        "expected_tok_s": round(plan.tok_s, 1),
        "peak_per_host_gb": [round(s.peak / 2**30, 1) for s in plan.stages],
    }


def projection(model: str = MODEL) -> dict:
    one = plan_split(model, host_specs(_hosts(1)), LINKS["thunderbolt5"])
    two = host_specs(_hosts(2))
    ring = plan_split(model, two, LINKS["thunderbolt5"])
    jaccl = plan_split(model, two, LINKS["thunderbolt5-rdma"])
    best = replace(
        LINKS["thunderbolt5-rdma"], name="thunderbolt5-rdma-3us", latency_us=JACCL_BEST_US
    )
    jaccl3 = plan_split(model, two, best)
    return {
        "model": model,
        "assumptions": {
            "mac": "M4 Pro Mac mini, 32 GB (planner's Metal usable memory)",
            "memory_GBps": DEFAULT_MEM_GBPS,
            "ssd_GBps": DEFAULT_SSD_GBPS,
            "links": {
                k: {"gbps": v.gbps, "latency_us": v.latency_us, "source": v.source}
                for k, v in LINKS.items()
                if k.startswith("thunderbolt5")
            },
            "jaccl_optimistic_latency_us": JACCL_BEST_US,
            "decode": "one sequence; stages run in turn; bandwidth-bound",
            "paging": "uniform routing: misses = (1 - resident fraction) of the active experts",
            "context": one.context,
            "kv_modes": one.kv_modes,
        },
        "settings": [
            _row("1 x 32 GB Mac, experts paged", one),
            _row("2 x 32 GB Macs, ring over Thunderbolt 5", ring),
            _row("2 x 32 GB Macs, JACCL (RDMA) over Thunderbolt 5", jaccl),
            _row("2 x 32 GB Macs, JACCL at 3 us", jaccl3),
        ],
    }


def main() -> None:
    p = projection()
    print(f"{p['model']} on paper (assumptions in the JSON / the module doc)")
    print(
        f"{'setting':48s} {'split':>9s} {'paged':>6s} {'GB read':>8s} {'GB SSD':>7s} "
        f"{'link ms':>8s} {'mem bound':>10s} {'SSD bound':>10s} {'expected':>9s}"
    )
    for r in p["settings"]:
        print(
            f"{r['setting']:48s} {'/'.join(map(str, r['split'])):>9s} {str(r['paging']):>6s} "
            f"{r['bytes_read_per_token'] / 2**30:8.2f} {r['ssd_bytes_per_token'] / 2**30:7.2f} "
            f"{r['link_ms_per_token']:8.2f} {r['memory_bound_tok_s']:10.1f} "
            f"{(r['ssd_bound_tok_s'] or float('nan')):10.1f} {r['expected_tok_s']:9.1f}"
        )


if __name__ == "__main__":
    main()
