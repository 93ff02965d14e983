"""The ranks' group (mx.distributed) and what happens when a host drops out.

MLX's ring backend raises `RuntimeError: [ring] connection to a peer was lost` when a peer's
socket closes, without saying which peer. At start each rank shares the endpoints of its
sockets (one all_gather), so after a failure the sockets that are no longer ESTABLISHED name
the lost rank and its host. A link that goes silent instead (cable, sleep) never raises: the
`Watchdog` ends a step that outlives its deadline, with the same report.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from collections.abc import Callable

import mlx.core as mx

from ..errors import EngineError

_MAX_SOCKETS = 32  # per rank; the ring opens one or two per neighbour and IP
POLL_S = 0.25  # how often the watchdog looks at the sockets
# after a peer's sockets close, MLX may raise (then the main thread reports) or block for ever
# in a collective that waits on another rank: the watchdog ends the rank after this long
GRACE_S = 1.5


class PeerLost(EngineError):
    """A rank stopped answering. `ranks`/`hosts`: the ones this rank lost (may be empty)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = (), hosts: tuple[str, ...] = ()):
        super().__init__(message)
        self.ranks, self.hosts = ranks, hosts


def init_group(backend: str = "ring"):
    """The global group; size 1 when not started by mlx.launch (MLX_RANK unset)."""
    if "MLX_RANK" not in os.environ:
        return mx.distributed.init()
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise EngineError(f"could not join the other ranks over {backend}: {e}") from e


def _sockets() -> list:
    import psutil

    return [c for c in psutil.Process().net_connections("tcp") if c.raddr]


def _ip_bytes(ip: str) -> list[int]:
    parts = ip.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return [int(p) for p in parts]
    h = zlib.crc32(ip.encode())  # IPv6: a digest both ends compute alike (hash() is salted)
    return [(h >> s) & 0xFF for s in (0, 8, 16, 24)]


class Peers:
    """Which rank is at the other end of each of this rank's sockets."""

    def __init__(self, group, labels: list[str]):
        self.group, self.labels = group, labels
        self.rank, self.size = group.rank(), group.size()
        self.by_endpoint: dict[tuple, int] = {}
        self.gone_since: dict[int, float] = {}
        self.mine: dict[tuple, int | None] = {}
        if self.size > 1:
            self._exchange()

    def _exchange(self) -> None:
        rows = [[*_ip_bytes(c.laddr.ip), c.laddr.port] for c in _sockets()][:_MAX_SOCKETS]
        rows += [[-1] * 5] * (_MAX_SOCKETS - len(rows))
        table = mx.distributed.all_gather(mx.array(rows, dtype=mx.int32), group=self.group)
        table = table.reshape(self.size, _MAX_SOCKETS, 5).tolist()
        for r, sockets in enumerate(table):
            if r == self.rank:
                continue
            for s in sockets:
                if s[4] >= 0:
                    self.by_endpoint[tuple(s)] = r
        self.mine = {
            (c.laddr.ip, c.laddr.port): self.by_endpoint.get((*_ip_bytes(c.raddr.ip), c.raddr.port))
            for c in _sockets()
        }

    def label(self, rank: int) -> str:
        return self.labels[rank] if 0 <= rank < len(self.labels) else f"rank {rank}"

    def poll(self) -> None:
        """Note when each peer's sockets stopped being ESTABLISHED (the watchdog polls)."""
        if self.size == 1:
            return
        alive = {
            self.by_endpoint.get((*_ip_bytes(c.raddr.ip), c.raddr.port))
            for c in _sockets()
            if c.status == "ESTABLISHED"
        }
        now = time.monotonic()
        for r in {r for r in self.mine.values() if r is not None} - alive:
            self.gone_since.setdefault(r, now)

    def lost(self) -> list[int]:
        """The peers that dropped first: once one host is gone the survivors give up and close
        their own sockets too, so only those within POLL_S of the first are the cause."""
        self.poll()
        if not self.gone_since:
            return []
        first = min(self.gone_since.values())
        return sorted(r for r, t in self.gone_since.items() if t <= first + 2 * POLL_S)

    def failure(self, cause: str) -> PeerLost:
        lost = self.lost()
        me = f"rank {self.rank} ({self.label(self.rank)})"
        if lost:
            who = ", ".join(f"rank {r} on host {self.label(r)}" for r in lost)
            msg = f"{me}: lost {who}: {cause}"
        else:
            others = ", ".join(f"{self.label(r)}" for r in range(self.size) if r != self.rank)
            msg = f"{me}: the pipeline stopped answering ({cause}); hosts: {others}"
        return PeerLost(msg, tuple(lost), tuple(self.label(r) for r in lost))


class Watchdog:
    """Ends this process with a report when an armed step outlives `timeout_s`: a collective
    blocked in MLX cannot be interrupted from Python, and a hung rank must not hang the rest.

    `on_end(err)`, when given, runs before the process ends (the server's rank 0 answers its
    clients with the report there); the process ends when it returns."""

    def __init__(
        self,
        peers: Peers,
        timeout_s: float,
        exit_code: int = 3,
        on_end: Callable[[PeerLost], None] | None = None,
    ):
        self.peers, self.timeout_s, self.exit_code = peers, timeout_s, exit_code
        self.on_end = on_end
        self._deadline: float | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._ending = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rq-watchdog", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        with self._lock:
            self._deadline = time.monotonic() + self.timeout_s

    beat = arm  # each finished step restarts the clock

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def close(self) -> None:
        """The session is over: peers leaving now is expected."""
        self._closed = True

    def _run(self) -> None:
        while not self._closed:
            time.sleep(min(POLL_S, self.timeout_s / 4))
            self.peers.poll()
            gone = self.peers.gone_since
            if gone and not self._closed and time.monotonic() > min(gone.values()) + GRACE_S:
                self._end("its connection closed")  # the group cannot recover: no wait
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
            if late and not self._closed:
                self._end(f"no step finished in {self.timeout_s:g} s")

    def _end(self, cause: str) -> None:
        self.end(cause)

    def end(self, cause: str) -> None:
        """Report the lost peer and end the process (from any thread; the first caller does
        it, later ones wait for the exit)."""
        if not self._ending.acquire(blocking=False):
            while True:
                time.sleep(3600)
        err = self.peers.failure(cause)
        report(err)
        if self.on_end is not None:
            try:
                self.on_end(err)
            except Exception as e:  # the report is out; the exit must still happen
                print(f"error: while ending: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)


_reported = threading.Lock()


def report(err: PeerLost) -> None:
    """Print the failure once per process (the main thread and the watchdog may both see it)."""
    if _reported.acquire(blocking=False):
        print(f"error: {err}", file=sys.stderr, flush=True)


def is_link_error(e: BaseException) -> bool:
    """MLX's ring/JACCL/MPI report a lost peer as a RuntimeError naming the backend."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "peer", "connection")
    )
