"""Running the API: uvicorn on a thread (the app's worker, tests) or in the foreground (CLI)."""

from __future__ import annotations

import socket
import threading

import uvicorn

from .address import DEFAULT_HOST, DEFAULT_PORT, address
from .api import create_app
from .batcher import DEFAULT_MAX_BATCH, Batcher


class ApiServer:
    """The OpenAI/Anthropic API over one engine. `engine`: a loaded Engine, or a callable that
    loads one on the batcher's thread (the API answers 503 until it is ready). Port 0 picks a
    free port; the socket is bound here, so `port` is known before the first request."""

    def __init__(self, engine, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 api_key: str | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                 context: int | None = None, batcher: Batcher | None = None):  # fmt: skip
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
        self.sock.listen(1024)  # connections queue from now on, before uvicorn's loop runs
        self.host, self.port = host, self.sock.getsockname()[1]
        # `batcher`: one already running over `engine` (the pipeline's, one request at a time)
        self.batcher = batcher or Batcher(engine, max_batch=max_batch, context=context)
        config = uvicorn.Config(create_app(self.batcher, api_key), log_level="warning",
                                access_log=False, lifespan="off")  # fmt: skip
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return address(self.host, self.port)

    def run(self) -> None:
        """Serve in the foreground until interrupted (Ctrl+C)."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.batcher.close()

    def start(self) -> ApiServer:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        daemon=True, name="rq-api")  # fmt: skip
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.batcher.close(timeout)
        self.sock.close()
