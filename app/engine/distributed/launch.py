"""The mlx.launch command that starts one rank process per host (`rotaryquant chat --hosts`)."""

from __future__ import annotations

import socket
import sys

RANK_MODULE = "app.engine.distributed.rank"
# mlx.launch's entry point, run by this interpreter (a console script may not be on PATH)
_LAUNCHER = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"


def free_port_base(n: int, lo: int = 20000, hi: int = 60000) -> int:
    """A base port with `n` free ports after it on 127.0.0.1 (the ring listens on base+rank;
    a fixed port would collide with another job on the same machine)."""
    import random

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, hi - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in {lo}-{hi}")


def launch_argv(
    rank_args: list[str],
    *,
    hostfile: str | None = None,
    ranks: int | None = None,
    backend: str | None = None,
    python: str | None = None,
    port: int | None = None,
) -> list[str]:
    """argv for mlx.launch running `python -m app.engine.distributed.rank RANK_ARGS` on every
    host of `hostfile` (mlx's format; ours adds keys it ignores), or on `ranks` local processes
    over loopback when no hostfile is given."""
    python = python or sys.executable
    argv = [sys.executable, "-c", _LAUNCHER]
    if hostfile:
        argv += ["--hostfile", str(hostfile)]
    else:
        n = int(ranks or 1)
        argv += ["--hosts", "127.0.0.1", "-n", str(n)]
        port = port or free_port_base(n)
    if backend:
        argv += ["--backend", backend]
    if port:
        argv += ["--starting-port", str(port)]
    argv += ["--python", python, "--", "-m", RANK_MODULE, *rank_args]
    return argv
