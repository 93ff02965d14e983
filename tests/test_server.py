"""The OpenAI-compatible server on the embedded SmolLM2, driven by the official `openai` client
(and plain HTTP for what the client cannot send): endpoints, errors, continuous batching."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")  # a dev dependency (pyproject [dev])

from app.engine.generate import Engine  # noqa: E402
from app.server.run import ApiServer  # noqa: E402

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "What is the capital of France?", "Name three colours.", "What is 2 + 2?",
    "Say hello in Spanish.", "What is the largest planet?", "Write a haiku about rain.",
    "Who wrote Hamlet?", "List two fruits.",
]  # fmt: skip


@pytest.fixture(scope="module")
def engine(smollm2_path):
    eng = Engine()
    eng.load(smollm2_path)
    return eng


@pytest.fixture(scope="module")
def server(engine):
    srv = ApiServer(engine, port=0).start()
    assert srv.batcher.wait_ready(60)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    yield c
    c.close()  # its pooled sockets, else closed by the collector with a ResourceWarning


def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_idle(srv, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout  # liveness only: the batch must drain at all
    while srv.batcher.in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.batcher.in_flight() == 0


def test_models_list(client, server):
    ids = [m.id for m in client.models.list()]
    assert ids == [server.batcher.model_id] == ["SmolLM2-135M-Instruct"]


def test_chat_answers_paris_with_usage(client, server, engine):
    r = client.chat.completions.create(model=server.batcher.model_id, messages=PARIS,
                                       temperature=0, max_tokens=40)  # fmt: skip
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(engine.encode_chat(PARIS))
    ids = engine.encode_text(r.choices[0].message.content)
    assert abs(r.usage.completion_tokens - len(ids)) <= 1  # the tokens the model sampled
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_equals_non_streaming(client, server):
    kw = dict(model=server.batcher.model_id, messages=PARIS, temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks, usage, reasons = [], None, []
    for ch in client.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}):  # fmt: skip
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            chunks.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert len([c for c in chunks if c]) > 3  # streamed piece by piece
    assert "".join(chunks) == whole
    assert reasons[-1] == "stop" and usage is not None and usage.completion_tokens > 3


def test_stop_and_max_tokens(client, server):
    mid = server.batcher.model_id
    r = client.chat.completions.create(model=mid, messages=PARIS, temperature=0, max_tokens=40,
                                       stop=["Paris"])  # fmt: skip
    assert "Paris" not in r.choices[0].message.content
    assert r.choices[0].message.content.strip()  # the text before the stop string
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=mid, messages=PARIS, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=mid, messages=PARIS, temperature=0, max_tokens=40, stop="Paris", stream=True)
        if c.choices]  # fmt: skip
    assert "Paris" not in "".join(parts) and "".join(parts).strip()


def test_text_completion_and_seed(client, server):
    mid = server.batcher.model_id
    r = client.completions.create(model=mid, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)  # fmt: skip
    assert r.object == "text_completion" and r.usage.completion_tokens <= 8
    assert "Paris" in r.choices[0].text
    a, b, c = (client.completions.create(model=mid, prompt="Once upon a time", max_tokens=12,
                                         temperature=1.0, seed=s).choices[0].text
               for s in (7, 7, 8))  # fmt: skip
    assert a == b and a != c


def test_api_key_mismatch(engine):
    srv = ApiServer(engine, port=0, api_key="sekret").start()
    try:
        assert srv.batcher.wait_ready(60)
        bad = openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        good = openai.OpenAI(base_url=srv.url, api_key="sekret", max_retries=0)
        assert [m.id for m in good.models.list()] == [srv.batcher.model_id]
        bad.close()
        good.close()
    finally:
        srv.stop()


def test_prompt_over_the_context(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.batcher.model_id, max_tokens=4,
                                       messages=[{"role": "user", "content": "word " * 9000}])  # fmt: skip
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert "8192" in e.value.message  # the limit is in the message


def test_unknown_model_and_bad_json(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=PARIS)
    assert e.value.code == "model_not_found"
    status, body = _post(server.url + "/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "JSON" in body["error"]["message"]
    status, body = _post(server.url + "/chat/completions",
                         json.dumps({"model": server.batcher.model_id, "messages": PARIS,
                                     "n": 2}).encode())  # fmt: skip
    assert status == 400 and body["error"]["param"] == "n"


def test_503_while_loading(engine):
    release = threading.Event()

    def slow_load():
        release.wait(60)
        return engine

    srv = ApiServer(slow_load, port=0).start()
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.models.list()
        assert e.value.status_code == 503 and "loading" in e.value.message
        release.set()
        assert srv.batcher.wait_ready(60)
        assert [m.id for m in c.models.list()] == [srv.batcher.model_id]
        c.close()
    finally:
        release.set()
        srv.stop()


def test_anthropic_messages(server):
    body = {"model": server.batcher.model_id, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}  # fmt: skip
    status, r = _post(server.url + "/messages", json.dumps(body).encode())
    assert status == 200 and r["type"] == "message" and r["stop_reason"] == "end_turn"
    assert "Paris" in r["content"][-1]["text"] and r["usage"]["output_tokens"] > 0
    req = urllib.request.Request(server.url + "/messages", method="POST",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: ")]  # fmt: skip
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == r["content"][-1]["text"]


def _stream_text(client, mid, prompt, max_tokens=24) -> str:
    out = []
    for ch in client.chat.completions.create(
        model=mid, messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=max_tokens, stream=True,
    ):  # fmt: skip
        out.extend(c.delta.content or "" for c in ch.choices)
    return "".join(out)


def test_eight_concurrent_streams_equal_one_at_a_time(client, server):
    import mlx.core as mx

    mid = server.batcher.model_id
    alone = [_stream_text(client, mid, p) for p in PROMPTS]
    _wait_idle(server)
    mx.clear_cache()
    baseline = mx.get_active_memory()
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS))

    def run(i):
        try:
            start.wait()
            results[i] = _stream_text(client, mid, PROMPTS[i])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    stepped = server.batcher.finish_reasons.copy()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert [results[i] for i in range(len(PROMPTS))] == alone
    assert sum((server.batcher.finish_reasons - stepped).values()) == len(PROMPTS)
    assert server.batcher.max_batch_seen >= 2  # the streams shared decode steps
    _wait_idle(server)
    mx.clear_cache()
    assert mx.get_active_memory() <= baseline + (1 << 20)  # the batch's KV is all freed


def test_client_killed_mid_stream_frees_its_slot(server):
    _wait_idle(server)  # an earlier test's request leaves the count just after its answer
    before = server.batcher.finish_reasons["cancelled"]
    body = json.dumps({"model": server.batcher.model_id, "messages": PARIS, "stream": True,
                       "max_tokens": 4000, "temperature": 0.8, "seed": 1}).encode()  # fmt: skip
    host, port = "127.0.0.1", server.port
    s = socket.create_connection((host, port), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
    got = b""
    while got.count(b"data: ") < 4:
        got += s.recv(65536)
    assert server.batcher.in_flight() == 1
    s.close()  # the client goes away mid-stream
    _wait_idle(server)
    assert server.batcher.finish_reasons["cancelled"] == before + 1


def test_cli_serve_answers_the_openai_client(smollm2_path, tmp_path):
    """`rotaryquant serve --port N` with the built-in model, as a user starts it. (How soon it
    answers is a timing, measured by benchmarks/server.py; the deadline here only stops a hang.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())",
         "serve", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert re.search(rf"http://127\.0\.0\.1:{port}/v1", line), line
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 600  # a hang guard, not a speed bound
        while True:
            try:
                mid = c.models.list().data[0].id
                break
            except (openai.APIConnectionError, openai.APIStatusError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        r = c.chat.completions.create(model=mid, messages=PARIS, temperature=0, max_tokens=30)
        assert "Paris" in r.choices[0].message.content
        c.close()
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
        rest = proc.stdout.read()
        proc.stdout.close()
    # Ctrl+C ends it cleanly: the batcher thread leaves no MLX state to abort the exit on
    assert rc == 0, rest[-2000:]


def test_isoquant_requests_batch(client, server, engine, monkeypatch):
    """With the plan's KV mode isoquant3, concurrent requests share one batch of IsoQuant
    caches (BatchIsoQuantKVCache) and answer as the model does."""
    from app.engine.kvcache.isoquant import batch as kv_batch

    merged = []
    real = kv_batch.BatchIsoQuantKVCache.merge.__func__

    def spy(cls, caches):
        merged.append(len(caches))
        return real(cls, caches)

    monkeypatch.setattr(kv_batch.BatchIsoQuantKVCache, "merge", classmethod(spy))
    monkeypatch.setattr(engine, "default_kv_mode", "isoquant3")
    long_q = "Please read this. " * 30 + "What is the capital of France?"  # > the float window
    out: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(
        i, _stream_text(client, server.batcher.model_id, long_q if i % 2 else PROMPTS[0], 40)))
        for i in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(out) == 4 and all("Paris" in v for v in out.values()), out
    assert merged and max(merged) >= 2  # admitted together, merged into one batch cache
    _wait_idle(server)


