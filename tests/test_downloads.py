"""The transfer loop and hub metadata against a local fault-injecting hub (tests/hubserver.py).
Nothing here touches the network."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from pathlib import Path

import hubserver
import huggingface_hub
import pytest
from hubserver import Fault

from app.downloads import hub, transfer
from app.downloads.control import Control
from app.downloads.errors import (
    ConnectionLostError,
    DiskFullError,
    GatedRepoError,
    IntegrityError,
    Paused,
    RepoNotFoundError,
    RevisionNotFoundError,
)
from app.downloads.events import DownloadProgress, Meter

REPO = "org/tiny"
hub_env = hubserver.hub_env


def make_files(seed: int = 0) -> dict[str, bytes]:
    rng = __import__("random").Random(seed)
    big = rng.randbytes(1_500_001)  # > 1 MiB (a "large" file) and odd: no chunk-aligned luck
    return {
        "config.json": json.dumps({"model_type": "qwen3_moe", "seed": seed}).encode(),
        "tokenizer.json": b'{"version": "1.0"}' * 50,
        "model.safetensors": big,
        "README.md": b"# tiny\n",
    }


def fast(**kw):
    """Transfer options for tests: tiny back-off, every event delivered."""
    return {"backoff": 0.001, "max_backoff": 0.01, "progress_interval": 0.0, "reserve": 0, **kw}


def check_progress(events: list, total: int) -> None:
    prog = [e for e in events if isinstance(e, DownloadProgress)]
    assert prog, "no progress events"
    dones = [e.done for e in prog]
    assert dones == sorted(dones), "progress went backwards"
    assert all(e.total == total for e in prog)
    assert prog[-1].done == total and prog[-1].fraction == 1.0
    assert prog[-1].files_done == prog[-1].files_total


def test_listing_gives_sizes_and_hashes(hub_env):
    files = make_files()
    hub_env.add_repo(REPO, files)
    got = {p: (s, h) for p, s, h in hub.repo_files(REPO)}
    assert set(got) == set(files)
    assert got["model.safetensors"] == (
        len(files["model.safetensors"]),
        hashlib.sha256(files["model.safetensors"]).hexdigest(),
    )
    assert got["config.json"] == (len(files["config.json"]), None)  # not LFS: no sha256
    listing = hub.repo_listing(REPO)
    assert listing.commit == hub_env.repos[REPO].commit
    assert listing.total_bytes == sum(len(b) for b in files.values())


def test_missing_repo_and_revision(hub_env):
    hub_env.add_repo(REPO, make_files())
    with pytest.raises(RepoNotFoundError, match="org/nope was not found"):
        hub.repo_listing("org/nope")
    with pytest.raises(RevisionNotFoundError, match="no revision 'v9'"):
        hub.repo_listing(REPO, "v9")
    with pytest.raises(RepoNotFoundError, match="not a hub repo id"):
        hub.repo_listing("not a repo")


def test_stock_client_understands_our_hub(hub_env):
    """Fidelity of the fake hub: huggingface-hub's own download works against it."""
    files = make_files()
    hub_env.add_repo(REPO, files)
    p = huggingface_hub.hf_hub_download(
        REPO, "model.safetensors", endpoint=hub_env_endpoint(), token=False
    )
    assert Path(p).read_bytes() == files["model.safetensors"]


def hub_env_endpoint() -> str:
    return os.environ["HF_ENDPOINT"]


