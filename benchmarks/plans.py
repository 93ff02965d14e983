"""The planner's plan for every config in ../shared/configs at 16, 32, 64 and 128 GB, on a
simulated Apple-silicon Mac (the target machine; Metal working set estimated), at the default
8K context and at 32K. Attention shares are estimates from bytes read per token (no profile
exists for a machine that is not this one). Prints the README table (16 and 32 GB, 8K).

    .venv/bin/python benchmarks/plans.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "plans.json"
GiB = 1 << 30
RAMS = (16, 32, 64, 128)
CONTEXTS = (None, 32768)  # None: the planner's default (8K, shortened if memory is short)


def _cell(p) -> dict:
    if isinstance(p, Exception):
        return {"refused": str(p), "smallest_ram": getattr(p, "smallest_ram", None)}
    return p.to_dict()


def readme_table(plans: dict) -> str:
    lines = [
        "| model | RAM | experts | expert budget | KV (full layers) | context | expected peak | attention share @8K |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, by_ram in plans.items():
        for ram in ("16GB", "32GB"):
            d = by_ram[ram]["default"]
            if "refused" in d:
                small = d["smallest_ram"]
                lines.append(
                    f"| {name} | {ram[:-2]} GB | does not fit (needs {small // GiB} GB) | | | | | |"
                )
                continue
            exp = "paged" if d["paging"] else ("resident" if d["expert_bytes"] else "—")
            budget = (
                f"{d['expert_budget'] / GiB:.1f} / {d['expert_bytes'] / GiB:.1f} GB"
                if d["expert_bytes"]
                else "—"
            )
            kv = d["kv_modes"].get("full", "—")
            share = d["attention_share"]["share"]
            lines.append(
                f"| {name} | {ram[:-2]} GB | {exp} | {budget} | {kv} | {d['context_limit']} | "
                f"{d['process_peak'] / GiB:.1f} GB | {share:.1%} (est.) |"
            )
    return "\n".join(lines)


def main() -> None:
    from app.engine.planner import Machine, PlanRefused, make_plan
    from app.engine.sizes import shared_configs_dir, sizes_for

    folder = shared_configs_dir()
    plans: dict = {}
    for path in sorted(folder.glob("*.json")):
        s = sizes_for(path)
        plans[path.stem] = {}
        for ram in RAMS:
            row = {}
            for ctx in CONTEXTS:
                try:
                    p = make_plan(s, Machine.simulate(ram * GiB, "metal"), ctx)
                except PlanRefused as e:
                    p = e
                row["default" if ctx is None else str(ctx)] = _cell(p)
            plans[path.stem][f"{ram}GB"] = row
    print(
        f"{'model':28s} {'RAM':>5s} {'ctx':>6s} {'experts':>9s} {'budget':>8s} {'KV':>10s} {'limit':>6s} {'peak':>7s}"
    )
    for name, by_ram in plans.items():
        for ram, row in by_ram.items():
            for ctx, d in row.items():
                if "refused" in d:
                    print(
                        f"{name:28s} {ram:>5s} {ctx:>6s} refused: needs {d['smallest_ram'] // GiB if d['smallest_ram'] else '?'} GB"
                    )
                    continue
                exp = "paged" if d["paging"] else ("resident" if d["expert_bytes"] else "-")
                print(
                    f"{name:28s} {ram:>5s} {ctx:>6s} {exp:>9s} {d['expert_budget'] / GiB:7.1f}G "
                    f"{d['kv_modes'].get('full', '-'):>10s} {d['context_limit']:6d} {d['process_peak'] / GiB:6.1f}G"
                )
    table = readme_table(plans)
    print()
    print(table)
    result = {
        "what": "plans on a simulated Apple-silicon Mac (Metal working set estimated as 2/3 of RAM below 36 GB, 3/4 above), default context (8K) and 32K",
        "command": ".venv/bin/python benchmarks/plans.py",
        "units": "bytes",
        "attention_share": "estimated from bytes read per token (KV vs weights); a measured profile replaces it on the user's machine",
        "plans": plans,
        "readme_table": table,
    }
    from record import write_result  # benchmarks/ is the script's folder, first on sys.path

    write_result("plans", result, "any: computed from config.json alone", OUT)


if __name__ == "__main__":
    main()
