"""The library pipeline (download → convert → ready), its store and recovery after a kill,
against the local hub (tests/hubserver.py) serving a tiny random MoE model. No network."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import hubserver
import pytest

from app.downloads import catalog, transfer
from app.downloads.errors import (
    Cancelled,
    DiskFullError,
    DownloadError,
    GatedRepoError,
    LibraryError,
    Paused,
    RepoNotFoundError,
)
from app.downloads.events import ConvertProgress, DownloadProgress, StateChanged
from app.downloads.library import Library, default_converter
from app.downloads.manager import DownloadManager

REPO = "org/tiny-moe"
ROOT = Path(__file__).resolve().parents[1]
hub_env = hubserver.hub_env
FAST = {"backoff": 0.001, "max_backoff": 0.01, "progress_interval": 0.0, "reserve": 0}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny qwen3_moe as the hub has it: Hugging Face names, two shards + index."""
    from app.engine.quant.hf_layout import to_hf_layout
    from app.engine.testing.random_models import make_random_model

    tmp = tmp_path_factory.mktemp("tiny")
    mlx = make_random_model("qwen3_moe", tmp / "mlx", seed=3)
    return to_hf_layout(mlx, tmp / "hf")


@pytest.fixture(scope="module")
def tiny_mlx(tmp_path_factory) -> Path:
    from app.engine.testing.random_models import make_random_model

    return make_random_model("qwen3_moe", tmp_path_factory.mktemp("tinymlx") / "m", seed=4)


def states(events) -> list[str]:
    return [e.state for e in events if isinstance(e, StateChanged)]


def assert_monotonic_to_the_end(events) -> None:
    prog = [e for e in events if isinstance(e, DownloadProgress)]
    assert [e.done for e in prog] == sorted(e.done for e in prog)
    assert prog[-1].done == prog[-1].total and prog[-1].fraction == 1.0
    conv = [e.fraction for e in events if isinstance(e, ConvertProgress)]
    assert conv == sorted(conv)
    if conv:
        assert conv[-1] == 1.0


def test_download_convert_and_chat(hub_env, tiny_hf):
    """One click: download, verify, convert to the role widths, list as ready, then chat."""
    assert default_converter() is not None, "app/engine/quant/convert.py is part of the build"
    hub_env.add_folder(REPO, tiny_hf)
    lib = Library()
    events = []
    e = lib.download(REPO, on_event=events.append, transfer_options=FAST)
    assert e.state == "ready" and e.error == ""
    assert states(events) == ["downloading", "downloaded", "converting", "ready"]
    assert_monotonic_to_the_end(events)
    folder = Path(e.folder)
    assert folder == lib.root / "tiny-moe"
    manifest = json.loads((folder / "rotaryquant.json").read_text())
    assert manifest["roles"]["routed"]["bits"] == 2 and manifest["experts"]
    assert e.plan["converted"] is True and e.plan["widths"]["routed"]["bits"] == 2
    assert not e.original and not any(p.name.startswith(".tiny-moe") for p in lib.root.iterdir())
    assert {f["path"] for f in e.files} >= {"config.json", "rotaryquant.json"}
    assert lib.verify(e.name, deep=True).ok
    assert lib.store.get(e.name).original_files == []  # the original is gone, not listed
    # chat with it
    from mlx_lm import generate

    from app.engine.loader import load

    lm = load(folder)
    text = generate(lm.model, lm.tokenizer, "Hello", max_tokens=8)
    assert isinstance(text, str) and len(lm.tokenizer.encode(text)) > 0


def test_download_without_conversion_registers_the_folder(hub_env, tiny_mlx):
    hub_env.add_folder(REPO, tiny_mlx)
    lib = Library()
    e = lib.download(REPO, convert=False, transfer_options=FAST)
    assert e.state == "ready" and e.plan["converted"] is False
    assert e.plan["reason"] == "conversion not asked for"
    folder = Path(e.folder)
    for f in e.files:
        assert (folder / f["path"]).read_bytes() == (tiny_mlx / f["path"]).read_bytes()
    from app.engine.loader import load

    assert load(folder).architecture == "qwen3_moe"
    assert [x.name for x in lib.entries()] == ["tiny-moe"]
    with pytest.raises(LibraryError, match="already in the library as 'tiny-moe'"):
        lib.download(REPO, transfer_options=FAST)