def test_a_cache_without_the_batch_protocol_runs_one_at_a_time(client, server, engine, monkeypatch):
    """KV caches that cannot merge (ZipFusion today; here mlx-lm's QuantizedKVCache) are served
    one request at a time through the engine's own loop."""
    from mlx_lm.models.cache import QuantizedKVCache

    monkeypatch.setattr(engine, "make_cache", lambda settings, tokens=0: [
        QuantizedKVCache(group_size=64, bits=8) for _ in engine.loaded.model.layers])  # fmt: skip
    assert not hasattr(QuantizedKVCache, "merge")
    seen = server.batcher.max_batch_seen
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(
        _stream_text(client, server.batcher.model_id, PROMPTS[0], 30))) for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    from app.engine.generate import GenerationSettings

    with server.batcher.lock:  # the engine's own loop with the same (8-bit KV) caches
        alone = engine.generate_text([{"role": "user", "content": PROMPTS[0]}],
                                     GenerationSettings(max_tokens=30))  # fmt: skip
    assert outs == [alone, alone] and alone
    assert server.batcher.max_batch_seen == seen  # never batched
    _wait_idle(server)


def _answer(batcher, prompt: list[int], max_tokens: int = 16, **kw):
    """Submit one request (greedy unless `kw` say otherwise) to `batcher`; returns (its
    Completion, its events, done: set by its last event)."""
    from app.server.batcher import Completion, Done, Failed

    events: list = []
    done = threading.Event()

    def emit(ev):
        events.append(ev)
        if isinstance(ev, (Done, Failed)):
            done.set()

    req = Completion(prompt=prompt, max_tokens=max_tokens, emit=emit, **kw)
    batcher.submit(req)
    return req, events, done


