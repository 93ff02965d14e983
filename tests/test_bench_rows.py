"""benchmarks/pager_speed.py keeps one row per (machine, model, routing, budget, cache)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "pager_speed_rows", ROOT / "benchmarks" / "pager_speed.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(tps, variant="current", cache="warm", machine="m"):
    return {
        "machine": machine,
        "model": "x",
        "routing": "trace",
        "budget_fraction": 0.5,
        "cache": cache,
        "variant": variant,
        "paged_tps": tps,
        "hit_rate": 0.7,
        "ms_per_token": {"reads": 1.0},
    }


def test_a_second_variant_nests_and_a_rerun_replaces():
    ps = _bench()
    rows: list[dict] = []
    ps.add_row(rows, _row(10.0, "device_copy"))
    ps.add_row(rows, _row(6.0, "staging"))
    ps.add_row(rows, _row(2.0, "device_copy", cache="cold"))
    assert [r["paged_tps"] for r in rows] == [10.0, 2.0]
    assert rows[0]["variants"]["staging"]["paged_tps"] == 6.0
    ps.add_row(rows, _row(11.0, "device_copy"))  # the same variant again: replaced
    assert rows[0]["paged_tps"] == 11.0 and "staging" in rows[0]["variants"]
    old = [_row(1.0, machine="other"), _row(3.0), _row(4.0, cache="cold")]
    merged = ps.merge_rows(old, rows)
    keys = [ps.row_key(r) for r in merged]
    assert len(keys) == len(set(keys)) == 3
    assert {r["paged_tps"] for r in merged} == {1.0, 11.0, 2.0}


def test_the_committed_results_hold_each_key_once():
    ps = _bench()
    runs = json.loads((ROOT / "benchmarks" / "results" / "pager_speed.json").read_text())["runs"]
    keys = [ps.row_key(r) for r in runs]
    assert len(keys) == len(set(keys))
