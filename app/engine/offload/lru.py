"""Slot bookkeeping of the expert pager: which (layer, expert) lives in which slot, LRU order,
pins. Plain Python, no MLX: unit-tested in microseconds (like nano-vllm's BlockManager).

A slot is one expert's place in the resident slot tensors. A pinned slot holds an expert that a
forward computation still in flight reads: it is never evicted nor freed until unpinned.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


class NoFreeSlot(RuntimeError):
    """Every slot is pinned: the caller must release pins (finish the in-flight step) first."""


@dataclass(frozen=True)
class Allocation:
    key: Hashable  # the (layer, expert) now resident
    slot: int
    evicted: Hashable | None  # the key that slot held before, None if it was free


class ExpertLRU:
    """`num_slots` slots: a `free` deque, the used slots in LRU order (oldest first), pins."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"an expert pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.free: deque[int] = deque(range(num_slots))
        self.slot_of: OrderedDict[Hashable, int] = OrderedDict()  # LRU order: oldest first
        self.key_of: dict[int, Hashable] = {}
        self.pinned: set[int] = set()

    # -- queries ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slot_of

    @property
    def evictable(self) -> int:
        """Slots that an allocation may take: free ones plus used ones not pinned."""
        return len(self.free) + len(self.slot_of) - len(self.pinned)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= self.evictable

    def lookup(self, key: Hashable) -> int | None:
        """The slot of `key` (marked most recently used), or None if it is not resident."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.slot_of.move_to_end(key)
        return slot

    # -- changes ---------------------------------------------------------------------------
    def allocate(self, key: Hashable) -> Allocation:
        """Give `key` a slot: a free one, else the least recently used unpinned one."""
        assert key not in self.slot_of, f"{key} is already resident"
        evicted = None
        if self.free:
            slot = self.free.popleft()
        else:
            evicted = self._victim()
            if evicted is None:
                raise NoFreeSlot(f"all {self.num_slots} slots are pinned")
            slot = self.slot_of.pop(evicted)
        self.slot_of[key] = slot
        self.key_of[slot] = key
        return Allocation(key, slot, evicted)

    def _victim(self) -> Hashable | None:
        """The key to evict: the least recently used unpinned one (None: all are pinned)."""
        return next((k for k, s in self.slot_of.items() if s not in self.pinned), None)

    def deallocate(self, key: Hashable) -> int:
        """Drop `key` (its slot goes back to the free deque); a pinned slot cannot be freed."""
        slot = self.slot_of[key]
        assert slot not in self.pinned, f"{key} (slot {slot}) is pinned"
        del self.slot_of[key]
        del self.key_of[slot]
        self.free.append(slot)
        return slot

    def pin(self, slot: int) -> None:
        assert slot in self.key_of, f"slot {slot} holds no expert"
        self.pinned.add(slot)

    def unpin(self, slot: int) -> None:
        self.pinned.discard(slot)

    def unpin_all(self) -> None:
        self.pinned.clear()

    def resolve(self, keys: Iterable[Hashable]) -> tuple[dict, list[Allocation]]:
        """Pin every key for one computation: hits keep their slot, misses get one.
        Returns ({key: slot}, [allocations of the misses]). Atomic: if the misses cannot all
        get a slot (too many pinned), nothing changes and NoFreeSlot is raised."""
        keys = list(dict.fromkeys(keys))
        hits = [k for k in keys if k in self.slot_of]
        misses = [k for k in keys if k not in self.slot_of]
        allocs = self.use(hits, misses)
        return {k: self.slot_of[k] for k in keys}, allocs

    def _allocate_pinned(self, misses: list) -> list[Allocation]:
        """A slot for each of `misses` (not resident, distinct, room checked), pinned."""
        allocs = []
        for k in misses:
            a = self.allocate(k)
            self.pinned.add(a.slot)
            allocs.append(a)
        return allocs

    def _check_room(self, hits: list, misses: list) -> None:
        """Raise NoFreeSlot unless every miss can get a slot once `hits` are pinned."""
        newly = sum(1 for k in hits if self.slot_of[k] not in self.pinned)
        if len(misses) > self.evictable - newly:
            raise NoFreeSlot(
                f"{len(misses)} misses but {self.evictable - newly} "
                f"evictable slots of {self.num_slots}"
            )

    def use(self, hits: list, misses: list) -> list[Allocation]:
        """`resolve(hits + misses)` for a caller that knows which keys are resident: `hits`
        (resident, distinct) are marked used and pinned in order, then each of `misses` (not
        resident, distinct) gets a slot, pinned. Atomic like resolve."""
        pinned = self.pinned
        self._check_room(hits, misses)
        lookup = self.lookup
        for k in hits:
            pinned.add(lookup(k))
        return self._allocate_pinned(misses)

    def check(self) -> None:
        """Invariants (for tests and debugging)."""
        assert len(self.free) + len(self.slot_of) == self.num_slots
        assert len(set(self.free)) == len(self.free)
        used = set(self.slot_of.values())
        assert not used & set(self.free)
        assert {s: k for k, s in self.slot_of.items()} == self.key_of
        assert self.pinned <= used


class ExpertSLRU(ExpertLRU):
    """Segmented LRU (frequency-aware; chosen by benchmarks/pager_policy.py): a key used again
    while resident moves to a protected segment of `protected` of the slots; new keys enter
    probation, whose least recently used unpinned key is evicted first. The protected
    segment's overflow goes back to probation as its newest key. Probation keeps at least
    `probation_min` slots (the pager sets two forward passes' worth of keys)."""

    def __init__(self, num_slots: int, protected: float = 0.8):
        super().__init__(num_slots)
        self.protected_fraction = protected
        self.probation: OrderedDict[Hashable, None] = OrderedDict()
        self.protected: OrderedDict[Hashable, None] = OrderedDict()
        self.probation_min = 1

    @property
    def probation_min(self) -> int:
        return self._probation_min

    @probation_min.setter
    def probation_min(self, n: int) -> None:
        self._probation_min = n
        self.protected_cap = max(
            0, min(self.num_slots - n, int(self.num_slots * self.protected_fraction))
        )

    def lookup(self, key: Hashable) -> int | None:
        slot = super().lookup(key)
        if slot is None:
            return None
        if key in self.protected:
            self.protected.move_to_end(key)
        else:
            del self.probation[key]
            self.protected[key] = None
            while len(self.protected) > self.protected_cap:
                old, _ = self.protected.popitem(last=False)
                self.probation[old] = None
        return slot

    def use(self, hits: list, misses: list) -> list[Allocation]:
        """ExpertLRU.use with `lookup` inlined (the decode path's per-key cost)."""
        pinned, slot_of = self.pinned, self.slot_of
        self._check_room(hits, misses)
        prot, prob, cap = self.protected, self.probation, self.protected_cap
        for k in hits:
            slot_of.move_to_end(k)
            if k in prot:
                prot.move_to_end(k)
            else:
                del prob[k]
                prot[k] = None
                while len(prot) > cap:
                    old, _ = prot.popitem(last=False)
                    prob[old] = None
            pinned.add(slot_of[k])
        return self._allocate_pinned(misses)

    def allocate(self, key: Hashable) -> Allocation:
        a = super().allocate(key)
        if a.evicted is not None:
            self.probation.pop(a.evicted, None)
            self.protected.pop(a.evicted, None)
        self.probation[key] = None
        return a

    def _victim(self) -> Hashable | None:
        """Probation's least recently used unpinned key first, then protected's."""
        for seg in (self.probation, self.protected):
            k = next((k for k in seg if self.slot_of[k] not in self.pinned), None)
            if k is not None:
                return k
        return None

    def deallocate(self, key: Hashable) -> int:
        slot = super().deallocate(key)
        self.probation.pop(key, None)
        self.protected.pop(key, None)
        return slot

    def check(self) -> None:
        super().check()
        assert set(self.probation) | set(self.protected) == set(self.slot_of)
        assert not set(self.probation) & set(self.protected)


POLICIES = {"lru": ExpertLRU, "slru": ExpertSLRU}