def _text(events) -> str:
    from app.server.batcher import Delta

    return "".join(e.content for e in events if isinstance(e, Delta))


def test_requests_arriving_together_are_prefilled_together(engine, monkeypatch):
    """Requests that reach an idle batch close together (here 20 ms apart, inside the
    admission window) are prefilled in one forward pass, and answer as each does alone."""
    import mlx_lm.generate  # noqa: F401  (the module, not the function mlx_lm exports)

    from app.server.batcher import Batcher

    gen_mod = sys.modules["mlx_lm.generate"]
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
    b = Batcher(engine, max_batch=8, admit_gap=0.5, admit_wait=5.0)
    try:
        assert b.wait_ready(60)
        alone = []
        for p in prompts:
            _, events, done = _answer(b, p)
            assert done.wait(300)
            alone.append(_text(events))
        prefills: list[int] = []
        real = gen_mod.PromptProcessingBatch.prompt

        def spy(self, tokens):
            if tokens:
                prefills.append(len(tokens))
            return real(self, tokens)

        monkeypatch.setattr(gen_mod.PromptProcessingBatch, "prompt", spy)
        runs = []
        for p in prompts:
            runs.append(_answer(b, p))
            time.sleep(0.02)  # arrivals spread out, but within the window of each other
        for _, _, done in runs:
            assert done.wait(300)
        assert prefills == [4]  # one prompt forward pass for the four requests
        assert b.admitted_together[-1] == 4
        assert b.max_batch_seen == 4
        assert [_text(events) for _, events, _ in runs] == alone  # greedy fp16: unchanged
    finally:
        b.close()


