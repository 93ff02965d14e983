"""Background work for the GUI thread: one task at a time per runner, results as signals.

Planner runs, library scans and folder removal take from milliseconds to seconds; running them
here keeps the window responsive. Tasks are plain callables that never touch widgets; their
result (or exception) comes back through queued signals in the GUI thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal


@dataclass
class Task:
    name: str
    fn: Callable[[], object]
    on_result: Callable[[object], None] | None = None
    on_error: Callable[[BaseException], None] | None = None
    result: object = None
    error: BaseException | None = field(default=None, repr=False)


class TaskRunner(QObject):
    started = Signal(str)
    returned = Signal(str, object)
    errored = Signal(str, object)  # name, exception
    finished = Signal(str)
    idle = Signal()
    _done = Signal(object)  # emitted on the task's thread, delivered queued in the GUI thread

    def __init__(self, parent=None, name: str = "tasks"):
        super().__init__(parent)
        self.name = name
        self.pending: deque[Task] = deque()
        self.running: Task | None = None
        self._done.connect(self._finish)

    def submit(
        self,
        name: str,
        fn: Callable[[], object],
        on_result=None,
        on_error=None,
        replace: bool = True,
    ) -> None:
        """Queue `fn`; with `replace`, a queued task of the same name is dropped (latest wins:
        a plan asked for twice is computed once)."""
        if replace:
            self.pending = deque(t for t in self.pending if t.name != name)
        self.pending.append(Task(name, fn, on_result, on_error))
        if self.running is None:
            self._next()

    def busy(self) -> bool:
        return self.running is not None or bool(self.pending)

    def _next(self) -> None:
        if not self.pending:
            self.running = None
            self.idle.emit()
            return
        task = self.running = self.pending.popleft()
        self.started.emit(task.name)

        def run():
            try:
                task.result = task.fn()
            except BaseException as e:  # reported through the signal, never lost on the thread
                task.error = e
            try:
                self._done.emit(task)
            except RuntimeError:  # the runner's window was closed meanwhile: no one to tell
                pass

        threading.Thread(target=run, name=f"{self.name}: {task.name}", daemon=True).start()

    def _finish(self, task: Task) -> None:
        if task.error is not None:
            if task.on_error:
                task.on_error(task.error)
            self.errored.emit(task.name, task.error)
        else:
            if task.on_result:
                task.on_result(task.result)
            self.returned.emit(task.name, task.result)
        self.finished.emit(task.name)
        self._next()
