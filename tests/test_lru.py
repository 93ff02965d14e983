"""Expert LRU bookkeeping: plain Python, no MLX (microseconds per test)."""

import random

import pytest

from app.engine.offload.lru import ExpertLRU, NoFreeSlot


def test_free_slots_first_then_least_recently_used():
    lru = ExpertLRU(3)
    assert [lru.allocate((0, e)).slot for e in range(3)] == [0, 1, 2]
    assert not lru.free and len(lru) == 3
    assert lru.lookup((0, 0)) == 0  # touch: (0, 1) is now the oldest
    a = lru.allocate((1, 5))
    assert (a.slot, a.evicted) == (1, (0, 1))
    assert (0, 1) not in lru and lru.lookup((1, 5)) == 1
    lru.check()


def test_lookup_miss_returns_none_and_does_not_allocate():
    lru = ExpertLRU(2)
    assert lru.lookup((0, 0)) is None
    assert len(lru) == 0 and lru.can_allocate(2) and not lru.can_allocate(3)


def test_pinned_slots_are_never_evicted():
    lru = ExpertLRU(3)
    for e in range(3):
        lru.pin(lru.allocate((0, e)).slot)
    assert lru.evictable == 0 and not lru.can_allocate(1)
    with pytest.raises(NoFreeSlot):
        lru.allocate((0, 9))
    lru.unpin(1)  # only slot 1 may go, though (0, 0) is older
    a = lru.allocate((0, 9))
    assert (a.slot, a.evicted) == (1, (0, 1))
    lru.check()


def test_deallocate_returns_the_slot_and_refuses_pinned():
    lru = ExpertLRU(2)
    s = lru.allocate((3, 1)).slot
    lru.pin(s)
    with pytest.raises(AssertionError):
        lru.deallocate((3, 1))
    lru.unpin(s)
    assert lru.deallocate((3, 1)) == s
    assert s in lru.free and (3, 1) not in lru
    lru.check()


def test_allocate_twice_is_a_bug():
    lru = ExpertLRU(2)
    lru.allocate((0, 0))
    with pytest.raises(AssertionError):
        lru.allocate((0, 0))


def test_resolve_pins_hits_and_misses_and_never_evicts_its_own_hits():
    lru = ExpertLRU(3)
    for e in range(3):
        lru.allocate((0, e))
    # (0, 0) is the oldest, but it is a hit of this call: the miss must take (0, 1)
    slots, allocs = lru.resolve([(0, 0), (0, 7)])
    assert [a.evicted for a in allocs] == [(0, 1)]
    assert slots[(0, 0)] == 0 and slots[(0, 7)] == 1
    assert lru.pinned == {0, 1}
    lru.check()


def test_resolve_is_atomic_when_it_cannot_fit():
    lru = ExpertLRU(2)
    lru.allocate((0, 0))
    before = (dict(lru.slot_of), list(lru.free), set(lru.pinned))
    with pytest.raises(NoFreeSlot):
        lru.resolve([(0, 0), (0, 1), (0, 2)])
    assert (dict(lru.slot_of), list(lru.free), set(lru.pinned)) == before


def test_resolve_dedupes_keys():
    lru = ExpertLRU(2)
    slots, allocs = lru.resolve([(0, 4), (0, 4), (0, 4)])
    assert len(allocs) == 1 and len(slots) == 1


def test_zero_slots_is_refused():
    with pytest.raises(ValueError, match="at least one slot"):
        ExpertLRU(0)