def test_verify_notices_deleted_and_damaged_files(hub_env, tiny_mlx):
    hub_env.add_folder(REPO, tiny_mlx)
    lib = Library()
    e = lib.download(REPO, convert=False, transfer_options=FAST)
    weights = Path(e.folder) / "model.safetensors"
    data = weights.read_bytes()
    # same size, one byte changed: only the deep check (sha256) can see it
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert lib.verify(e.name).ok
    r = lib.verify(e.name, deep=True)
    assert not r.ok and "model.safetensors: sha256" in r.problems[0]
    assert lib.get(e.name).state == "broken"
    weights.write_bytes(data)
    assert lib.verify(e.name, deep=True).ok and lib.get(e.name).state == "ready"
    weights.write_bytes(data[:-10])  # truncated: the listing's size check sees it
    assert lib.entries()[0].state == "broken"
    weights.write_bytes(data)
    assert lib.entries()[0].state == "broken"  # until checked again on demand
    assert lib.verify(e.name).ok and lib.entries()[0].state == "ready"
    (Path(e.folder) / "tokenizer.json").unlink()
    r = lib.verify(e.name)
    assert not r.ok and r.problems[0].endswith("tokenizer.json: missing")
    b = lib.get(e.name)
    assert b.state == "broken" and "tokenizer.json: missing" in b.error
    import shutil

    shutil.copy(tiny_mlx / "tokenizer.json", Path(e.folder) / "tokenizer.json")
    assert lib.verify(e.name, deep=True).ok
    shutil.rmtree(e.folder)
    (b,) = lib.entries()  # listing notices a deleted folder without being asked
    assert b.state == "broken" and b.error == f"{e.folder}: the folder is missing"


