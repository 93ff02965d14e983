"""`--self-test`: a headless check of a build (packaged or not) through the real engine path.

Starts the worker process, loads the embedded model (converted on first use into the data
dir), generates a few greedy tokens, prints the figures and stops the worker. Exit code 0 only
when every step worked, the answer is the expected one and the worker is gone afterwards. No Qt
is imported here, so it runs on machines without a display (CI, a person checking a build).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

from .engine import kvcache

PROMPT = "What is the capital of France?"
EXPECTED = "Paris"  # SmolLM2-135M-Instruct's greedy answer (checked in tests/test_generate.py)
MODEL_REF = "embedded:default"  # app.engine.generate.DEFAULT_MODEL_REF, without importing MLX
# Tokenizer classes named by the catalog's models (tokenizer_config.json): AutoTokenizer imports
# them by name, so a packaged build must carry their modules.
TOKENIZER_CLASSES = (
    "PreTrainedTokenizerFast",  # gpt-oss, Nemotron-H, Llama 3.1
    "Qwen2Tokenizer",  # Qwen3, Qwen3-Next, Qwen3.5
    "GemmaTokenizer",  # Gemma 4
    "LlamaTokenizer",
    "GPT2Tokenizer",
)


@dataclass
class SelfTestReport:
    ok: bool = False
    step: str = "start"  # the step reached (or failed in)
    error: str = ""
    frozen: bool = False
    executable: str = ""
    platform: str = ""
    blas_preload: str = ""  # LD_PRELOAD the worker inherits (a system OpenBLAS on Linux)
    catalog_configs: int = 0  # catalog models whose config.json the build carries
    tokenizer_classes: int = 0  # of TOKENIZER_CLASSES that resolved
    worker_pid: int | None = None
    backend: str = ""
    device: str = ""
    worker_start_s: float = 0.0
    load_s: float = 0.0  # includes the first-use conversion of the embedded model
    converted_now: bool = False
    model: str = ""
    weight_bytes: int = 0
    kv_modes: list = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_tps: float = 0.0
    decode_tps: float = 0.0
    peak_memory: int = 0
    text: str = ""
    worker_stopped: bool = False
    total_s: float = 0.0
    qt_imported: bool = False

    def lines(self) -> list[str]:
        mb = 1024 * 1024
        rows = [
            ("build", f"{'frozen' if self.frozen else 'source'} · {self.executable}"),
            (
                "platform",
                self.platform + (f" · preload {self.blas_preload}" if self.blas_preload else ""),
            ),
            (
                "bundle",
                f"download stack ok · {self.catalog_configs} catalog configs · "
                f"{self.tokenizer_classes}/{len(TOKENIZER_CLASSES)} tokenizer classes",
            ),
            ("worker", f"pid {self.worker_pid} · {self.backend} · {self.device}"),
            ("worker start", f"{self.worker_start_s:.2f} s"),
            ("model", f"{self.model} · {self.weight_bytes / mb:.1f} MiB weights"),
            (
                "load",
                f"{self.load_s:.2f} s"
                + (" (converted on first use)" if self.converted_now else ""),
            ),
            ("KV modes", ", ".join(self.kv_modes)),
            ("prompt", f"{self.prompt_tokens} tokens · {self.prompt_tps:.1f} tok/s"),
            ("decode", f"{self.generated_tokens} tokens · {self.decode_tps:.1f} tok/s"),
            ("peak MLX memory", f"{self.peak_memory / mb:.1f} MiB"),
            ("answer", repr(self.text)),
            ("worker stopped", "yes" if self.worker_stopped else "NO"),
            ("total", f"{self.total_s:.2f} s"),
        ]
        out = [f"  {k:<16} {v}" for k, v in rows]
        verdict = "OK" if self.ok else f"FAILED at {self.step}: {self.error}"
        return ["RotaryQuant self-test", *out, f"self-test: {verdict}"]


def check_bundle() -> tuple[int, int]:
    """Check what the worker does not exercise here: the download stack, the catalog models'
    configs (the library sizes and plans them before a download) and their tokenizer classes.
    Returns (configs found, tokenizer classes resolved); raises naming what is missing."""
    import app.downloads.hub  # noqa: F401  (huggingface_hub, httpx)
    import app.downloads.library  # noqa: F401
    from app.downloads.catalog import load_catalog
    from app.engine.sizes import load_config

    names = [e.config for e in load_catalog() if e.config]
    for name in names:
        load_config(name)  # raises SizeError naming the config when it is not in the build
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    missing = [n for n in TOKENIZER_CLASSES if tokenizer_class_from_name(n) is None]
    if missing:
        raise RuntimeError(f"tokenizer classes missing from this build: {', '.join(missing)}")
    return len(names), len(TOKENIZER_CLASSES)


def run(max_tokens: int = 16, timeout: float = 300.0, kv_mode: str = "fp16") -> SelfTestReport:
    """Run the self-test and return its report (never raises for a failed step)."""
    from .engine import messages as M
    from .engine.embedded import default_model_path
    from .engine.worker import WorkerClient

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" notice
    t0 = time.perf_counter()
    r = SelfTestReport(
        frozen=bool(getattr(sys, "frozen", False)),
        executable=sys.executable,
        platform=f"{platform.system()} {platform.machine()} · Python {platform.python_version()}",
        blas_preload=os.environ.get("LD_PRELOAD", ""),
    )
    client = WorkerClient()
    try:
        r.step = "bundle"
        r.catalog_configs, r.tokenizer_classes = check_bundle()

        r.step = "worker start"
        t = time.perf_counter()
        ready = client.start(timeout=timeout)
        r.worker_start_s = time.perf_counter() - t
        r.worker_pid, r.backend, r.device = ready.pid, ready.backend, ready.device

        r.step = "load"
        r.converted_now = not (default_model_path() / "model.safetensors").exists()
        info = client.load(MODEL_REF, {"kv_mode": kv_mode}, timeout=timeout)
        r.load_s = float(info["load_seconds"])
        r.model = str(info["name"])
        r.weight_bytes = int(info["weight_bytes"])
        r.kv_modes = list(info["kv_modes"])

        r.step = "generate"
        settings = {"max_tokens": max_tokens, "temperature": 0.0, "kv_mode": kv_mode}
        messages = [{"role": "user", "content": PROMPT}]
        for msg in client.generate(messages, settings, timeout=timeout):
            if isinstance(msg, M.Done):
                r.prompt_tokens, r.generated_tokens = msg.prompt_tokens, msg.generated_tokens
                r.prompt_tps, r.decode_tps = msg.prompt_tps, msg.decode_tps
                r.peak_memory, r.text = msg.peak_memory, msg.text
        if r.generated_tokens <= 0:
            raise RuntimeError("the model generated no tokens")
        if EXPECTED not in r.text:
            raise RuntimeError(f"expected {EXPECTED!r} in the greedy answer, got {r.text!r}")

        r.step = "worker stop"
        proc = client.proc
        client.stop(timeout=30)
        r.worker_stopped = proc is not None and not proc.is_alive()
        if not r.worker_stopped:
            raise RuntimeError(f"the worker (pid {r.worker_pid}) is still running after stop")
        r.step, r.ok = "done", True
    except Exception as e:  # the report names the step; the exit code says it failed
        r.error = f"{type(e).__name__}: {e}"
    finally:
        client.kill()
        r.total_s = time.perf_counter() - t0
        r.qt_imported = any(m.split(".")[0] in ("PySide6", "shiboken6") for m in sys.modules)
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="RotaryQuant --self-test", description=__doc__.splitlines()[0])
    p.add_argument("--self-test", action="store_true", help="(accepted: the launcher's flag)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per step")
    p.add_argument("--kv-mode", default="fp16", help="a KV mode: " + ", ".join(kvcache.names()))
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    args = p.parse_args(argv)
    report = run(args.max_tokens, args.timeout, args.kv_mode)
    print("\n".join(report.lines()), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(asdict(report), f, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    import multiprocessing

    multiprocessing.freeze_support()
    sys.exit(main())
