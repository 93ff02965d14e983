"""`rotaryquant serve --hosts`: the OpenAI-compatible API over a model split across ranks.

Two local ranks (mlx.launch, ring over loopback) on the embedded SmolLM2 answer the official
`openai` client as the single-process server does (greedy); requests queue first come first
served; a killed rank gives HTTP 503 naming its host and the server ends with status 3. The
protocol's pieces (broadcast, the per-token agreement, the FIFO batcher, the launch status) are
also checked in one process, where the group has one rank.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")  # a dev dependency (pyproject [dev])

from app.engine.distributed.commands import serve_rank_args  # noqa: E402
from app.engine.distributed.launch import exit_status  # noqa: E402
from app.engine.generate import Engine  # noqa: E402
from app.server.run import ApiServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is the capital of France?", "Name three colours."]
MAX_TOKENS = 24


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OPENBLAS_NUM_THREADS"] = "1"  # two ranks on two shared cores
    return env


def _ask(client, model: str, q: str, stream: bool = False) -> str:
    msgs = [{"role": "user", "content": q}]
    kw = dict(model=model, messages=msgs, temperature=0, max_tokens=MAX_TOKENS)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    parts = []
    for ch in client.chat.completions.create(**kw, stream=True):
        parts.extend(c.delta.content or "" for c in ch.choices)
    return "".join(parts)


@pytest.fixture(scope="module")
def single(smollm2_path):
    """The one-process server's greedy answers (its batching path)."""
    eng = Engine()
    eng.load(smollm2_path)
    srv = ApiServer(eng, port=0).start()
    try:
        assert srv.batcher.wait_ready(120)
        with openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0) as c:
            yield {q: _ask(c, srv.batcher.model_id, q) for q in QUESTIONS}
    finally:
        srv.stop()


# -- in one process: the group has one rank ------------------------------------------------------
class _Watchdog:
    def __init__(self):
        self.armed = 0
        self.ended: list[str] = []

    def arm(self):
        self.armed += 1

    beat = arm

    def disarm(self):
        pass

    def close(self):
        pass

    def end(self, cause):  # the real one ends the process
        self.ended.append(cause)


def test_broadcast_and_agreement_on_one_rank():
    import mlx.core as mx

    from app.engine.distributed.serve import Agreement, broadcast_json, request_settings
    from app.server.batcher import Completion

    g = mx.distributed.init()
    assert g.size() == 1
    obj = {"ids": [1, 2, 65000], "settings": {"temperature": 0.7, "text": "héllo"}}
    assert broadcast_json(obj, g) == obj
    assert broadcast_json(None, g) is None  # the end of the session
    # rank 0's answer, one call late: the step in flight is never waited for
    a = Agreement(g)
    assert [a(True), a(False), a(False), a(True), a(True)] == [False, True, False, False, True]
    # sampling without a seed gets one drawn by rank 0 (every rank must draw the same tokens)
    s = request_settings(Completion([1], 8, lambda e: None, temperature=0.8))
    assert isinstance(s["seed"], int)
    assert request_settings(Completion([1], 8, lambda e: None))["seed"] is None
    assert request_settings(Completion([1], 8, lambda e: None, 0.8, seed=5))["seed"] == 5


