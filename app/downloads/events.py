"""Progress and state events: small dataclasses handed to callbacks (the GUI turns them into
signals). Callbacks run on the download's own thread."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DownloadProgress:
    repo: str
    file: str  # the file being transferred ("" before the first and after the last)
    file_done: int
    file_total: int
    done: int  # bytes in place over all files; never decreases
    total: int
    rate: float  # bytes/s over the last few seconds
    eta: float | None  # seconds left at that rate; None while unknown
    files_done: int
    files_total: int

    def __post_init__(self):
        if not (0 <= self.done <= self.total and 0 <= self.file_done <= self.file_total):
            raise ValueError(f"inconsistent progress {self}")

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


@dataclass(frozen=True)
class ConvertProgress:
    name: str
    stage: str  # what the converter is doing, in words
    fraction: float  # 0..1, never decreases

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction {self.fraction} outside 0..1")


@dataclass(frozen=True)
class StateChanged:
    name: str
    state: str
    error: str = ""


Event = DownloadProgress | ConvertProgress | StateChanged
Callback = Callable[[Event], None]


class Meter:
    """Total progress over a download: monotonic bytes in place, a windowed rate and throttled
    events (throttle at the source so a GUI is never flooded)."""

    def __init__(
        self,
        repo: str,
        total: int,
        files_total: int,
        callback: Callback | None,
        interval: float = 0.2,  # at most 5 events a second per download
        window: float = 5.0,  # rate averaged over this many seconds
        clock: Callable[[], float] = time.monotonic,
    ):
        self.repo, self.total, self.files_total = repo, total, files_total
        self.callback, self.interval, self.window, self.clock = callback, interval, window, clock
        self.base = 0  # bytes of finished files
        self.floor = 0  # bytes known to be in place before this run started
        self.files_done = 0
        self.file, self.file_done, self.file_total = "", 0, 0
        self.emitted_done = -1
        self.last_emit = -1e9
        self.samples: deque[tuple[float, int]] = deque()  # (time, bytes received so far)
        self.received = 0

    def start_file(self, path: str, size: int, have: int) -> None:
        self.file, self.file_total, self.file_done = path, size, have
        self.emit(force=True)

    def advance(self, file_done: int, received: int = 0) -> None:
        """`file_done`: bytes of the current file in place; `received`: new bytes off the wire."""
        self.file_done = file_done
        if received:
            self.received += received
            now = self.clock()
            self.samples.append((now, self.received))
            while len(self.samples) > 2 and now - self.samples[0][0] > self.window:
                self.samples.popleft()
        self.emit()

    def finish_file(self) -> None:
        self.base += self.file_total
        self.files_done += 1
        self.file, self.file_done, self.file_total = "", 0, 0
        self.emit(force=True)

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def emit(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.last_emit < self.interval:
            return
        # A file that restarts (corrupt bytes, server ignoring Range) holds the bar still until it
        # catches up, rather than moving it backwards.
        done = max(self.emitted_done, self.floor, min(self.total, self.base + self.file_done))
        if done == self.emitted_done and not force:
            return
        self.emitted_done, self.last_emit = done, now
        if self.callback is None:
            return
        rate = self.rate()
        eta = (self.total - done) / rate if rate > 0 else (0.0 if done == self.total else None)
        shown_file_done = min(self.file_done, self.file_total)
        self.callback(
            DownloadProgress(
                self.repo,
                self.file,
                shown_file_done,
                self.file_total,
                done,
                self.total,
                rate,
                eta,
                self.files_done,
                self.files_total,
            )
        )