def test_verify_checks_expert_records_without_deep(hub_env, tiny_hf):
    """A flipped byte in an expert record (same size) is found by a plain verify: the records'
    CRCs are checked, as every load does, without deep's sha256 of every file."""
    from app.engine.offload.records import ExpertStore

    hub_env.add_folder(REPO, tiny_hf)
    lib = Library()
    e = lib.download(REPO, transfer_options=FAST)
    r = lib.verify(e.name)
    assert r.ok and r.records > 0 and not r.deep
    with ExpertStore(e.folder) as st:
        layer = st.layers[1]
        path, off = Path(e.folder) / st.layout(layer).file, st.layout(layer).record_offset(2)
    with open(path, "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 0x10]))
    r = lib.verify(e.name)
    assert not r.ok and f"layer {layer}, expert 2: checksum mismatch" in r.problems[0]
    assert lib.get(e.name).state == "broken"


def test_missing_repo_leaves_no_entry(hub_env):
    lib = Library()
    with pytest.raises(RepoNotFoundError, match="org/nothing was not found"):
        lib.download("org/nothing", transfer_options=FAST)
    assert lib.entries() == []


def test_gated_repo_uses_the_token_convention(hub_env, tiny_mlx, monkeypatch):
    hub_env.add_folder(REPO, tiny_mlx, gated=True, tokens=("hf_ok",))
    lib = Library()
    with pytest.raises(GatedRepoError, match="gated: accept its terms at .*/org/tiny-moe"):
        lib.download(REPO, transfer_options=FAST)
    assert lib.entries() == []  # refused before anything was written
    monkeypatch.setenv("HF_TOKEN", "hf_ok")  # huggingface-hub's convention, read at call time
    assert lib.download(REPO, convert=False, transfer_options=FAST).state == "ready"


def test_conversion_that_will_not_fit_stops_early(hub_env, tiny_hf, monkeypatch):
    """The download alone fits, download + conversion does not: stop before the weights."""
    hub_env.add_folder(REPO, tiny_hf)
    size = sum(p.stat().st_size for p in tiny_hf.iterdir())
    monkeypatch.setattr(transfer, "free_bytes", lambda p: size + 1000)
    lib = Library()
    with pytest.raises(DiskFullError, match="conversion.*does NOT fit"):
        lib.download(REPO, transfer_options=FAST)
    e = lib.get("tiny-moe")
    assert e.state == "paused" and "does NOT fit" in e.error
    shards = [
        r for r in hub_env.log if r["kind"] == "resolve" and r["path"].endswith(".safetensors")
    ]
    assert shards == []  # the big files were not started


def test_failed_conversion_keeps_the_download(hub_env, tiny_hf):
    hub_env.add_folder(REPO, tiny_hf)
    lib = Library()

    def broken(src, dst, options, progress):
        dst.mkdir()
        (dst / "half").write_bytes(b"x")
        progress("dense", 0.3)
        raise RuntimeError("out of memory (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        lib.download(REPO, converter=broken, transfer_options=FAST)
    e = lib.get("tiny-moe")
    assert e.state == "downloaded" and "conversion failed: out of memory" in e.error
    assert not (lib.root / "tiny-moe").exists() and not (lib.root / ".tiny-moe.converting").exists()
    e = lib.convert("tiny-moe")  # the real converter, from the kept download
    assert e.state == "ready" and lib.verify("tiny-moe", deep=True).ok


def _child(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(pred, proc, timeout=30.0):
    t0 = time.monotonic()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early: {proc.stderr.read()}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the child")
        time.sleep(0.02)


def test_kill_during_conversion_leaves_the_library_consistent(hub_env, tiny_hf):
    hub_env.add_folder(REPO, tiny_hf)
    lib = Library()
    assert lib.download(REPO, finish=False, transfer_options=FAST).state == "downloaded"
    proc = _child(
        "import time\n"
        "from app.downloads.library import Library\n"
        "def slow(src, dst, options, progress):\n"
        "    dst.mkdir()\n"
        "    (dst / 'model.safetensors').write_bytes(b'half')\n"
        "    (dst.parent / ('.' + dst.name + '.rq-partial-1')).mkdir()\n"
        "    progress('dense', 0.5)\n"
        "    print('HALF', flush=True)\n"
        "    time.sleep(120)\n"
        "Library().convert('tiny-moe', slow)\n"
    )
    assert proc.stdout.readline().strip() == "HALF"
    assert lib.store.get("tiny-moe").state == "converting"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)  # reaps it and closes the pipes
    e = lib.get("tiny-moe")  # reading notices the dead owner
    assert e.state == "downloaded" and "conversion was interrupted" in e.error
    assert sorted(p.name for p in lib.root.iterdir()) == [".tiny-moe.download"]
    assert not [x for x in lib.entries() if x.state == "ready"]
    e = lib.convert("tiny-moe")
    assert e.state == "ready" and lib.verify("tiny-moe").ok


def test_kill_during_download_resumes_after_restart(hub_env, tiny_hf):
    """A killed process (app crash, reboot): the next run continues from the partial file."""
    hub_env.add_folder(REPO, tiny_hf)
    hub_env.delay = 0.01  # 64 KiB per 10 ms
    shard = "model-00001-of-00002.safetensors"
    proc = _child(
        "from app.downloads.library import Library\n"
        f"Library().download({REPO!r}, convert=False, transfer_options={{'fsync_every': 65536}})\n"
    )
    lib = Library()
    part = lib.root / ".tiny-moe.download" / transfer.PARTIAL_DIR / (shard + ".part")
    _wait_for(lambda: part.exists() and part.stat().st_size > 200_000, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)  # reaps it and closes the pipes
    e = lib.get("tiny-moe")
    assert e.state == "paused" and "interrupted" in e.error
    side = json.loads(part.with_name(part.name + ".json").read_text())
    assert side["durable"] >= 65536
    hub_env.delay = 0.0
    events = []
    e = lib.download(REPO, on_event=events.append, transfer_options=FAST)
    assert e.state == "ready"
    assert hub_env.resolve_requests(shard)[-1]["range"] == f"bytes={side['durable']}-"
    assert_monotonic_to_the_end(events)
    assert lib.verify("tiny-moe", deep=True).ok


def test_manager_pause_resume_and_cancel(hub_env, tiny_hf):
    hub_env.add_folder(REPO, tiny_hf)
    hub_env.delay = 0.005
    lib = Library()
    mgr = DownloadManager(lib)
    seen = []

    def on_event(e):
        seen.append(e)
        if isinstance(e, DownloadProgress) and e.done > 200_000 and not paused:
            paused.append(1)
            mgr.pause(REPO)

    paused: list = []
    job = mgr.start(REPO, on_event=on_event, transfer_options=FAST)
    with pytest.raises(LibraryError, match="already downloading"):
        mgr.start(REPO)
    assert job.wait(30)
    assert job.outcome == "paused" and isinstance(job.error, Paused)
    assert lib.get("tiny-moe").state == "paused"
    first = [e.done for e in seen if isinstance(e, DownloadProgress)][-1]
    hub_env.delay = 0.0
    job = mgr.resume("tiny-moe", on_event=seen.append, transfer_options=FAST)
    assert job.wait(60) and job.outcome == "done", job.error
    assert job.result.state == "ready"
    prog2 = [e for e in seen if isinstance(e, DownloadProgress)]
    assert prog2[-1].done == prog2[-1].total and first < prog2[-1].total
    # cancel, removing the partial files: the entry and its folder go away
    hub_env.add_folder("org/other", tiny_hf)
    hub_env.delay = 0.005
    job = mgr.start(
        "org/other",
        on_event=lambda e: (
            mgr.cancel("org/other", True)
            if isinstance(e, DownloadProgress) and e.done > 100_000
            else None
        ),
        transfer_options=FAST,
    )
    assert job.wait(30) and job.outcome == "cancelled" and isinstance(job.error, Cancelled)
    assert [x.name for x in lib.entries()] == ["tiny-moe"]
    assert not (lib.root / ".other.download").exists()
    mgr.shutdown()


def test_damaged_store_is_rebuilt_from_folders(hub_env, tiny_mlx):
    hub_env.add_folder(REPO, tiny_mlx)
    lib = Library()
    lib.download(REPO, convert=False, transfer_options=FAST)
    lib.db_path.write_bytes(b"this is not a database" * 100)
    lib2 = Library()
    assert [(e.name, e.state) for e in lib2.entries()] == [("tiny-moe", "ready")]
    assert list(lib.db_path.parent.glob("library.sqlite3.damaged-*"))
    assert lib2.verify("tiny-moe", deep=True).ok


def test_newer_store_format_is_refused(hub_env):
    import sqlite3

    lib = Library()
    db = sqlite3.connect(lib.db_path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(LibraryError, match="library format 99 is newer"):
        Library()


def test_remove_deletes_both_folders(hub_env, tiny_hf):
    hub_env.add_folder(REPO, tiny_hf)
    lib = Library()
    e = lib.download(REPO, keep_original=True, transfer_options=FAST)
    assert Path(e.original).is_dir() and Path(e.folder).is_dir()
    assert lib.verify(e.name, deep=True).files == len(e.files) + len(e.original_files)
    lib.remove(e.name)
    assert lib.entries() == [] and list(lib.root.iterdir()) == []


def test_catalog_and_plan(hub_env, tiny_hf, monkeypatch):
    names = {e.name for e in catalog.load_catalog()}
    assert {"Qwen3-30B-A3B", "gpt-oss-20b", "gpt-oss-120b", "Nemotron 3 Super 120B-A12B"} <= names
    q = catalog.find("qwen/qwen3-30b-a3b")
    assert q is not None and q.is_moe and 55e9 < q.approx_bytes < 65e9
    p = Library().catalog_plan(q)  # from the shared config, before any download
    assert p["widths"]["routed"]["bits"] == 2 and 8e9 < p["converted_bytes"] < 20e9
    if importlib.util.find_spec("app.engine.planner") is not None:
        assert "planner" in p or "planner_refused" in p, p.get("planner_error")
    assert catalog.find("org/unknown") is None
    hub_env.add_folder(REPO, tiny_hf)
    monkeypatch.setattr(transfer, "free_bytes", lambda p: 10 << 30)
    plan = Library().plan(REPO)
    assert plan.download_bytes == sum(p.stat().st_size for p in tiny_hf.iterdir())
    assert plan.disk.fits and "fits" in plan.disk.message
    monkeypatch.setattr(transfer, "free_bytes", lambda p: 1 << 20)
    assert not Library().plan(REPO).disk.fits


def test_command_line(hub_env, tiny_mlx, capsys):
    import argparse

    from app.downloads import commands

    parser = argparse.ArgumentParser(prog="rotaryquant")
    commands.add_commands(parser.add_subparsers(dest="command", required=True))

    def run(*argv) -> int:
        args = parser.parse_args(argv)
        return args.func(args)

    hub_env.add_folder(REPO, tiny_mlx)
    assert run("download", REPO, "--no-convert") == 0
    out = capsys.readouterr()
    assert "model.safetensors" in out.out and "tiny-moe: ready" in out.out
    assert "downloading 100.0%" in out.err
    assert run("models") == 0
    assert "tiny-moe" in capsys.readouterr().out
    assert run("models", "--catalog") == 0
    assert "Qwen/Qwen3-30B-A3B" in capsys.readouterr().out
    assert run("verify", "tiny-moe", "--deep") == 0
    assert "OK" in capsys.readouterr().out
    assert run("remove", "tiny-moe") == 0
    assert run("models", "--json") == 0
    assert json.loads(capsys.readouterr().out.split("removed tiny-moe\n")[-1]) == []


def test_disk_full_mid_transfer_is_said_and_recorded(hub_env, tiny_mlx, monkeypatch):
    """The disk fills up mid-transfer and SQLite cannot write either: the user reads "disk
    full: N more needed", the entry is shown paused (not "downloading") at once, the library
    can still be listed, and the state reaches the store once space is freed."""
    import errno
    import sqlite3

    from app.downloads.store import Store

    hub_env.add_folder(REPO, tiny_mlx)
    lib = Library()
    full = {"on": False}
    real_write, real_connect = transfer.write_all, Store._connect

    def filling_write(fd, data):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, data)
        if os.fstat(fd).st_size > 100_000:  # the weights are well under way
            full["on"] = True

    def full_connect(self, write=True):
        if write and full["on"]:

            @contextlib.contextmanager
            def failing():
                with real_connect(self, write=False) as db:
                    raise sqlite3.OperationalError("database or disk is full")
                    yield db

            return failing()
        return real_connect(self, write)

    monkeypatch.setattr(transfer, "write_all", filling_write)
    monkeypatch.setattr(Store, "_connect", full_connect)
    events = []
    with pytest.raises(
        DiskFullError, match=r"^disk full: .* more needed to finish org/tiny-moe"
    ) as e:
        lib.download(REPO, on_event=events.append, transfer_options=FAST)
    assert "database" not in str(e.value)
    assert states(events)[-1] == "paused"
    listed = {x.name: x for x in lib.entries(check=False)}  # `models` works on the full disk
    assert listed["tiny-moe"].state == "paused" and "disk full" in listed["tiny-moe"].error
    assert lib.store.get("tiny-moe").state == "downloading"  # not written yet
    full["on"] = False  # space freed
    assert lib.entries(check=False)[0].state == "paused"
    assert (
        lib.store.get("tiny-moe").state == "paused"
        and "disk full" in lib.store.get("tiny-moe").error
    )
    monkeypatch.setattr(transfer, "write_all", real_write)
    assert lib.download(REPO, transfer_options=FAST).state == "ready"


def test_absurd_config_stops_the_download_before_the_weights(hub_env, tiny_hf, tmp_path):
    cfg = json.loads((tiny_hf / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf, bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1e8}))
    hub_env.add_folder(REPO, bad)
    with pytest.raises(
        DownloadError, match="num_hidden_layers must be a whole number, got 100000000.0"
    ):
        Library().download(REPO, transfer_options=FAST)
    assert not hub_env.resolve_requests("model.safetensors")  # the weights were never asked for


def test_two_downloads_of_one_repo_started_together(hub_env, tiny_mlx):
    """A lock per repo: the second finds the first's entry claimed; no "tiny-moe-2", every
    file fetched once."""
    import threading

    hub_env.add_folder(REPO, tiny_mlx)
    hub_env.delay = 0.002
    lib, other = Library(), Library()  # two library objects, as two processes would have
    results, go = {}, threading.Barrier(2)

    def run(key, library):
        go.wait()
        try:
            results[key] = library.download(REPO, convert=False, transfer_options=FAST).state
        except LibraryError as e:
            results[key] = str(e)

    threads = [threading.Thread(target=run, args=(k, x)) for k, x in (("a", lib), ("b", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results.values(), key=len)[0] == "ready", results
    assert any("is already being downloaded" in v for v in results.values()), results
    assert [e.name for e in lib.entries(check=False)] == ["tiny-moe"]
    assert len(hub_env.resolve_requests("model.safetensors")) == 1


@pytest.mark.parametrize(
    "bad",
    [
        "../evil.json",
        "/etc/evil.json",
        "nul\x00.json",
        "a" * 241 + ".json",
        "new\nline.json",
        "ansi\x1b[31mred.json",
        "sub/../../up.json",
    ],
)
def test_hostile_file_names_are_refused_before_anything_is_written(hub_env, tiny_mlx, bad):
    from app.downloads.errors import UnsafeFileNameError

    files = {p.name: p.read_bytes() for p in tiny_mlx.iterdir() if p.is_file()}
    hub_env.add_repo(REPO, {**files, bad: b"{}"})
    lib = Library()
    with pytest.raises(UnsafeFileNameError, match="lists a file this app will not write") as e:
        lib.download(REPO, transfer_options=FAST)
    msg = str(e.value)
    assert "\n" not in msg and "\x1b" not in msg and "\x00" not in msg and len(msg) < 400
    assert lib.entries(check=False) == [] and list(lib.root.iterdir()) == []


def test_custom_code_is_said_at_download_time(hub_env, tiny_mlx, tmp_path):
    """A model type mlx-lm lacks, with auto_map and .py files: refused once config.json is in,
    with no entry left; a known model type that also ships code downloads without the code."""
    from app.downloads.errors import UnsupportedModelError

    cfg = json.loads((tiny_mlx / "config.json").read_text())
    files = {p.name: p.read_bytes() for p in tiny_mlx.iterdir() if p.is_file()}
    custom = {**cfg, "model_type": "acme_moe", "auto_map": {"AutoModel": "modeling_acme.AcmeModel"}}
    hub_env.add_repo(
        REPO,
        {
            **files,
            "config.json": json.dumps(custom).encode(),
            "modeling_acme.py": b"raise SystemExit('never run')\n",
        },
    )
    lib = Library()
    with pytest.raises(
        UnsupportedModelError,
        match="custom code is not supported: org/tiny-moe .*auto_map.*1 .py file",
    ):
        lib.download(REPO, transfer_options=FAST)
    assert lib.entries(check=False) == [] and list(lib.root.iterdir()) == []
    assert not hub_env.resolve_requests("model.safetensors")
    known = {**cfg, "auto_map": {"AutoModel": "modeling_acme.AcmeModel"}}
    hub_env.add_repo(
        "org/known",
        {
            **files,
            "config.json": json.dumps(known).encode(),
            "modeling_acme.py": b"raise SystemExit('never run')\n",
        },
    )
    e = lib.download("org/known", convert=False, transfer_options=FAST)
    assert e.state == "ready" and not (Path(e.folder) / "modeling_acme.py").exists()


def test_a_wrong_token_leaves_no_entry_and_no_folder(hub_env, tiny_mlx):
    from app.downloads.errors import GatedRepoError

    hub_env.add_folder(REPO, tiny_mlx, gated=True, tokens=("hf_right",))
    lib = Library()
    with pytest.raises(GatedRepoError):
        lib.download(REPO, tok="hf_wrong", transfer_options=FAST)
    assert lib.entries(check=False) == [] and list(lib.root.iterdir()) == []
    assert lib.download(REPO, tok="hf_right", convert=False, transfer_options=FAST).state == "ready"