def test_pipeline_batcher_answers_in_order_and_fails_with_the_host(smollm2_path, single):
    """PipelineBatcher over a one-rank stage: the single server's answers, requests one at a
    time in arrival order; fail() (a lost host) ends queued requests with 503 naming it."""
    import mlx.core as mx

    from app.engine.distributed.engine import StageEngine
    from app.engine.distributed.serve import PipelineBatcher

    eng = StageEngine(mx.distributed.init())
    eng.load(smollm2_path)
    b = PipelineBatcher(eng, eng.group, _Watchdog())
    srv = ApiServer(None, port=0, batcher=b).start()
    try:
        assert b.wait_ready(120)
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
        mid = b.model_id
        assert _ask(c, mid, QUESTIONS[0], stream=True) == single[QUESTIONS[0]]
        # three at once: answered one at a time, in the order they came
        order: list[int] = []
        real = b._run_one

        def spy(req):
            order.append(len(req.prompt))
            return real(req)

        b._run_one = spy
        submitted: list = []
        real_submit = b.submit
        b.submit = lambda req: (submitted.append(req), real_submit(req))
        done: dict[int, str] = {}
        qs = [QUESTIONS[1], "Hi", QUESTIONS[0] + " Answer briefly."]
        threads = []
        for i, q in enumerate(qs):
            t = threading.Thread(target=lambda i=i, q=q: done.__setitem__(i, _ask(c, mid, q)))
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 60  # hang guard: the request reaches the queue
            while len(submitted) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        for t in threads:
            t.join(300)
        assert done[0] == single[QUESTIONS[1]]
        assert order == [len(eng.encode_chat([{"role": "user", "content": q}])) for q in qs]
        assert b.max_batch_seen == 0  # never a batch
        # a lost host: queued requests and new ones get 503 with its name. The earlier
        # requests leave the in-flight count just after their answers: wait for that first.
        deadline = time.monotonic() + 60
        while b.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.in_flight() == 0
        with b.lock:  # holds the batcher between requests: the next one stays queued
            failed: queue.Queue = queue.Queue()

            def queued():
                try:
                    _ask(c, mid, "Hi")
                except openai.APIStatusError as e:
                    failed.put(e)

            t = threading.Thread(target=queued)
            t.start()
            deadline = time.monotonic() + 60
            while b.in_flight() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            b.fail("rank 0 (mac-a): lost rank 1 on host mac-b: its connection closed")
            t.join(60)
        e = failed.get(timeout=1)
        assert e.status_code == 503 and "mac-b" in e.message and e.code == "host_lost"
        with pytest.raises(openai.APIStatusError) as e2:
            c.models.list()
        assert e2.value.status_code == 503 and "lost rank 1 on host mac-b" in e2.value.message
        # a request that passed the API's check before the loss and is queued after fail()
        # drained the queue is answered at once, not left for the closing port
        from app.server.batcher import Completion

        late: list = []
        b.submit(Completion([1, 2, 3], 4, late.append))
        assert [(ev.status, ev.code) for ev in late] == [(503, "host_lost")]
        assert "mac-b" in late[0].message
    finally:
        srv.stop()


def test_launch_status_and_rank_arguments():
    assert exit_status({}) == 0 and exit_status({0: 0, 1: 0}) == 0
    assert exit_status({0: 3, 1: -9}) == 3  # a lost host, whatever killed it
    assert exit_status({0: 0, 1: 2}) == 2 and exit_status({1: -15}) == 1
    args = serve_rank_args("/m", "h.json", host="127.0.0.1", port=9, split=[2, 3], api_key=True)
    assert args[:2] == ["/m", "--serve"] and "--api-key-stdin" in args
    assert args[args.index("--split") + 1] == "2,3" and args[args.index("--port") + 1] == "9"


# -- two ranks -----------------------------------------------------------------------------------
def _hosts(path: Path) -> Path:
    hosts = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "name": n, "ram": "32GB"}
             for n in ("mac-a", "mac-b")]  # fmt: skip
    path.write_text(json.dumps({"backend": "ring", "hosts": hosts}))
    return path


def _rank_pid(proc, rank: int) -> int:
    import psutil

    pid = proc if isinstance(proc, int) else proc.pid
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "app.engine.distributed.rank" in " ".join(p.cmdline()):
                if p.environ().get("MLX_RANK") == str(rank):
                    return p.pid
        except psutil.Error:
            continue
    raise AssertionError(f"rank {rank} not found")


