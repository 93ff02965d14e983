"""The planner's expected-speed model for paged experts and the budget it picks (no MLX)."""

from pathlib import Path

import pytest

from app.engine.offload.speed import BACKEND_COSTS, TRACE_HITS, step_seconds, trace_hit_rate
from app.engine.planner import GiB, Machine, expert_budget_for_speed, plan_model
from app.engine.sizes import sizes_for

CONFIGS = Path(__file__).parent / "data" / "configs"


def test_trace_hit_rate_interpolates_the_table():
    for f, h in TRACE_HITS:
        assert trace_hit_rate(f) == pytest.approx(h)
    assert trace_hit_rate(0.075) == pytest.approx((0.561 + 0.658) / 2)
    assert trace_hit_rate(-1) == 0.0 and trace_hit_rate(2) == 1.0


@pytest.mark.parametrize("backend", sorted(BACKEND_COSTS))
def test_step_time_falls_with_the_budget_and_jumps_when_all_fit(backend):
    eb, rec = 30 * GiB, 2 << 20
    times = [
        step_seconds(b, 20 * GiB, eb, 6 * GiB, 40, 22, rec, BACKEND_COSTS[backend])
        for b in range(GiB, 20 * GiB, GiB)
    ]
    assert all(a >= b for a, b in zip(times, times[1:], strict=False))
    full = step_seconds(eb, eb, eb, 6 * GiB, 40, 22, rec, BACKEND_COSTS[backend])
    assert full < times[-1]  # no read-backs, no misses
    # a bigger page cache (memory) turns disk reads into copies
    assert step_seconds(
        5 * GiB, 25 * GiB, eb, 6 * GiB, 40, 22, rec, BACKEND_COSTS[backend]
    ) < step_seconds(5 * GiB, 10 * GiB, eb, 6 * GiB, 40, 22, rec, BACKEND_COSTS[backend])


def test_budget_for_speed_is_within_one_percent_of_the_best_and_says_why():
    s = sizes_for(f"{CONFIGS}/nemotron-3-super-120b-a12b.json")
    m = Machine.simulate("32GB", "metal")
    left = 15 * GiB
    reasons: list[str] = []
    b = expert_budget_for_speed(s, m, left, reasons)
    assert b <= left and len(reasons) == 1 and "tok/s" in reasons[0]
    active = s.resident_bytes - s.embedding_bytes + s.active_expert_bytes

    def tps(x):
        return 1 / step_seconds(
            x,
            left,
            s.expert_bytes,
            active,
            s.moe_layers,
            s.experts_per_token,
            s.bytes_per_expert,
            BACKEND_COSTS["metal"],
        )

    assert tps(b) >= 0.99 * tps(left)
    assert b == left or tps(b) < tps(left)  # a smaller pool only where it costs < 1%


def test_budget_for_speed_keeps_everything_resident_when_it_fits():
    s = sizes_for(f"{CONFIGS}/qwen3-30b-a3b.json")
    reasons: list[str] = []
    assert (
        expert_budget_for_speed(s, Machine.simulate("64GB"), 10 * s.expert_bytes, reasons)
        == s.expert_bytes
    )
    assert reasons == []


def test_plan_reports_expected_speed_when_paging():
    p = plan_model(f"{CONFIGS}/nemotron-3-super-120b-a12b.json", Machine.simulate("32GB"))
    assert p.paging and any("tok/s" in r for r in p.reasons)
    assert p.min_expert_budget <= p.expert_budget < p.expert_bytes


def test_cuda_budget_counts_the_device_route_where_the_records_pin():
    """On CUDA, where the record files fit in half the host's memory (the pager page-locks them
    and resolves misses on the GPU), the expected speed has no read-backs and no disk reads:
    faster than the host path's model at the same budget, and the reason says so. Where they
    do not fit, the host path's costs stand."""
    from dataclasses import replace

    s = sizes_for(f"{CONFIGS}/qwen3-30b-a3b.json")
    left = s.expert_bytes // 2
    big = Machine.simulate(4 * s.expert_bytes, "cuda")
    small = Machine.simulate(s.expert_bytes, "cuda")
    active = s.resident_bytes - s.embedding_bytes + s.active_expert_bytes
    shape = (s.expert_bytes, active, s.moe_layers, s.experts_per_token, s.bytes_per_expert)

    reasons: list[str] = []
    b = expert_budget_for_speed(s, big, left, reasons)
    route = replace(BACKEND_COSTS["cuda"], readback_s=0.0)
    host = BACKEND_COSTS["cuda"]
    assert len(reasons) == 1 and "resolved on the GPU" in reasons[0]
    expected = 1 / step_seconds(b, s.expert_bytes, *shape, route)
    assert f"{expected:.1f} tok/s" in reasons[0]
    assert expected > 1 / step_seconds(b, left, *shape, host)

    reasons = []
    expert_budget_for_speed(s, small, left, reasons)
    assert len(reasons) == 1 and "resolved on the GPU" not in reasons[0]
