"""The worker process: streamed generation, cancel, bad requests, crashes and restarts."""

import pytest

from app.engine import messages as M
from app.engine.generate import Engine, GenerationSettings, TokenEvent
from app.engine.worker import WorkerClient, WorkerError


@pytest.fixture(scope="module")
def client():
    c = WorkerClient()
    c.start()
    yield c
    c.stop()


def test_worker_matches_in_process(client, tiny_model_path):
    path = tiny_model_path("qwen2_moe")
    info = client.load(str(path))
    assert info["architecture"] == "qwen2_moe"
    msgs = list(client.generate("Hello, world!", {"max_tokens": 8}))
    kinds = [type(m).__name__ for m in msgs]
    assert kinds[0] == "Prompt" and kinds[-1] == "Done"
    worker_tokens = [m.token for m in msgs if isinstance(m, M.Token) and m.token >= 0]
    e = Engine()
    e.load(path)
    local = [
        ev.token
        for ev in e.generate("Hello, world!", GenerationSettings(max_tokens=8))
        if isinstance(ev, TokenEvent) and ev.token >= 0
    ]
    assert worker_tokens == local


def test_bad_request_keeps_worker(client, tiny_model_path, tmp_path):
    with pytest.raises(WorkerError, match="no such folder"):
        client.load(str(tmp_path / "missing"))
    with pytest.raises(WorkerError, match="max_tokens"):
        list(client.generate("hi", {"max_tokens": -5}))
    assert client.is_alive()
    client.load(str(tiny_model_path("qwen3_moe")))
    assert list(client.generate("hi", {"max_tokens": 2}))[-1].reason in ("stop", "length")


def test_cancel_mid_stream(client, smollm2_path):
    client.load(str(smollm2_path))
    rid = client.next_id()
    client.send(
        M.Generate(
            rid,
            [{"role": "user", "content": "Write a long story about a dragon."}],
            {"max_tokens": 400},
        )
    )
    tokens = 0
    done = None
    while done is None:
        m = client._wait(lambda m: getattr(m, "req_id", None) == rid, 120)
        if isinstance(m, M.Token):
            tokens += 1
            if tokens == 3:
                client.cancel(rid)
        elif isinstance(m, M.Done):
            done = m
    assert done.reason == "cancelled"
    assert 3 <= done.generated_tokens < 20  # stops within a few tokens of the request
    stats = client._wait(lambda m: isinstance(m, M.Stats) and m.req_id == rid, 30)
    assert stats.rss > 0 and stats.weight_bytes > 0 and not stats.generating


def test_crash_is_reported_and_restart_works(tiny_model_path):
    c = WorkerClient()
    c.start()
    try:
        c.load(str(tiny_model_path("qwen3_moe")))
        pid = c.pid
        c.send(M.Crash(code=7))
        with pytest.raises(WorkerError, match="exit code 7"):
            c.load(str(tiny_model_path("qwen3_moe")))
        assert not c.is_alive()
        with pytest.raises(WorkerError, match="not running"):
            c.send(M.GetStats())
        c.restart()
        assert c.pid != pid
        assert c.load(str(tiny_model_path("qwen3_moe")))["architecture"] == "qwen3_moe"
    finally:
        c.stop()
    assert not c.is_alive()


# A pickle naming a class the worker cannot import: GLOBAL, EMPTY_TUPLE, NEWOBJ, STOP.
UNIMPORTABLE = b"cno_such_module_rq\nThing\n)\x81."


@pytest.mark.parametrize("frame", [b"\x00garbage, not a pickle", UNIMPORTABLE])
def test_broken_frame_ends_the_worker_loudly(tiny_model_path, frame):
    """A frame the worker cannot read ends it with a clear reason instead of leaving a live
    process that answers nothing; a new worker then serves requests."""
    c = WorkerClient()
    c.start()
    try:
        c.load(str(tiny_model_path("qwen3_moe")))
        c.conn.send_bytes(frame)
        died = _wait_died(c)
        assert died.broken_pipe and died.exitcode == M.PROTOCOL_EXIT
        assert "could not read" in died.message
        assert not c.is_alive()
        c.restart()
        assert c.load(str(tiny_model_path("qwen3_moe")))["architecture"] == "qwen3_moe"
    finally:
        c.stop()


def _wait_died(c, timeout=60):
    import queue
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            m = c.replies.get(timeout=1)
        except queue.Empty:
            continue
        if isinstance(m, M.WorkerDied):
            return m
    raise AssertionError("no WorkerDied")


def test_broken_frame_from_the_worker_stops_it(tmp_path):
    """The client side: an unreadable reply kills the process and reports WorkerDied."""
    import multiprocessing as mp
    import time

    c = WorkerClient()
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True)
    proc.start()
    ours, theirs = mp.Pipe()
    c.proc = proc
    theirs.send_bytes(UNIMPORTABLE)
    c._reader(proc, ours)
    died = c.replies.get_nowait()
    assert isinstance(died, M.WorkerDied) and died.broken_pipe
    assert "could not be read (ModuleNotFoundError)" in died.message
    assert not proc.is_alive()


def test_token_ids_outside_the_vocabulary_keep_the_worker(client, tiny_model_path):
    client.load(str(tiny_model_path("qwen3_moe")))
    for bad in (1000, 200_000):
        with pytest.raises(WorkerError, match=f"token id {bad} .* outside the vocabulary"):
            list(client.generate([1, bad], {"max_tokens": 2}))
    assert client.is_alive()
    assert list(client.generate([1, 2], {"max_tokens": 2}))[-1].reason in ("stop", "length")


def test_worker_log_keeps_no_prompt_text_and_is_private(client):
    import logging.handlers
    import os
    import stat

    from app import paths
    from app.engine.worker import LOG_BACKUPS, _PrivateLog, describe

    secret = "my bank PIN is 4921"
    with pytest.raises(WorkerError, match="max_tokens"):
        list(client.generate([{"role": "user", "content": secret}], {"max_tokens": -5}))
    with pytest.raises(WorkerError, match="max_tokens"):
        list(client.generate(secret, {"max_tokens": -5}))
    client.send(M.GetStats())  # answered after the requests above: their lines are written
    client._wait(lambda m: isinstance(m, M.Stats), 60)
    log = paths.log_dir() / "worker.log"
    text = log.read_text()
    assert "request failed: Generate #" in text and "1 messages" in text
    assert "PIN" not in text and "4921" not in text
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    assert describe(M.Generate(3, [5, 6, 7], {})) == "Generate #3 (3 token ids, settings [])"
    assert describe(M.Generate(4, 5, None)) == "Generate #4 (a int, settings ?)"
    with pytest.raises(WorkerError, match="a prompt is text|no model loaded"):
        list(client.generate(12345))  # a request the log cannot measure still gets its answer
    assert client.is_alive()
    assert LOG_BACKUPS >= 1 and issubclass(_PrivateLog, logging.handlers.RotatingFileHandler)


def test_worker_log_rotates_privately(tmp_path):
    import logging
    import os
    import stat

    from app.engine.worker import _PrivateLog

    h = _PrivateLog(tmp_path / "w.log", maxBytes=200, backupCount=2)
    lg = logging.getLogger("rq-test-rotation")
    lg.addHandler(h)
    for i in range(50):
        lg.warning("line %d of the log, long enough to rotate", i)
    h.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["w.log", "w.log.1", "w.log.2"]
    assert all(stat.S_IMODE(os.stat(tmp_path / f).st_mode) == 0o600 for f in files)