def test_a_request_joining_a_running_batch_does_not_wait_for_a_window(engine):
    """The admission window applies only to an idle batch: a request arriving while others
    decode joins at the next step (with the window then far longer than the whole answer)."""
    from app.server.batcher import Batcher

    b = Batcher(engine, max_batch=3, admit_gap=0.2, admit_wait=1.0)
    try:
        assert b.wait_ready(60)
        story = [{"role": "user", "content": "Write a long story about the sea."}]
        first = [_answer(b, engine.encode_chat(story), 400) for _ in range(2)]
        while b.max_batch_seen < 2:
            time.sleep(0.01)
        b.admit_gap = b.admit_wait = 600.0  # read at each admission
        _, events, done = _answer(b, engine.encode_chat(PARIS), 2)  # joins at the next step
        running = not any(d.is_set() for _, _, d in first)
        assert done.wait(300)  # with the window applied it would wait 600 s first
        assert running  # (it did arrive while the batch was decoding)
        assert b.admitted_together[:2] == [2, 1]
        for req, _, _ in first:
            b.cancel(req)
    finally:
        b.close()


def test_zipfusion_requests_batch_through_its_pool(engine, monkeypatch):
    """With the plan's KV mode ZipFusion, concurrent requests share ZipFusion's scheduler over
    one page pool (its reference attention here): they decode together, answer as each does
    alone, a cancelled one leaves the pool at once, and the pool is freed when the batch is."""
    import mlx.core as mx

    from app.engine.kvcache import zipfusion as zf
    from app.server.batcher import Batcher, Failed

    scheds = []
    real = zf.make_scheduler

    def spy(*a, **kw):
        scheds.append(real(*a, **kw))
        return scheds[-1]

    monkeypatch.setattr(zf, "make_scheduler", spy)
    monkeypatch.setattr(engine, "default_kv_mode", "zipfusion")
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
    b = Batcher(engine, max_batch=4, context=512, admit_gap=0.5, admit_wait=5.0)
    try:
        assert b.wait_ready(60)
        mx.clear_cache()
        baseline = mx.get_active_memory()
        alone = []
        for p in prompts:
            _, events, done = _answer(b, p, 24)
            assert done.wait(300)
            alone.append(_text(events))
        assert "Paris" in alone[0]
        runs = [_answer(b, p, 24) for p in prompts]
        long_req, _, long_done = _answer(b, prompts[1], 400)
        for _, _, done in runs:
            assert done.wait(300)
        assert [_text(events) for _, events, _ in runs] == alone
        assert b.max_batch_seen == 4  # four decoded together (the fifth waited for a slot)
        # a seeded sampled request draws the same tokens alone and beside others
        seeded = []
        for n in (1, 3):
            reqs = [_answer(b, prompts[0], 16, temperature=0.9, seed=5)]
            reqs += [_answer(b, p, 16) for p in prompts[1:n]]
            for r in reqs:
                assert r[2].wait(300)
            seeded.append(_text(reqs[0][1]))
        assert seeded[0] == seeded[1] and seeded[0]
        # more KV than the pool can ever hold: a clear error for that request only
        _, events, done = _answer(b, prompts[0], 10_000)
        assert done.wait(60) and isinstance(events[-1], Failed) and events[-1].status == 400
        assert "ZipFusion pool holds" in events[-1].message
        sched = scheds[-1]
        assert sched.store.stats["pages_compressed"] > 0  # their KV went through the pool
        while not sched.running:
            time.sleep(0.01)
        b.cancel(long_req)
        assert long_done.wait(300)
        assert b.finish_reasons["cancelled"] == 1
        while b.in_flight():
            time.sleep(0.01)
        assert not sched.store.seqs and sched.store.used_bytes() == 0
        del sched, scheds[:]
        deadline = time.monotonic() + 60  # the idle batcher drops the pool
        while b._live or mx.get_active_memory() > baseline + (1 << 20):
            assert time.monotonic() < deadline
            time.sleep(0.05)
            mx.clear_cache()
    finally:
        b.close()
