"""The mlx.launch command that starts one rank process per host (`rotaryquant chat --hosts`,
`rotaryquant serve --hosts`, the app's worker) and the status it ends with."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading

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


EXIT_PEER_LOST = 3  # a rank's status when it lost another (rank.py)
_NODE_EXIT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")


def exit_status(codes: dict[int, int]) -> int:
    """The launch's status from its ranks' (mlx.launch itself always ends with 0): a lost
    host's 3 first, then the first rank's error, 0 when every rank ended cleanly."""
    bad = [c for _, c in sorted(codes.items()) if c != 0]
    if not bad:
        return 0
    if EXIT_PEER_LOST in bad:
        return EXIT_PEER_LOST
    return bad[0] if bad[0] > 0 else 1


def run_launch(argv: list[str], stdin_text: str | None = None, terminal: bool = False) -> int:
    """Run mlx.launch's `argv` in the foreground: the ranks' output passes through, and the
    status is the ranks' (exit_status). `terminal`: the ranks read this terminal (chat); else
    `stdin_text` goes to every rank's stdin, which stays open (mlx.launch spins on a closed
    one). Ctrl+C reaches the ranks, which end the session; this process waits for them."""
    p = subprocess.Popen(
        argv, stdin=None if terminal else subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    main = threading.current_thread() is threading.main_thread()
    # set after the exec, so the child keeps the default handler
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    codes: dict[int, int] = {}
    try:
        if stdin_text and p.stdin is not None:
            p.stdin.write(stdin_text)
            p.stdin.flush()
        for line in p.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            m = _NODE_EXIT.search(line)
            if m:
                codes[int(m.group(1))] = int(m.group(2)) if m.group(2) else -9
        p.wait()
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stdin is not None:
            p.stdin.close()
    return exit_status(codes) or (p.returncode if p.returncode and p.returncode > 0 else 0)
