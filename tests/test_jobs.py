"""Jobs in a process of their own (app/engine/jobs.py): progress events, results and
exceptions come back; a child that dies raises JobCrashed and the next call starts a new one."""

from __future__ import annotations

import os

import pytest

from app.downloads.errors import LibraryError
from app.engine import jobs


def count(n: int, emit=None) -> int:
    for i in range(n):
        emit(("step", i))
    return os.getpid()


def refuse(emit=None):
    raise LibraryError("no model named 'x' in the library")


class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def odd_error(emit=None):
    raise Unpicklable(1, 2)


def die(emit=None):
    emit("about to die")
    os._exit(9)


def test_events_result_and_errors_come_back():
    p = jobs.JobProcess("test-job")
    try:
        events = []
        pid = p.call(count, 3, on_event=events.append)
        assert events == [("step", 0), ("step", 1), ("step", 2)]
        assert pid == p.pid and pid != os.getpid()
        with pytest.raises(LibraryError, match="no model named"):
            p.call(refuse)
        with pytest.raises(jobs.JobError, match="Unpicklable: 1 and 2"):
            p.call(odd_error)
        assert p.call(count, 0) == pid  # errors do not cost the process
    finally:
        p.close()


def test_a_dead_child_is_reported_and_replaced():
    p = jobs.JobProcess("test-job")
    try:
        first = p.call(count, 0)
        events = []
        with pytest.raises(
            jobs.JobCrashed, match="test-job process stopped unexpectedly .exit code 9"
        ):
            p.call(die, on_event=events.append)
        assert events == ["about to die"]
        assert p.call(count, 0) not in (first, None)
    finally:
        p.close()


def test_run_once_ends_its_process():
    import psutil

    pid = jobs.run_once(count, 1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
