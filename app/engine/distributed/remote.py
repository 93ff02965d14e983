"""The app's engine when the model runs over several machines.

The engine worker (worker.py) cannot itself be a rank: mlx.launch starts every rank. So it
starts `rotaryquant serve --hosts`'s ranks (serve.py) with mlx.launch, rank 0 listening with a
random key, and generates through rank 0's API: the same events as `Engine.generate`, from the
server's stream. The window's messages do not change; a lost host reaches it as an `Error` for
the answer in flight (the server's 503, naming the host) and as `on_lost(message)` once the
ranks have ended.

The ranks run in the worker's process group: the window's client ends the group with the
worker (worker.py), so no rank outlives the app on this machine; rank 0 ends the session when
it reads `quit` on stdin.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import EngineError
from .hosts import load_hosts

READY_TIMEOUT_S = 1800.0  # every rank loads its layers (a large model from disk: minutes)
READ_TIMEOUT_S = 600.0  # one streamed token (rank 0's watchdog ends a stuck step before that)
QUIT_WAIT_S = 30.0


class HostLost(EngineError):
    """A host of the pipeline dropped out (the message names it)."""


def _is_local(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "localhost")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _app_root() -> str:
    return str(Path(__file__).resolve().parents[3])


class RemoteEngine:
    """Engine-like (load, generate, info, unload) over ranks started with mlx.launch."""

    loaded = None  # no model in this process
    last_cache = None

    def __init__(self, on_lost: Callable[[str], None] | None = None):
        self.on_lost = on_lost
        self.info = None
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.key = ""
        self.lines: deque[str] = deque(maxlen=400)  # the ranks' output (errors name hosts)
        self._ready = threading.Event()
        self._closing = False

    # -- starting and stopping ---------------------------------------------------------------
    def load(self, path, options: dict):
        from ..generate import ModelInfo
        from ..loader import check_folder
        from .commands import serve_rank_args
        from .launch import free_port_base, launch_argv

        self.unload()
        if str(path) == "embedded:default":  # generate.DEFAULT_MODEL_REF
            from ..embedded import ensure_default_model

            path = ensure_default_model()  # at the same path on every host, as any model
        hosts = load_hosts(options["hosts"])
        config, _ = check_folder(Path(path))
        ip0 = hosts.hosts[0].ips[0] if hosts.hosts[0].ips else "127.0.0.1"
        local = all(_is_local(ip) for h in hosts.hosts for ip in h.ips)
        listen = "127.0.0.1" if _is_local(ip0) else ip0
        port = int(options.get("port") or (_free_port("127.0.0.1") if local else 8090))
        self.key = secrets.token_urlsafe(24)
        budgets = options.get("expert_budget")
        ranks = serve_rank_args(
            str(path),
            str(hosts.path),
            host=listen,
            port=port,
            kv_mode=options.get("kv_mode") or "fp16",
            context=options.get("context"),
            split=options.get("split"),
            budgets=budgets if isinstance(budgets, list) and any(budgets) else None,
            api_key=True,
        )
        argv = launch_argv(
            ranks,
            hostfile=str(hosts.path),
            backend=hosts.backend,
            port=free_port_base(len(hosts)) if local else None,
            python=options.get("python") or sys.executable,
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_app_root(), env.get("PYTHONPATH")) if p)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        t0 = time.perf_counter()
        self._ready.clear()
        self._closing = False
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.proc.stdin.write(self.key + "\n")
        self.proc.stdin.flush()
        threading.Thread(
            target=self._watch, args=(self.proc,), daemon=True, name="rq-ranks"
        ).start()
        deadline = time.monotonic() + float(options.get("ready_timeout", READY_TIMEOUT_S))
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = self.failure() or "they did not start in time"
                self.unload()
                raise EngineError(f"the model did not start over the machines: {why}")
        labels = [hosts.label(r) for r in range(len(hosts))]
        self.info = ModelInfo(
            path=str(path),
            name=Path(path).name,
            architecture=str(config.get("model_type", "")),
            num_layers=int(config.get("num_hidden_layers") or 0),
            weight_bytes=0,  # on the machines, not here
            kv_modes=[options.get("kv_mode") or "fp16"],
            backend=f"{len(hosts)} machines ({hosts.backend})",
            load_seconds=time.perf_counter() - t0,
            extra={"hosts": labels, "split": options.get("split"), "url": self.url},
        )
        return self.info

    def _watch(self, proc: subprocess.Popen) -> None:
        """Read the ranks' output; tell `on_lost` when they end without being asked to."""
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("serving on "):
                self.url = line.split()[2]
            elif line.startswith("ready:"):
                self._ready.set()
        code = proc.wait()
        if not self._closing and proc is self.proc and self._ready.is_set():
            self.info = None
            if self.on_lost is not None:
                self.on_lost(self.failure() or f"the machines stopped (status {code})")

    def failure(self) -> str:
        """The ranks' own report of what ended them: the lost host if one was named."""
        lines = [ln.strip() for ln in self.lines]
        for key in ("lost rank", "error:"):
            hit = [ln for ln in lines if key in ln]
            if hit:
                text = hit[0]
                return text[text.index("error:") + 6 :].strip() if "error:" in text else text
        return lines[-1] if lines else ""

    def unload(self) -> None:
        """End the ranks: rank 0 reads `quit`, tells the others and every rank exits."""
        proc, self.proc = self.proc, None
        self.info = None
        self._closing = True
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(QUIT_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if proc.stdin:
                proc.stdin.close()

    close = unload

    # -- generating ----------------------------------------------------------------------------
    def generate(self, prompt, settings=None, should_stop: Callable[[], bool] = lambda: False):
        """Events as `Engine.generate`'s (token ids are not sent by the API: -1)."""
        from ..generate import Finished, GenerationSettings, PromptProcessed, TokenEvent

        if self.info is None or not self.url:
            raise EngineError("no model is running over the machines")
        s = settings or GenerationSettings()
        body = {
            "model": self.info.name,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if s.max_tokens > 0:
            body["max_tokens"] = s.max_tokens
        if s.seed is not None:
            body["seed"] = s.seed
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            route, body["messages"] = "/chat/completions", prompt
        else:
            route, body["prompt"] = "/completions", prompt
        t0 = time.perf_counter()
        t_first = None
        n, usage, reason, text, thinking = 0, {}, "length", [], False
        events = self._stream(route, body)
        try:
            for chunk in events:
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    piece = ""
                    if delta.get("reasoning_content"):
                        piece += ("" if thinking else "<think>") + delta["reasoning_content"]
                        thinking = True
                    content = delta.get("content", choice.get("text")) or ""
                    if content:
                        piece += ("</think>" if thinking else "") + content
                        thinking = False
                    if piece:
                        if t_first is None:
                            t_first = time.perf_counter()
                            yield PromptProcessed(0, 0.0)
                        n += 1
                        text.append(piece)
                        yield TokenEvent(piece, -1)
                    if choice.get("finish_reason"):
                        reason = choice["finish_reason"]
                if should_stop():
                    reason = "cancelled"
                    break
        finally:
            events.close()  # closing the connection cancels the request on rank 0
        now = time.perf_counter()
        pt = int(usage.get("prompt_tokens", 0))
        gen = int(usage.get("completion_tokens", n))
        prompt_s = (t_first or now) - t0
        yield Finished(
            reason=reason,
            prompt_tokens=pt,
            generated_tokens=gen,
            prompt_tps=pt / prompt_s if pt and prompt_s > 0 else 0.0,
            decode_tps=(gen - 1) / (now - t_first)
            if t_first and gen > 1 and now > t_first
            else 0.0,
            peak_memory=0,
            kv_bytes=0,
            text="".join(text),
        )

    def _stream(self, route: str, body: dict) -> Iterator[dict]:
        u = urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=READ_TIMEOUT_S)
        try:
            try:
                conn.request(
                    "POST",
                    u.path + route,
                    json.dumps(body),
                    {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
                )
                resp = conn.getresponse()
            except OSError as e:
                raise self._gone(f"rank 0 does not answer ({e})") from e
            if resp.status != 200:
                try:
                    err = json.loads(resp.read()).get("error") or {}
                except (ValueError, OSError):
                    err = {}
                message = err.get("message") or f"HTTP {resp.status}"
                if resp.status == 503:
                    raise HostLost(message)
                raise EngineError(message)
            while True:
                try:
                    line = resp.readline()
                except OSError as e:
                    raise self._gone(f"the connection to rank 0 broke ({e})") from e
                if not line:
                    raise self._gone("rank 0 ended the answer early")
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if chunk.get("error"):
                    err = chunk["error"]
                    cls = HostLost if err.get("code") == "host_lost" else EngineError
                    raise cls(err.get("message") or "the machines failed")
                yield chunk
        finally:
            conn.close()

    def _gone(self, what: str) -> HostLost:
        """Rank 0 stopped answering: the ranks' report if they have one yet."""
        deadline = time.monotonic() + 5.0  # the ranks print who was lost as they end
        while self.proc is not None and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return HostLost(self.failure() or what)
