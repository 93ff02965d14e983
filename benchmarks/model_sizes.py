"""Bytes per role and total at the default widths (SPEC §2), from config.json alone, for every
config in ../shared/configs (or tests/data/configs), and what fits in 16 and 32 GB with experts
paged (the planner on a simulated Apple-silicon Mac, 8K context).

    .venv/bin/python benchmarks/model_sizes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "model_sizes.json"
GiB = 1 << 30


def main() -> None:
    from app.engine.planner import Machine, ModelTooLarge, make_plan
    from app.engine.quant.widths import RoleWidths
    from app.engine.sizes import shared_configs_dir, sizes_for

    folder = shared_configs_dir()
    rows = []
    for path in sorted(folder.glob("*.json")):
        s = sizes_for(path, RoleWidths())
        fits = {}
        for ram in (16, 32):
            try:
                p = make_plan(s, Machine.simulate(ram * GiB, "metal"))
                fits[f"{ram}GB"] = {
                    "fits": True,
                    "paging": p.paging,
                    "expert_budget": p.expert_budget,
                    "resident_expert_fraction": round(p.expert_budget / s.expert_bytes, 4)
                    if s.expert_bytes
                    else None,
                    "kv_modes": p.kv_modes,
                    "context_limit": p.context_limit,
                    "process_peak": p.process_peak,
                }
            except ModelTooLarge as e:
                fits[f"{ram}GB"] = {"fits": False, "reason": str(e), "smallest_ram": e.smallest_ram}
        rows.append({"config": path.name, **s.to_dict(), "plan_16_32": fits})
    hdr = f"{'model':28s} {'params':>8s} {'dense':>8s} {'routed':>8s} {'shared':>8s} {'float':>7s} {'total':>8s} {'expert':>8s} {'KV/tok':>8s} {'16 GB':>16s} {'32 GB':>16s}"
    print(hdr)
    for r in rows:
        b = r["bytes"]

        def fit(f):
            if not f["fits"]:
                return "no"
            return ("paged " if f["paging"] else "resident ") + f"{f['process_peak'] / GiB:.1f}G"

        print(
            f"{r['name']:28s} {r['total_params'] / 1e9:7.2f}B {b['dense'] / GiB:7.2f}G {b['routed'] / GiB:7.2f}G "
            f"{b['shared'] / GiB:7.2f}G {b['keep_float'] / GiB:6.2f}G {r['total_bytes'] / GiB:7.2f}G "
            f"{r['bytes_per_expert'] / 2**20:6.2f}M {r['kv_bytes_per_token'] / 1024:6.0f}K "
            f"{fit(r['plan_16_32']['16GB']):>16s} {fit(r['plan_16_32']['32GB']):>16s}"
        )
    result = {
        "what": "per-role params and bytes at the default widths from config.json alone; plan on a simulated 16/32 GB Apple-silicon Mac at 8K context",
        "command": ".venv/bin/python benchmarks/model_sizes.py",
        "widths": RoleWidths().to_dict(),
        "units": "bytes; GB in printed tables = GiB",
        "configs_folder": str(folder),
        "models": rows,
    }
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("model_sizes", result, "any: computed from config.json alone", OUT)


if __name__ == "__main__":
    main()