def test_random_operations_match_a_reference_lru():
    """Against a list-based LRU: same residents, same evictions, invariants after each op."""
    rng = random.Random(0)
    n = 7
    lru, ref, pinned = ExpertLRU(n), [], set()  # ref: keys oldest first
    for _ in range(3000):
        op = rng.random()
        key = (rng.randrange(3), rng.randrange(12))
        if op < 0.5:
            if key in ref:
                ref.remove(key)
                ref.append(key)
                assert lru.lookup(key) is not None
            else:
                victims = [k for k in ref if lru.slot_of[k] not in lru.pinned]
                if len(ref) < n or victims:
                    want = None if len(ref) < n else victims[0]
                    assert lru.allocate(key).evicted == want
                    if want is not None:
                        ref.remove(want)
                    ref.append(key)
                else:
                    with pytest.raises(NoFreeSlot):
                        lru.allocate(key)
        elif op < 0.7 and ref:
            k = rng.choice(ref)
            lru.pin(lru.slot_of[k])
            pinned.add(k)
        elif op < 0.85:
            lru.unpin_all()
            pinned.clear()
        elif ref:
            k = rng.choice(ref)
            if lru.slot_of[k] not in lru.pinned:
                lru.deallocate(k)
                ref.remove(k)
        lru.check()
        assert list(lru.slot_of) == ref


def test_slru_matches_the_policy_simulation():
    import numpy as np

    from app.engine.offload.lru import ExpertSLRU
    from app.engine.offload.policy import make_cache
    from app.engine.offload.trace import model_traces

    traces = model_traces([0, 1], 64, 4, 300, seed=2)
    slru, ref = ExpertSLRU(40), make_cache("slru", 40, per_token=8)
    slru.probation_min = 16
    hits = ref_hits = 0
    for t in range(300):
        for layer in (0, 1):
            keys = [(layer, int(e)) for e in traces[layer][t]]
            for k in keys:  # one key at a time, no pins: the simulation's model
                ref_hits += ref.access(k)
                hit = slru.lookup(k) is not None
                if not hit:
                    slru.allocate(k)
                hits += hit
        slru.check()
    assert hits == ref_hits > 0
    assert set(slru.protected) == set(ref.prot) and set(slru.probation) == set(ref.prob)
    assert np.isclose(len(slru.protected), 24)


def test_slru_protects_reused_keys_and_respects_pins():
    from app.engine.offload.lru import ExpertSLRU

    lru = ExpertSLRU(3, protected=0.34)  # one protected slot
    lru.allocate("a")
    assert lru.lookup("a") is not None and "a" in lru.protected
    lru.allocate("b")
    lru.allocate("c")
    assert lru.allocate("d").evicted == "b"  # probation's oldest, not the older "a"
    lru.pin(lru.slot_of["c"])
    lru.pin(lru.slot_of["d"])
    assert lru.allocate("e").evicted == "a"  # probation all pinned: the protected key goes
    lru.pin(lru.slot_of["e"])
    with pytest.raises(NoFreeSlot):
        lru.allocate("f")
    lru.unpin_all()
    slots, allocs = lru.resolve(["c", "f"])
    assert [a.evicted for a in allocs] == ["d"] and "c" in lru.protected
    lru.check()


def test_slru_use_matches_lookup_and_allocate_one_key_at_a_time():
    """ExpertSLRU.use (lookups inlined) leaves exactly the state that ExpertLRU.use, which
    calls ExpertSLRU.lookup per key, leaves: slots, both segments' order, pins."""
    import random

    from app.engine.offload.lru import ExpertLRU, ExpertSLRU

    rnd = random.Random(7)
    fast, ref = ExpertSLRU(24, protected=0.5), ExpertSLRU(24, protected=0.5)
    for lru in (fast, ref):
        lru.probation_min = 6
    promoted = 0
    for _ in range(400):
        layer = rnd.randrange(3)
        keys = sorted({(layer, rnd.randrange(16)) for _ in range(rnd.randint(1, 5))})
        hits = [k for k in keys if k in ref.slot_of]
        misses = [k for k in keys if k not in ref.slot_of]
        promoted += sum(k in ref.probation for k in hits)
        a = fast.use(hits, misses)
        b = ExpertLRU.use(ref, hits, misses)
        assert a == b
        assert list(fast.slot_of.items()) == list(ref.slot_of.items())
        assert list(fast.protected) == list(ref.protected)
        assert list(fast.probation) == list(ref.probation)
        assert fast.pinned == ref.pinned
        if rnd.random() < 0.7:
            fast.unpin_all()
            ref.unpin_all()
        fast.check()
    assert promoted > 50 and len(fast.protected) == fast.protected_cap
