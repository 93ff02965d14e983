"""Guarantees that held under deliberate faults and must keep holding: acknowledged chat commits
survive kill -9, chat templates stay sandboxed, a model's own code never runs, the engine
listens on no socket, and `remove` deletes nothing outside the library."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.engine.prompts import PromptError, render_chat
from app.engine.testing.random_models import make_random_model

WRITER = """
import sys
from app.ui.history import ConversationStore
s = ConversationStore(sys.argv[1])
c = s.create("kill test")
i = 0
while True:
    m = s.add_message(c.id, "user", f"message {i}")
    print(m.id, flush=True)  # acknowledged: committed before this line is written
    i += 1
"""


@pytest.mark.parametrize("round_", range(3))
def test_kill_9_during_chat_writes_loses_no_acknowledged_commit(tmp_path, round_):
    from app.ui.history import ConversationStore

    path = tmp_path / "h.sqlite3"
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    acked = []
    for line in p.stdout:
        acked.append(int(line))
        if len(acked) >= 50 + 37 * round_:  # a different point of the write loop each round
            break
    p.send_signal(signal.SIGKILL)
    acked += [int(x) for x in p.stdout.read().split()]
    p.stdout.close()
    p.wait()
    assert p.returncode == -signal.SIGKILL
    s = ConversationStore(path)
    (conv,) = s.conversations()
    kept = {m.id for m in s.messages(conv.id)}
    assert set(acked) <= kept and s.set_aside is None


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('touch /tmp/rq-pwned') }}",
        "{% for m in messages %}{{ m.__class__.__base__.__subclasses__() }}{% endfor %}",
    ],
)
def test_chat_templates_stay_sandboxed(tiny_model_path, template):
    from app.engine.loader import load

    tok = load(tiny_model_path("qwen3_moe"), lazy=True).tokenizer
    tok._tokenizer.chat_template = template
    with pytest.raises(PromptError, match="chat template failed"):
        render_chat(tok, [{"role": "user", "content": "hi"}])
    assert not Path("/tmp/rq-pwned").exists()


def test_a_models_own_code_never_runs(tmp_path):
    from app.engine.generate import Engine, GenerationSettings

    m = make_random_model("qwen3_moe", tmp_path / "m")
    marker = tmp_path / "code-ran"
    for f in ("modeling_evil.py", "tokenization_evil.py", "configuration_evil.py"):
        (m / f).write_text(f"open({str(marker)!r}, 'w').write('x')\nclass Evil: pass\n")
    cfg = json.loads((m / "config.json").read_text())
    cfg["auto_map"] = {
        "AutoConfig": "configuration_evil.Evil",
        "AutoModelForCausalLM": "modeling_evil.Evil",
    }
    (m / "config.json").write_text(json.dumps(cfg))
    tc_path = m / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    tc["auto_map"] = {"AutoTokenizer": ["tokenization_evil.Evil", None]}
    tc_path.write_text(json.dumps(tc))
    e = Engine()
    e.load(m)
    assert isinstance(e.generate_text("hi", GenerationSettings(max_tokens=2)), str)
    assert not marker.exists()


def test_the_engine_listens_on_no_socket(tiny_model_path):
    import psutil

    from app.engine.worker import WorkerClient

    with WorkerClient() as c:
        c.load(str(tiny_model_path("qwen3_moe")))
        list(c.generate("hi", {"max_tokens": 2}))
        conns = psutil.Process(c.pid).net_connections(kind="all")
        assert [x for x in conns if x.status == psutil.CONN_LISTEN] == []
        assert [x for x in conns if x.family in (2, 10)] == []  # no AF_INET / AF_INET6 at all


def test_remove_never_leaves_the_library_folder(tmp_path, tiny_model_path):
    import shutil

    from app.downloads.library import Library

    lib = Library(root=tmp_path / "models", db=tmp_path / "lib.sqlite3")
    inside = shutil.copytree(tiny_model_path("qwen3_moe"), lib.root / "tiny")
    lib.add_folder(inside, "tiny")
    outside = shutil.copytree(tiny_model_path("qwen3_moe"), tmp_path / "precious")
    for forged in (str(outside), str(lib.root / ".." / "precious"), str(lib.root)):
        lib.store.update("tiny", folder=forged, original=forged)
        lib.remove("tiny")
        assert (outside / "config.json").exists() and lib.root.is_dir()
        lib.add_folder(inside, "tiny")
    lib.store.update("tiny", folder=str(inside))
    lib.remove("tiny")
    assert not inside.exists() and (outside / "config.json").exists()