@pytest.mark.slow
def test_serve_over_two_ranks_answers_as_one_process_and_names_a_lost_host(
    smollm2_path, single, tmp_path
):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hosts = _hosts(tmp_path / "hosts.json")
    argv = [sys.executable, "-m", "app.cli", "serve", "--hosts", str(hosts), "--port", str(port)]
    argv += ["--model", str(smollm2_path)]
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line, line + "".join(err_lines)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 600  # a hang guard, not a speed bound
        while True:
            try:
                mid = c.models.list().data[0].id
                break
            except (openai.APIConnectionError, openai.APIStatusError):
                assert proc.poll() is None, "".join(err_lines)[-3000:]
                assert time.monotonic() < deadline, "".join(err_lines)[-3000:]
                time.sleep(0.5)
        assert mid == "SmolLM2-135M-Instruct"
        assert "split [15, 15]" in proc.stdout.readline()
        for q in QUESTIONS:
            assert _ask(c, mid, q) == single[q], q
        assert _ask(c, mid, QUESTIONS[0], stream=True) == single[QUESTIONS[0]]

        # rank 1 killed in the middle of a long answer, with another request queued behind it
        events: queue.Queue = queue.Queue()

        def long_stream():
            try:
                for ch in c.chat.completions.create(
                    model=mid, messages=[{"role": "user", "content": "Write a long story."}],
                    temperature=0, max_tokens=4000, stream=True,
                ):  # fmt: skip
                    if ch.choices and ch.choices[0].delta.content:
                        events.put("token")
                events.put("finished")
            except openai.APIError as e:
                events.put(e)

        def queued():
            try:
                events.put(("queued", _ask(c, mid, "Hi")))
            except openai.APIError as e:  # a dropped connection is reported, not a hang
                events.put(("queued", e))

        threading.Thread(target=long_stream, daemon=True).start()
        for _ in range(3):
            assert events.get(timeout=300) == "token"
        threading.Thread(target=queued, daemon=True).start()
        time.sleep(1.0)  # the queued request reaches the server
        os.kill(_rank_pid(proc, 1), 9)
        got = []
        while len(got) < 2:
            ev = events.get(timeout=60)  # hang guard
            if ev != "token":
                got.append(ev)
        stream_err = next(e for e in got if isinstance(e, openai.APIError))
        (_, queued_err) = next(e for e in got if isinstance(e, tuple))
        assert "lost rank 1 on host mac-b" in stream_err.message
        assert isinstance(queued_err, openai.APIStatusError), queued_err
        assert queued_err.status_code == 503 and "mac-b" in queued_err.message
        rc = proc.wait(60)  # hang guard: it ends by itself after telling its clients
        reader.join(10)
        err = "".join(err_lines)
        assert rc == 3, err[-3000:]
        assert "error: rank 0 (mac-a): lost rank 1 on host mac-b" in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.slow
def test_the_app_worker_runs_the_model_over_two_ranks_and_outlives_a_lost_host(
    smollm2_path, single, tmp_path
):
    """The window's engine worker with Load(hosts=...): the ranks start from it, its Generate
    streams the distributed server's answer; a killed rank fails the answer in flight with the
    host's name, HostLost follows, and the same worker loads the model on this machine."""
    from app.engine import messages as M
    from app.engine.worker import WorkerClient

    hosts = str(_hosts(tmp_path / "hosts.json"))
    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    settings = {"max_tokens": MAX_TOKENS, "temperature": 0}
    with WorkerClient(env={"OPENBLAS_NUM_THREADS": "1"}) as c:
        info = c.load(smollm2_path, {"hosts": hosts}, timeout=900)
        assert info["backend"] == "2 machines (ring)"
        assert info["extra"]["hosts"] == ["mac-a", "mac-b"]
        out = list(c.generate(msgs, settings))
        done = out[-1]
        assert isinstance(done, M.Done) and done.text == single[QUESTIONS[0]]
        assert "".join(m.text for m in out if isinstance(m, M.Token)) == done.text
        assert done.prompt_tokens > 0 and done.generated_tokens > 0

        rid = c.next_id()
        story = [{"role": "user", "content": "Write a long story."}]
        c.send(M.Generate(rid, story, {"max_tokens": 4000, "temperature": 0}))
        tokens = 0
        while tokens < 3:
            m = c.replies.get(timeout=300)  # hang guard
            tokens += isinstance(m, M.Token) and m.req_id == rid
        os.kill(_rank_pid(c.pid, 1), 9)
        error = lost = None
        while error is None or lost is None:
            m = c.replies.get(timeout=120)  # hang guard
            if isinstance(m, M.Error) and m.req_id == rid:
                error = m
            elif isinstance(m, M.HostLost):
                lost = m
            assert not isinstance(m, M.WorkerDied), m
        assert error.kind == "HostLost" and "lost rank 1 on host mac-b" in error.message
        assert "mac-b" in lost.message
        assert c.is_alive()
        info = c.load(smollm2_path, {"plan": True}, timeout=600)  # on this machine alone
        assert "machines" not in info["backend"]
        out = list(c.generate(msgs, settings))
        assert out[-1].text == single[QUESTIONS[0]]