def test_download_survives_drop_5xx_and_corruption(hub_env, tmp_path):
    files = make_files()
    hub_env.add_repo(REPO, files)
    big = len(files["model.safetensors"])
    hub_env.inject(REPO, "model.safetensors", Fault("drop", after=big // 2))
    hub_env.inject(REPO, "tokenizer.json", Fault("status", status=503, times=2))
    hub_env.inject(REPO, "config.json", Fault("corrupt"))
    listing = hub.repo_listing(REPO)
    events = []
    out = transfer.Downloader(listing, tmp_path / "dl", on_event=events.append, **fast()).run()
    for p, data in files.items():
        assert (tmp_path / "dl" / p).read_bytes() == data
    assert {d.path: d.sha256 for d in out} == {
        p: hashlib.sha256(b).hexdigest() for p, b in files.items()
    }
    # The dropped file resumed at the drop: nothing before it was sent twice.
    ranges = [r["range"] for r in hub_env.resolve_requests("model.safetensors")]
    assert ranges == [None, f"bytes={big // 2}-"]
    assert hub_env.bytes_sent[f"{REPO}/model.safetensors"] == big
    # The corrupt config was rejected and fetched again, the 503s retried.
    assert len(hub_env.resolve_requests("config.json")) == 2
    assert len(hub_env.resolve_requests("tokenizer.json")) == 3
    assert not (tmp_path / "dl" / transfer.PARTIAL_DIR).exists()
    check_progress(events, listing.total_bytes)


def test_resume_in_a_later_run_does_not_refetch(hub_env, tmp_path):
    files = make_files()
    hub_env.add_repo(REPO, files)
    big = len(files["model.safetensors"])
    cut = 300_007
    hub_env.inject(REPO, "model.safetensors", Fault("drop", after=cut, times=1))
    # then a dead link: an attempt without progress is what exhausts the retries
    hub_env.inject(REPO, "model.safetensors", Fault("drop", after=0, times=1))
    listing = hub.repo_listing(REPO)
    with pytest.raises(ConnectionLostError, match="run the download again to resume"):
        transfer.Downloader(listing, tmp_path / "dl", **fast(retries=0)).run()
    part = tmp_path / "dl" / transfer.PARTIAL_DIR / "model.safetensors.part"
    assert part.stat().st_size == cut
    side = json.loads(part.with_name(part.name + ".json").read_text())
    assert side["durable"] == cut and side["sha256"] == listing.file("model.safetensors").sha256
    before = dict(hub_env.bytes_sent)
    # A new process would build a new Downloader: it continues from the partial file.
    events = []
    transfer.Downloader(listing, tmp_path / "dl", on_event=events.append, **fast()).run()
    assert (tmp_path / "dl" / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert hub_env.resolve_requests("model.safetensors")[-1]["range"] == f"bytes={cut}-"
    assert (
        hub_env.bytes_sent[f"{REPO}/model.safetensors"] - before[f"{REPO}/model.safetensors"]
        == big - cut
    )
    # Files finished by the first run were not fetched again.
    for p in ("config.json", "tokenizer.json", "README.md"):
        assert hub_env.bytes_sent[f"{REPO}/{p}"] == before[f"{REPO}/{p}"]
    check_progress(events, listing.total_bytes)
    assert events[0].done >= cut  # the kept bytes count from the first event on


def test_bytes_past_the_last_checkpoint_are_dropped(hub_env, tmp_path):
    """After a power cut the tail of a partial file may be garbage: resume from `durable`."""
    files = make_files()
    hub_env.add_repo(REPO, files)
    listing = hub.repo_listing(REPO)
    f = listing.file("model.safetensors")
    d = transfer.Downloader(listing, tmp_path / "dl", **fast())
    part, side = d._part(f)
    part.parent.mkdir(parents=True)
    good = files["model.safetensors"][:200_000]
    part.write_bytes(good + b"\0" * 50_000)  # zeros the disk never wrote
    d._write_sidecar(f, side, len(good))
    d.run()
    assert (tmp_path / "dl" / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert hub_env.resolve_requests("model.safetensors")[0]["range"] == "bytes=200000-"


def test_server_ignoring_range_and_empty_files(hub_env, tmp_path):
    """A proxy that drops the Range header sends the whole file: start that file over."""
    files = {**make_files(), "empty.txt": b""}
    hub_env.add_repo(REPO, files)
    hub_env.ignore_range = True
    big = len(files["model.safetensors"])
    hub_env.inject(REPO, "model.safetensors", Fault("drop", after=big // 2))
    events = []
    listing = hub.repo_listing(REPO)
    transfer.Downloader(listing, tmp_path / "dl", on_event=events.append, **fast()).run()
    for p, data in files.items():
        assert (tmp_path / "dl" / p).read_bytes() == data
    assert [r["range"] for r in hub_env.resolve_requests("model.safetensors")] == [
        None,
        f"bytes={big // 2}-",
    ]
    check_progress(events, listing.total_bytes)  # the restart did not move the bar backwards


def test_same_size_corruption_is_rejected(hub_env, tmp_path):
    files = make_files()
    hub_env.add_repo(REPO, files)
    hub_env.inject(REPO, "model.safetensors", Fault("corrupt", times=2))
    listing = hub.repo_listing(REPO)
    with pytest.raises(IntegrityError, match="model.safetensors: downloaded twice and its sha256"):
        transfer.Downloader(listing, tmp_path / "dl", **fast()).run()
    assert not (tmp_path / "dl" / "model.safetensors").exists()
    assert not (tmp_path / "dl" / transfer.PARTIAL_DIR / "model.safetensors.part").exists()


def test_small_files_are_checked_by_git_sha1(hub_env, tmp_path):
    files = make_files()
    hub_env.add_repo(REPO, files)
    hub_env.inject(REPO, "README.md", Fault("corrupt", times=2))
    listing = hub.repo_listing(REPO)
    with pytest.raises(IntegrityError, match="README.md.*git sha1"):
        transfer.Downloader(listing, tmp_path / "dl", **fast()).run()


def test_gated_repo_needs_a_token(hub_env, tmp_path):
    hub_env.add_repo(REPO, make_files(), gated=True, tokens=("hf_good",))
    listing = hub.repo_listing(REPO)  # metadata of a gated repo is public, as on the hub
    assert listing.gated
    with pytest.raises(GatedRepoError, match="gated: accept its terms.*HF_TOKEN"):
        transfer.Downloader(listing, tmp_path / "a", **fast()).run()
    assert hub_env.resolve_requests("config.json") == []  # refused before any transfer
    with pytest.raises(GatedRepoError, match="no access yet"):
        transfer.Downloader(listing, tmp_path / "b", tok="hf_bad", **fast()).run()
    out = transfer.Downloader(listing, tmp_path / "c", tok="hf_good", **fast()).run()
    assert len(out) == 4


def test_gated_refusal_during_download_is_clear(hub_env, tmp_path):
    """A hub that says 401 GatedRepo on the file itself (listing did not flag it)."""
    hub_env.add_repo(REPO, make_files())
    listing = hub.repo_listing(REPO)
    hub_env.repos[REPO].gated = True
    with pytest.raises(GatedRepoError, match="HF_TOKEN"):
        transfer.Downloader(listing, tmp_path / "dl", **fast()).run()


def test_full_disk_before_start(hub_env, tmp_path, monkeypatch):
    hub_env.add_repo(REPO, make_files())
    listing = hub.repo_listing(REPO)
    monkeypatch.setattr(transfer, "free_bytes", lambda p: 100_000)
    with pytest.raises(DiskFullError, match=r"not enough disk space.*needs 1\.4 MiB"):
        transfer.Downloader(listing, tmp_path / "dl", **fast()).run()
    assert hub_env.resolve_requests("model.safetensors") == []


def test_full_disk_during_download_keeps_the_partial(hub_env, tmp_path, monkeypatch):
    files = make_files()
    hub_env.add_repo(REPO, files)
    listing = hub.repo_listing(REPO)
    real_write = transfer.write_all
    written = {"n": 0}
    limit = 250_000

    def filling_write(fd, data):
        if written["n"] + len(data) > limit:
            half = limit - written["n"]
            real_write(fd, data[:half])  # a short write, then the disk is full
            written["n"] += half
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, data)
        written["n"] += len(data)

    monkeypatch.setattr(transfer, "write_all", filling_write)
    with pytest.raises(DiskFullError, match=r"^disk full: .* more needed .*\(model.safetensors: "):
        transfer.Downloader(listing, tmp_path / "dl", **fast()).run()
    part = tmp_path / "dl" / transfer.PARTIAL_DIR / "model.safetensors.part"
    kept = part.stat().st_size
    side = json.loads(part.with_name(part.name + ".json").read_text())
    assert 0 < kept == side["durable"] < len(files["model.safetensors"])
    assert part.read_bytes() == files["model.safetensors"][:kept]  # the half chunk was dropped
    monkeypatch.setattr(transfer, "write_all", real_write)  # space freed
    transfer.Downloader(listing, tmp_path / "dl", **fast()).run()
    assert (tmp_path / "dl" / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert hub_env.resolve_requests("model.safetensors")[-1]["range"] == f"bytes={kept}-"


def test_lost_connection_is_reported(hub_env, tmp_path, monkeypatch):
    hub_env.add_repo(REPO, make_files())
    listing = hub.repo_listing(REPO)
    # Every attempt dies after 1000 bytes: progress is made, so keep going ... until none is.
    hub_env.inject(REPO, "config.json", Fault("drop", after=0, times=100))
    with pytest.raises(
        ConnectionLostError, match="lost the connection while downloading org/tiny/config.json"
    ):
        transfer.Downloader(listing, tmp_path / "dl", **fast(retries=3)).run()
    assert len(hub_env.resolve_requests("config.json")) == 4  # 1 + 3 retries
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(
        ConnectionLostError, match=r"the hub cannot be reached .*Check that this computer is online"
    ):
        hub.repo_listing(REPO, retries=0)


def test_pause_then_resume(hub_env, tmp_path):
    files = make_files()
    hub_env.add_repo(REPO, files)
    hub_env.delay = 0.01  # 64 KiB per 10 ms: slow enough to pause in the middle
    listing = hub.repo_listing(REPO)
    ctl = Control()
    events = []

    def on_event(e):
        events.append(e)
        if e.file == "model.safetensors" and e.file_done > 100_000:
            ctl.pause()

    with pytest.raises(Paused):
        transfer.Downloader(
            listing, tmp_path / "dl", control=ctl, on_event=on_event, **fast()
        ).run()
    part = tmp_path / "dl" / transfer.PARTIAL_DIR / "model.safetensors.part"
    kept = part.stat().st_size
    assert 100_000 < kept < len(files["model.safetensors"])
    hub_env.delay = 0.0
    events2 = []
    transfer.Downloader(listing, tmp_path / "dl", on_event=events2.append, **fast()).run()
    assert (tmp_path / "dl" / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert hub_env.resolve_requests("model.safetensors")[-1]["range"] == f"bytes={kept}-"
    check_progress(events2, listing.total_bytes)


def test_pause_cuts_a_stalled_read_short(hub_env, tmp_path):
    """Pause closes the live response, so a connection that hangs does not hold the thread."""
    hub_env.add_repo(REPO, make_files())
    hub_env.inject(REPO, "model.safetensors", Fault("stall", after=10_000, seconds=60))
    listing = hub.repo_listing(REPO)
    ctl = Control()
    timer = threading.Timer(0.5, ctl.pause)
    timer.start()
    import time

    t0 = time.monotonic()
    with pytest.raises(Paused):
        transfer.Downloader(listing, tmp_path / "dl", control=ctl, **fast(timeout=60)).run()
    assert time.monotonic() - t0 < 30  # cut short: the server would hold the read for 60 s


def test_hub_file_changed_restarts_the_partial(hub_env, tmp_path):
    files = make_files()
    hub_env.add_repo(REPO, files)
    listing = hub.repo_listing(REPO)
    hub_env.inject(REPO, "model.safetensors", Fault("drop", after=200_000))
    hub_env.inject(REPO, "model.safetensors", Fault("drop", after=0))
    with pytest.raises(ConnectionLostError):
        transfer.Downloader(listing, tmp_path / "dl", **fast(retries=0)).run()
    files2 = make_files(seed=1)
    hub_env.add_repo(REPO, files2)  # a new commit with different weights
    transfer.Downloader(hub.repo_listing(REPO), tmp_path / "dl", **fast()).run()
    assert (tmp_path / "dl" / "model.safetensors").read_bytes() == files2["model.safetensors"]
    assert hub_env.resolve_requests("model.safetensors")[-1]["range"] is None


def test_follows_the_cdn_redirect_with_range(hub_env, tmp_path):
    """LFS files come through a 302 to a CDN (as on the hub): Range survives the redirect."""
    files = make_files()
    hub_env.add_repo(REPO, files, gated=True, tokens=("hf_good",))
    hub_env.redirect_lfs = True
    big = len(files["model.safetensors"])
    hub_env.inject(REPO, "model.safetensors", Fault("drop", after=big // 3))
    listing = hub.repo_listing(REPO)
    transfer.Downloader(listing, tmp_path / "dl", tok="hf_good", **fast()).run()
    assert (tmp_path / "dl" / "model.safetensors").read_bytes() == files["model.safetensors"]
    cdn = hub_env.resolve_requests("model.safetensors", kind="cdn")
    assert [r["range"] for r in cdn] == [None, f"bytes={big // 3}-"]
    assert hub_env.resolve_requests("model.safetensors")[0]["auth"]
    # and the stock client reads the same redirecting hub
    p = huggingface_hub.hf_hub_download(
        REPO, "model.safetensors", endpoint=hub_env_endpoint(), token="hf_good"
    )
    assert Path(p).read_bytes() == files["model.safetensors"]


def test_reuses_huggingface_cache(hub_env, tmp_path):
    """A file the stock client already cached is linked in and verified, not downloaded."""
    files = make_files()
    hub_env.add_repo(REPO, files)
    huggingface_hub.hf_hub_download(
        REPO,
        "model.safetensors",
        revision=hub_env.repos[REPO].commit,
        endpoint=hub_env_endpoint(),
        token=False,
    )
    sent = hub_env.bytes_sent[f"{REPO}/model.safetensors"]
    listing = hub.repo_listing(REPO)
    transfer.Downloader(listing, tmp_path / "dl", **fast()).run()
    assert hub_env.bytes_sent[f"{REPO}/model.safetensors"] == sent
    assert (tmp_path / "dl" / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_model_files_leave_extras_on_the_hub(hub_env):
    hub_env.add_repo(
        "openai/gpt-oss-like",
        {
            "config.json": b"{}",
            "model-00001-of-00002.safetensors": b"a" * 10,
            "model-00002-of-00002.safetensors": b"b" * 10,
            "original/model.safetensors": b"c",
            "metal/model.bin": b"d",
            "pytorch_model.bin": b"e",
            "chat_template.jinja": b"{{x}}",
            ".gitattributes": b"*",
            "tokenizer.json": b"{}",
        },
    )
    got = [f.path for f in hub.model_files(hub.repo_listing("openai/gpt-oss-like"))]
    assert sorted(got) == sorted(
        [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "chat_template.jinja",
            "tokenizer.json",
        ]
    )


def test_meter_is_monotonic_and_paces_events():
    t = [0.0]
    ev = []
    m = Meter("r", 1000, 2, ev.append, interval=0.5, clock=lambda: t[0])
    m.start_file("a", 600, 0)
    for i in range(1, 7):
        t[0] += 0.1
        m.advance(i * 100, 100)
    m.advance(200)  # the file restarted (corrupt bytes): the bar holds still
    m.finish_file()
    m.start_file("b", 400, 0)
    t[0] += 1
    m.advance(400, 400)
    m.finish_file()
    dones = [e.done for e in ev]
    assert dones == sorted(dones) and dones[-1] == 1000
    assert len(ev) < 10  # throttled: not one event per advance
    rates = [e.rate for e in ev if e.rate]
    assert rates and all(r > 0 for r in rates)
    assert ev[-1].eta == 0.0


def test_download_stops_while_the_library_can_still_write(hub_env, tmp_path, monkeypatch):
    """Free space drops below what the library needs to record the failure: the download
    stops there, before the disk is full, and says how much more it needs."""
    hub_env.add_repo(REPO, make_files())
    listing = hub.repo_listing(REPO)
    free = {"n": 10 << 30}
    monkeypatch.setattr(transfer, "free_bytes", lambda p: free["n"])
    monkeypatch.setattr(transfer, "FREE_CHECK_EVERY", 64 << 10)
    real_write = transfer.write_all

    def write(fd, data):
        real_write(fd, data)
        free["n"] = 16 << 20  # someone else filled the disk meanwhile

    monkeypatch.setattr(transfer, "write_all", write)
    dl = transfer.Downloader(listing, tmp_path / "dl", **fast(reserve=1 << 30))
    with pytest.raises(
        DiskFullError, match=r"^disk full: 0\.99 GiB more needed to finish org/tiny"
    ):
        dl.run()


def test_a_500_on_every_get_is_said_and_stops_in_bounded_time(hub_env, tmp_path):
    """Every GET answers 500: not worded as a lost connection, and retrying stops once the
    configured time without progress is up (the number of tries alone would go on)."""
    from app.downloads.errors import ServerError

    hub_env.add_repo(REPO, make_files())
    listing = hub.repo_listing(REPO)
    hub_env.inject(REPO, "config.json", Fault("status", status=500, times=10_000))
    with pytest.raises(
        ServerError,
        match=r"the hub answered 500 to every request for org/tiny/config.json .*hub's side",
    ) as e:
        transfer.Downloader(
            listing, tmp_path / "dl", **fast(retries=10_000, give_up_after=0.3)
        ).run()
    assert "lost the connection" not in str(e.value)
    assert 1 < len(hub_env.resolve_requests("config.json")) < 10_000


def test_one_disk_reserve_configurable_in_the_check_and_the_plan(hub_env, tmp_path, monkeypatch):
    from app.downloads import catalog

    monkeypatch.setenv("ROTARYQUANT_DISK_RESERVE", "5GB")
    assert transfer.disk_reserve() == 5 << 30
    check = catalog.disk_check(tmp_path, {"download": 1 << 20})
    assert check.keep_free == 5 << 30 and "keeping 5.00 GiB free" in check.message
    hub_env.add_repo(REPO, make_files())
    monkeypatch.setattr(transfer, "free_bytes", lambda p: 5 << 30)
    with pytest.raises(DiskFullError, match=r"\(\+5\.00 GiB kept free\)"):
        transfer.Downloader(hub.repo_listing(REPO), tmp_path / "dl", **fast(reserve=None)).run()
    monkeypatch.delenv("ROTARYQUANT_DISK_RESERVE")
    assert catalog.disk_check(tmp_path, {}).keep_free == transfer.disk_reserve() == 2 << 30
