"""Pause / cancel for a running transfer, safe to call from any thread (e.g. a GUI button)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import Cancelled, Paused


class Control:
    def __init__(self):
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set by pause or cancel; wakes back-off sleeps
        self._reason: str | None = None  # "pause" or "cancel"
        self.remove_partial = False
        self._closer: Callable[[], None] | None = None

    def pause(self) -> None:
        self._request("pause")

    def cancel(self, remove_partial: bool = False) -> None:
        with self._lock:
            self.remove_partial = self.remove_partial or remove_partial
        self._request("cancel")

    def _request(self, reason: str) -> None:
        with self._lock:
            if self._reason != "cancel":  # cancel wins over pause
                self._reason = reason
            closer = self._closer
        self._stop.set()
        if closer is not None:
            # Close the live response so a read blocked on a stalled connection returns now.
            try:
                closer()
            except Exception:
                pass

    @property
    def stopping(self) -> str | None:
        return self._reason

    def attach(self, closer: Callable[[], None] | None) -> None:
        """The transfer registers how to abort its current request (None when there is none)."""
        with self._lock:
            self._closer = closer
        if closer is not None and self._stop.is_set():
            closer()

    def check(self) -> None:
        """Raise Paused or Cancelled if asked to stop."""
        if self._reason == "cancel":
            raise Cancelled("download cancelled")
        if self._reason == "pause":
            raise Paused("download paused")

    def sleep(self, seconds: float) -> None:
        """Back-off sleep that pause or cancel cut short."""
        self._stop.wait(seconds)
        self.check()
