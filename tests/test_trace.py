"""Trace routing and cache-policy simulation: plain Python, no MLX."""

import numpy as np
import pytest

from app.engine.offload.policy import POLICIES, simulate, token_seconds
from app.engine.offload.trace import CALIBRATION, expert_trace, lru_hit_rate, model_traces


@pytest.mark.parametrize("seed", [0, 7])
def test_trace_calibration(seed):
    # flash-moe's router: a per-layer LRU of 16/32/64/128 of 512 (k = 10) hits 49/59/68/71%
    tr = expert_trace(512, 10, 1200, seed=seed)
    for slots, want in CALIBRATION.items():
        got = lru_hit_rate(tr, slots)
        assert abs(got - want) <= 0.03, (slots, got, want)


def test_uniform_random_is_the_worst_case():
    rng = np.random.default_rng(0)
    rand = np.stack([rng.choice(512, 10, replace=False) for _ in range(600)])
    tr = expert_trace(512, 10, 600)
    for slots in (16, 64, 128):
        assert lru_hit_rate(rand, slots) < 0.3 < lru_hit_rate(tr, slots)


@pytest.mark.parametrize("experts,k", [(512, 10), (128, 8), (512, 22), (64, 8), (16, 15)])
def test_trace_rows_are_distinct_and_seeded(experts, k):
    a = expert_trace(experts, k, 50, seed=3)
    assert a.shape == (50, k) and a.min() >= 0 and a.max() < experts
    assert all(len(set(r)) == k for r in a.tolist())
    assert np.array_equal(a, expert_trace(experts, k, 50, seed=3))
    assert not np.array_equal(a, expert_trace(experts, k, 50, seed=4))


def test_lru_hit_rate_by_hand():
    tr = np.array([[0, 1], [1, 2], [0, 3]])
    # 2 slots: 0 1 | 1 hit, 2 evicts 0 | 0 miss evicts 1... -> one hit of six
    assert lru_hit_rate(tr, 2) == pytest.approx(1 / 6)
    assert lru_hit_rate(tr, 4) == pytest.approx(2 / 6)


def test_simulate_policies():
    traces = model_traces([0, 1, 2], 64, 4, 200)
    res = {p: simulate(p, traces, 64, warmup=50) for p in POLICIES}
    for r in res.values():
        assert 0.3 < r.hit_rate < 1.0
        assert r.misses_per_token == pytest.approx((1 - r.hit_rate) * 12)
    assert res["lru"].copies_per_token == 0
    assert res["os"].copies_per_token == pytest.approx(res["os"].hit_rate * 12)
    # every expert fits: the only misses are first uses
    full = simulate("lru", traces, 3 * 64, warmup=50)
    first = sum(
        len(set(tr.ravel().tolist()) - set(tr[:50].ravel().tolist())) for tr in traces.values()
    )
    assert full.misses_per_token == pytest.approx(first / 150)
    t = token_seconds(res["os"], 0.01, 1000, 1e6, 1e7)
    assert t == pytest.approx(
        0.01 + res["os"].misses_per_token * 1e-3 + res["os"].copies_per_token * 1e-4
    )


def test_slru_protects_reused_keys():
    # a reused key survives a scan of new keys that flushes plain LRU
    traces = {0: np.array([[0], [0]] + [[i] for i in range(1, 6)] + [[0]])}
    assert simulate("lru", traces, 4).hit_rate == pytest.approx(1 / 8)
    assert simulate("slru", traces, 4).hit_rate == pytest.approx(2 / 8)
