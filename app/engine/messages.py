"""Typed messages between the GUI/CLI and the worker process.

Plain picklable dataclasses. This module imports neither MLX nor Qt, so the GUI process can use
it without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# -- requests (client -> worker) ----------------------------------------------------------------
@dataclass
class Load:
    path: str
    options: dict = field(default_factory=dict)  # plan/pager options, passed to the engine
    req_id: int = 0


@dataclass
class Generate:
    req_id: int
    prompt: list | str  # chat messages [{"role", "content"}], raw text, or token ids
    settings: dict = field(default_factory=dict)  # GenerationSettings fields


@dataclass
class Cancel:
    req_id: int


@dataclass
class GetStats:
    req_id: int = 0


@dataclass
class StartServing:
    """Serve the loaded model over the OpenAI-compatible API (app/server) from the worker."""

    req_id: int = 0
    host: str = "127.0.0.1"  # another address is the user's explicit choice (the UI warns)
    port: int = 8080
    api_key: str | None = None


@dataclass
class StopServing:
    req_id: int = 0


@dataclass
class Shutdown:
    pass


@dataclass
class Crash:
    """Test hook: makes the worker die hard (os._exit), as a segfault would."""

    code: int = 3


# -- replies (worker -> client) -----------------------------------------------------------------
@dataclass
class Ready:
    pid: int
    backend: str
    device: str


@dataclass
class Loaded:
    req_id: int
    info: dict  # ModelInfo fields


@dataclass
class Prompt:
    req_id: int
    prompt_tokens: int
    prompt_tps: float


@dataclass
class Token:
    req_id: int
    text: str
    token: int


@dataclass
class Done:
    req_id: int
    reason: str  # stop | length | cancelled
    prompt_tokens: int
    generated_tokens: int
    prompt_tps: float
    decode_tps: float
    peak_memory: int
    kv_bytes: int
    text: str


@dataclass
class Serving:
    """The API's state after StartServing / StopServing (or a model load while serving)."""

    req_id: int
    url: str  # the base URL clients are given ("" when not serving)
    host: str = ""
    port: int = 0
    error: str = ""


@dataclass
class Error:
    req_id: int | None  # None: not tied to a request
    kind: str  # exception class name
    message: str


@dataclass
class Stats:
    req_id: int
    time: float
    rss: int  # process resident bytes (psutil)
    mlx_active: int
    mlx_peak: int
    mlx_cache: int
    weight_bytes: int
    kv_bytes: int
    decode_tps: float
    generating: bool
    extra: dict = field(default_factory=dict)  # pager / KV-mode figures as they exist


@dataclass
class HostLost:
    """The machines a model ran over stopped: a host dropped out (the message names it). The
    worker lives on with no model loaded."""

    message: str


@dataclass
class WorkerDied:
    """Synthesised by the client when the worker process ends without a Shutdown."""

    exitcode: int | None
    message: str
    broken_pipe: bool = False  # ended over a frame one side could not read: restart it


PROTOCOL_EXIT = 70  # the worker's exit code after a frame it could not read (EX_SOFTWARE)
