"""Downloads on background threads for the GUI: one thread per download, events by callback.

The GUI wraps `on_event` in a signal (callbacks run on the download's thread). Pause and cancel
are cooperative and safe from any thread; a paused download is resumed by `start` again,
which continues from its partial files — the same path as after a restart of the app.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .control import Control
from .errors import Cancelled, LibraryError, Paused
from .events import Callback
from .library import Library
from .store import LibraryEntry


@dataclass
class Job:
    repo: str
    control: Control = field(default_factory=Control)
    thread: threading.Thread | None = None
    result: LibraryEntry | None = None
    error: BaseException | None = None
    outcome: str = "running"  # running, done, paused, cancelled, failed
    finished: threading.Event = field(default_factory=threading.Event)

    def pause(self) -> None:
        self.control.pause()

    def cancel(self, remove_partial: bool = False) -> None:
        self.control.cancel(remove_partial)

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)


class DownloadManager:
    def __init__(self, library: Library | None = None, on_event: Callback | None = None):
        self.library = library or Library()
        self.on_event = on_event
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def start(self, repo: str, on_event: Callback | None = None, **options) -> Job:
        """Start (or resume) downloading `repo` on a new thread; options as Library.download."""
        key = repo.lower()
        with self._lock:
            old = self._jobs.get(key)
            if old is not None and not old.finished.is_set():
                raise LibraryError(f"{repo} is already downloading")
            job = Job(repo)
            self._jobs[key] = job
        cb = on_event or self.on_event

        def run() -> None:
            try:
                job.result = self.library.download(
                    repo, control=job.control, on_event=cb, **options
                )
                job.outcome = "done"
            except Paused as e:
                job.error, job.outcome = e, "paused"
            except Cancelled as e:
                job.error, job.outcome = e, "cancelled"
            except BaseException as e:  # reported through the job; the thread must not die loudly
                job.error, job.outcome = e, "failed"
            finally:
                job.finished.set()

        job.thread = threading.Thread(target=run, name=f"download {repo}", daemon=True)
        job.thread.start()
        return job

    def resume(self, name: str, on_event: Callback | None = None, **options) -> Job:
        """Continue a paused download from the library (after a pause or an app restart)."""
        return self.start(self.library.get(name).repo, on_event, **options)

    def job(self, repo: str) -> Job | None:
        return self._jobs.get(repo.lower())

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def pause(self, repo: str) -> None:
        j = self.job(repo)
        if j is not None:
            j.pause()

    def cancel(self, repo: str, remove_partial: bool = False) -> None:
        j = self.job(repo)
        if j is not None:
            j.cancel(remove_partial)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Pause every running download (partial files kept) and wait for the threads."""
        for j in self.jobs():
            j.pause()
        for j in self.jobs():
            j.wait(timeout)
