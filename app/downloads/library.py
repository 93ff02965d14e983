"""The model library: download → convert (to the plan's widths) → ready, with a store that
survives crashes.

Folders under `models_dir()` (dot-folders are never listed as models):
    <name>/                  a ready model (converted, or the download itself)
    .<name>.download/        the download while it is in progress or kept as the original
    .<name>.converting/      the converter's output until it is complete; then renamed
A process that dies in the middle leaves its entry marked busy with its pid; the next Library
that reads the store sees the owner is gone and puts the entry back to a state that is true
(paused, or downloaded with a message), removing any half-written conversion.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from app import paths

from . import catalog, hub, transfer
from .control import Control
from .errors import (
    Cancelled,
    DiskFullError,
    DownloadError,
    LibraryDiskFull,
    LibraryError,
    Paused,
    UnsupportedModelError,
)
from .events import Callback, ConvertProgress, StateChanged
from .store import LibraryEntry, Store

DB_NAME = "library.sqlite3"
# progress(stage, fraction): the converter reports what it is doing and how far it is.
ConvertProgressFn = Callable[[str, float], None]
# converter(src, dst, options, progress): writes a complete model folder into dst.
Converter = Callable[[Path, Path, dict, ConvertProgressFn], None]
_DEFAULT = object()


@dataclass(frozen=True)
class RepoPlan:
    """What a download would bring, before it starts (shown in the UI / CLI)."""

    listing: hub.RepoListing
    files: tuple[hub.RemoteFile, ...]  # the ones a model folder needs
    catalog: catalog.CatalogEntry | None
    disk: catalog.DiskCheck

    @property
    def download_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class VerifyReport:
    name: str
    ok: bool
    problems: tuple[str, ...] = ()
    files: int = 0
    bytes: int = 0
    deep: bool = False
    records: int = 0  # expert records whose CRC was checked (a converted model)


def _verify_records(folder: Path, section: dict) -> int:
    """CRC-check every expert record (what a load checks too): a corrupt record is found
    without `deep`'s sha256 of every file. Returns the number of records."""
    from app.engine.offload.records import ExpertStore

    with ExpertStore(folder, section) as store:
        store.verify_all()
        return sum(store.layout(x).num_experts for x in store.layers)


@dataclass
class _Owner:
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=lambda: psutil.Process().create_time())


def _alive(pid: int, started: float) -> bool:
    if pid <= 0:
        return False
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def slug(repo: str) -> str:
    base = repo.rstrip("/").split("/")[-1]
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip(".-")
    return s or "model"


def folder_files(folder: Path) -> list[dict]:
    """[{path, size, sha256}] of every file under `folder` (for verify later)."""
    out = []
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h = transfer.hash_file(p)
            out.append(
                {
                    "path": p.relative_to(folder).as_posix(),
                    "size": p.stat().st_size,
                    "sha256": h.sha256.hexdigest(),
                }
            )
    return out


def read_config(folder: Path) -> dict:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def is_moe(config: dict) -> bool:
    texts = [config, config.get("text_config") or {}]
    keys = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
    return any(isinstance(c, dict) and (c.get(k) or 0) > 1 for c in texts for k in keys)


def custom_code(config: dict, listing: hub.RepoListing) -> str:
    """What says a repo ships its own modelling code ('' if nothing)."""
    py = [f.path for f in listing.files if f.path.endswith(".py")]
    signs = (["auto_map in config.json"] if config.get("auto_map") else []) + (
        [f"{len(py)} .py file(s)"] if py else []
    )
    return ", ".join(signs)


def is_prequantized(config: dict) -> bool:
    """An mlx-lm folder that is already quantized (mlx-community's 4-bit repos): used as-is."""
    return isinstance(config.get("quantization"), dict)


def converted_size(config: dict, widths: dict | None = None) -> int | None:
    """Bytes of the converted model, from its config alone (None if the sizer can't tell)."""
    try:
        from app.engine import sizes
        from app.engine.quant.widths import RoleWidths
    except ImportError:
        return None
    try:
        w = RoleWidths.from_dict(widths) if widths else RoleWidths()
        return int(sizes.compute(config, w).total_bytes)
    except Exception:  # an architecture the sizer does not know: no estimate, not an error
        return None


def plan_summary(config: dict, widths: dict | None = None, folder: Path | None = None) -> dict:
    """Sizes at the role widths, and what the planner (app/engine/planner.py, when built) says
    for this machine: for a converted `folder` its fixed widths, else from the config alone."""
    out: dict = {}
    try:
        from app.engine import sizes
        from app.engine.quant.widths import RoleWidths

        w = RoleWidths.from_dict(widths) if widths else RoleWidths()
        s = sizes.compute(config, w)
        out.update(
            widths=w.to_dict(),
            converted_bytes=s.total_bytes,
            total_params=s.total_params,
            active_params=s.active_params,
            expert_bytes=s.expert_bytes,
        )
    except Exception:  # an architecture the sizer does not know: no sizes, not an error
        return out
    try:
        from app.engine import planner  # another part of the app; optional here
    except Exception:  # absent or broken: the library works without it
        return out
    try:
        if folder is not None:
            plan = planner.plan_model(folder)
        else:
            plan = planner.make_plan(s, planner.Machine.detect())
        out["planner"] = plan.to_dict()
        out["planner_summary"] = plan.summary()
    except planner.PlanRefused as e:  # too large for this machine: say so, don't fail
        out["planner_refused"] = str(e)
    except Exception as e:  # the planner's failure must not block a download
        out["planner_error"] = f"{type(e).__name__}: {e}"
    return out


def default_converter() -> Converter | None:
    """The app's converter (app/engine/quant/convert.py) as a `Converter`, if it is built."""
    try:
        from app.engine.quant import convert as conv
    except ImportError:
        return None

    def run(src: Path, dst: Path, options: dict, progress: ConvertProgressFn) -> None:
        from app.engine.quant.widths import RoleWidths

        widths = RoleWidths.from_dict(options["widths"]) if options.get("widths") else None

        def report(p) -> None:  # conv.ConvertProgress(stage, done, total, item)
            progress(f"{p.stage} {p.item}", p.done / p.total if p.total else 1.0)

        conv.convert(src, dst, widths=widths, progress=report)

    return run


class Library:
    def __init__(self, root: str | os.PathLike | None = None, db: str | os.PathLike | None = None):
        self.root = Path(root) if root else paths.models_dir()
        self.root.mkdir(parents=True, exist_ok=True)
        self.db_path = Path(db) if db else paths.data_dir() / DB_NAME
        self.store = self._open_store()
        # changes the store could not take (a full disk): shown meanwhile, written when it can
        self._pending: dict[str, dict] = {}

    def _open_store(self) -> Store:
        try:
            return Store(self.db_path)
        except LibraryError as e:
            if "newer than this app" in str(e):
                raise
            cause = e.__cause__
            if not isinstance(cause, sqlite3.DatabaseError):
                raise
        # A damaged file (disk error, truncated copy): keep it aside and rebuild from the folders.
        aside = self.db_path.with_name(f"{self.db_path.name}.damaged-{int(time.time())}")
        os.replace(self.db_path, aside)
        store = Store(self.db_path)
        self.store = store
        for d in sorted(self.root.iterdir()):
            if d.is_dir() and not d.name.startswith(".") and (d / "config.json").exists():
                try:
                    self.add_folder(d, d.name)
                except (LibraryError, ValueError):
                    pass
        return store

    # -- reading ------------------------------------------------------------------------------

    def entries(self, check: bool = True) -> list[LibraryEntry]:
        """All models. `check`: notice deleted folders and changed sizes (a stat per file, no
        reading); `verify(name, deep=True)` re-hashes on demand."""
        self.recover()
        out = [self._with_pending(e) for e in self.store.all()]
        if check:
            for i, e in enumerate(out):
                if e.state in ("ready", "downloaded"):  # un-breaking takes an explicit verify
                    self.verify(e.name, structure=False)
                    out[i] = self.store.get(e.name)
        return out

    def builtin(self) -> LibraryEntry | None:
        """The model that ships with the app (listed first, never removed; None until it has
        been prepared)."""
        from app.engine.embedded import DEFAULT_MODEL_NAME, default_model_path

        folder = default_model_path()
        if not (folder / "config.json").is_file():
            return None
        files = [
            {"path": p.name, "size": p.stat().st_size}
            for p in sorted(folder.iterdir())
            if p.is_file()
        ]
        return LibraryEntry(
            name=DEFAULT_MODEL_NAME,
            state="ready",
            folder=str(folder),
            architecture=str(read_config(folder).get("model_type", "")),
            files=files,
            disk_bytes=sum(f["size"] for f in files),
        )

    def is_builtin(self, name: str) -> bool:
        from app.engine.embedded import DEFAULT_MODEL_NAME

        return self.store.get(name) is None and name.lower().removesuffix(" (built in)") == (
            DEFAULT_MODEL_NAME.lower()
        )

    def get(self, name: str) -> LibraryEntry:
        self.recover(name)
        e = self.store.get(name)
        if e is None:
            known = ", ".join(x.name for x in self.store.all()) or "none"
            raise LibraryError(f"no model named {name!r} in the library (models: {known})")
        return e

    def find_repo(self, repo: str) -> LibraryEntry | None:
        for e in self.store.all():
            if e.repo.lower() == repo.lower():
                return e
        return None

    def _with_pending(self, e: LibraryEntry) -> LibraryEntry:
        ch = self._pending.get(e.name)
        return LibraryEntry.from_dict({**e.to_dict(), **ch}) if ch else e

    def _record_failure(self, name: str, on_event: Callback | None, **changes) -> None:
        """Record how a download ended; on a full disk keep it to write later (the entry
        must not stay "downloading"), and say it."""
        try:
            self._set(name, on_event, **changes)
        except LibraryDiskFull:
            self._pending.setdefault(name, {}).update(changes)
            if on_event is not None and "state" in changes:
                on_event(StateChanged(name, changes["state"], changes.get("error", "")))

    def recover(self, name: str | None = None) -> list[str]:
        """Put entries whose owning process died back into a true state; returns their names."""
        for n, ch in list(self._pending.items()):  # what a full disk kept from the store
            try:
                self.store.update(n, **ch)
            except LibraryDiskFull:
                break
            except LibraryError:  # removed meanwhile: nothing left to record
                pass
            del self._pending[n]
        fixed = []
        for e in [self.store.get(name)] if name else self.store.all():
            if e is None or not e.busy or _alive(e.owner_pid, e.owner_started):
                continue
            if e.state == "downloading":
                msg = "the download was interrupted (the app stopped); resume to continue"
                self._set(e.name, None, state="paused", error=msg, owner_pid=0)
            else:  # converting
                self._remove_tmp(e.name)
                orig = Path(e.original) if e.original else None
                if orig and orig.is_dir():
                    msg = "the conversion was interrupted (the app stopped); convert again"
                    self._set(e.name, None, state="downloaded", error=msg, owner_pid=0)
                else:
                    msg = "the conversion was interrupted and the download is gone; download again"
                    self._set(e.name, None, state="broken", error=msg, owner_pid=0)
            fixed.append(e.name)
        return fixed

    # -- planning -----------------------------------------------------------------------------

    def plan(
        self,
        repo: str,
        revision: str | None = None,
        tok: str | None = None,
        convert: bool = True,
        reserve: int | None = None,
    ) -> RepoPlan:
        """File list, sizes and disk check for `repo`, without downloading."""
        entry = catalog.find(repo)
        repo_id = entry.repo if entry else repo
        listing = hub.repo_listing(repo_id, revision, hub.token(tok))
        files = tuple(hub.model_files(listing))
        parts = {"download": sum(f.size for f in files)}
        if convert and entry is not None and entry.is_moe:
            est = converted_size(self._catalog_config(entry) or {})
            if est:
                parts["conversion"] = est
        return RepoPlan(listing, files, entry, catalog.disk_check(self.root, parts, reserve))

    def catalog_plan(self, entry: catalog.CatalogEntry) -> dict:
        """Sizes at the role widths and, when the planner is built, its verdict for this
        machine — from the catalog's config, before anything is downloaded ({} if unknown)."""
        cfg = self._catalog_config(entry)
        return plan_summary(cfg) if cfg else {}

    @staticmethod
    def _catalog_config(entry: catalog.CatalogEntry) -> dict | None:
        try:
            from app.engine import sizes

            return sizes.load_config(entry.config)[0] if entry.config else None
        except Exception:
            return None

    # -- the pipeline -------------------------------------------------------------------------

    @contextmanager
    def _repo_lock(self, repo: str):
        locks = self.db_path.parent / "library-locks"  # beside the store, not among the models
        locks.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha1(repo.lower().encode()).hexdigest()[:16]
        with open(locks / f"{key}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _dl_dir(self, name: str) -> Path:
        return self.root / f".{name}.download"

    def _tmp_dir(self, name: str) -> Path:
        return self.root / f".{name}.converting"

    def _remove_tmp(self, name: str) -> None:
        """The conversion's output folder, and any half folder the converter left in it."""
        tmp = self._tmp_dir(name)
        for p in [tmp, *self.root.glob(f".{tmp.name}.rq-partial-*")]:
            shutil.rmtree(p, ignore_errors=True)

    def _unique_name(self, wanted: str) -> str:
        name, i = wanted, 1
        while (
            self.store.get(name) is not None
            or (self.root / name).exists()
            or self._dl_dir(name).exists()
        ):
            i += 1
            name = f"{wanted}-{i}"
        return name

    def _set(self, name: str, on_event: Callback | None, **changes) -> LibraryEntry:
        e = self.store.update(name, **changes)
        if on_event is not None and "state" in changes:
            on_event(StateChanged(name, e.state, e.error))
        return e

    def _claim(self, name: str, state: str, on_event: Callback | None) -> LibraryEntry:
        o = _Owner()
        return self._set(
            name, on_event, state=state, owner_pid=o.pid, owner_started=o.started, error=""
        )

    def download(
        self,
        repo: str,
        revision: str | None = None,
        *,
        name: str | None = None,
        convert: bool = True,
        keep_original: bool = False,
        tok: str | None = None,
        control: Control | None = None,
        on_event: Callback | None = None,
        converter: Converter | None | object = _DEFAULT,
        widths: dict | None = None,
        transfer_options: dict | None = None,
        finish: bool = True,
    ) -> LibraryEntry:
        """Download `repo` (a repo id or a catalog name), then convert or register it (`finish`
        False: stop at "downloaded"). Resumes an unfinished download of the same repo. Blocks;
        run it on a thread for a GUI."""
        entry = catalog.find(repo)
        repo = entry.repo if entry else repo
        tok = hub.token(tok)
        # one download of a repo at a time, across threads and processes: the second one finds
        # the first's entry claimed (no "model-2", nothing fetched twice)
        created = False
        with self._repo_lock(repo):
            existing = self.find_repo(repo)
            if existing is not None:
                self.recover(existing.name)
                existing = self.store.get(existing.name)
                if existing.busy:
                    who = (
                        ""
                        if existing.owner_pid == os.getpid()
                        else f" by another process (pid {existing.owner_pid})"
                    )
                    raise LibraryError(
                        f"{existing.name} is already being {existing.state.removesuffix('ing')}ed{who}"
                    )
                if existing.state in ("ready", "downloaded", "broken"):
                    if existing.state == "downloaded":
                        return (
                            self._finish(existing.name, converter, on_event) if finish else existing
                        )
                    raise LibraryError(
                        f"{repo} is already in the library as {existing.name!r} ({existing.state}); "
                        "remove it first to download it again"
                    )
                # paused: continue the same commit so the partial files stay valid
                listing = hub.repo_listing(repo, existing.commit, tok)
                name = existing.name
                opts = dict(existing.options)
            else:
                listing = hub.repo_listing(repo, revision, tok)
                if listing.gated and not tok:
                    raise hub.gated_error(repo)  # before anything is written
                name = self._unique_name(name or slug(repo))
                opts = {"convert": convert, "keep_original": keep_original, "widths": widths}
                self.store.insert(
                    LibraryEntry(
                        name=name,
                        state="paused",
                        repo=repo,
                        revision=listing.revision,
                        commit=listing.commit,
                        original=str(self._dl_dir(name)),
                        options=opts,
                    )
                )
                created = True
            files = hub.model_files(listing)
            if not files:
                self._set(name, on_event, state="broken", error=f"{repo} has no model files")
                raise DownloadError(f"{repo} has no model files (config.json, *.safetensors)")
            self._claim(name, "downloading", on_event)
        control = control or Control()
        dl = transfer.Downloader(
            listing,
            self._dl_dir(name),
            files=files,
            tok=tok,
            control=control,
            on_event=on_event,
            **(transfer_options or {}),
        )
        dl.preflight = lambda: self._preflight(name, dl)
        try:
            got = dl.run()
        except Cancelled:
            if control.remove_partial:
                shutil.rmtree(self._dl_dir(name), ignore_errors=True)
                self.store.delete(name)
                if on_event:
                    on_event(StateChanged(name, "removed", "cancelled"))
            else:
                self._record_failure(
                    name,
                    on_event,
                    state="paused",
                    owner_pid=0,
                    error="cancelled; the partial download is kept",
                )
            raise
        except Paused:
            self._record_failure(name, on_event, state="paused", owner_pid=0, error="")
            raise
        except BaseException as e:
            if created and isinstance(e, DownloadError) and not e.resumable:
                # refused (a wrong token, custom code, a repo gone): no entry, no empty folder
                shutil.rmtree(self._dl_dir(name), ignore_errors=True)
                self.store.delete(name)
                if on_event:
                    on_event(StateChanged(name, "removed", str(e)))
                raise
            msg = str(e) if isinstance(e, DownloadError) else f"interrupted: {type(e).__name__} {e}"
            self._record_failure(name, on_event, state="paused", owner_pid=0, error=msg)
            raise
        cfg = read_config(self._dl_dir(name))
        self._set(
            name,
            on_event,
            state="downloaded",
            owner_pid=0,
            error="",
            original_files=[g.to_dict() for g in got],
            download_bytes=sum(g.size for g in got),
            architecture=str(cfg.get("model_type", "")),
        )
        if not finish:
            return self.store.get(name)
        return self._finish(name, converter, on_event, opts)

    def _preflight(self, name: str, dl: transfer.Downloader) -> None:
        """Called once the small files (config.json) are in: check room for the conversion too."""
        e = self.store.get(name)
        cfg = read_config(dl.dest)
        from app.engine.sizes import SizeError, check_dimensions

        try:
            check_dimensions(cfg)  # before anything is computed from it, or the weights fetched
        except SizeError as err:
            raise DownloadError(f"{e.repo}: {err}") from None
        custom = custom_code(cfg, dl.listing)
        if custom:
            from app.engine.loader import mlx_lm_has_model

            mt = str(cfg.get("model_type", "?"))
            if not mlx_lm_has_model(mt):
                raise UnsupportedModelError(
                    f"custom code is not supported: {e.repo} needs its own Python code "
                    f"({custom}) for model type {mt!r}, which mlx-lm does not have and "
                    "RotaryQuant never runs"
                )
        if not e.options.get("convert", True):
            return
        if not is_moe(cfg) or is_prequantized(cfg):
            return
        est = converted_size(cfg, e.options.get("widths"))
        if not est:
            return
        check = catalog.disk_check(
            self.root, {"rest of the download": dl.remaining_bytes(), "conversion": est}, dl.reserve
        )
        if not check.fits:
            raise DiskFullError(f"{e.repo}: {check.message}")

    def finish(self, name: str, on_event: Callback | None = None) -> LibraryEntry:
        """A downloaded model to ready: converted (an MoE) or registered as it is."""
        return self._finish(name, _DEFAULT, on_event)

    def _finish(
        self, name: str, converter, on_event: Callback | None, opts: dict | None = None
    ) -> LibraryEntry:
        e = self.store.get(name)
        opts = opts or e.options
        cfg = read_config(Path(e.original))
        conv = default_converter() if converter is _DEFAULT else converter
        if (
            opts.get("convert", True)
            and conv is not None
            and is_moe(cfg)
            and not is_prequantized(cfg)
        ):
            return self.convert(name, conv, on_event=on_event)
        reason = (
            "conversion not asked for"
            if not opts.get("convert", True)
            else "the converter is not available"
            if conv is None
            else "already quantized"
            if is_prequantized(cfg)
            else "not a mixture-of-experts model"
        )
        return self._register_as_is(name, reason, on_event)

    def _register_as_is(self, name: str, reason: str, on_event: Callback | None) -> LibraryEntry:
        """The download itself becomes the model folder."""
        from app.engine.errors import ModelLoadError
        from app.engine.loader import check_folder

        e = self.store.get(name)
        src = Path(e.original)
        try:
            check_folder(src)
        except ModelLoadError as err:
            return self._set(
                name,
                on_event,
                state="broken",
                error=f"downloaded, but not a loadable model folder: {err}",
            )
        final = self.root / name
        if final.exists():
            raise LibraryError(f"{final} already exists; it is not in the library: move it away")
        os.replace(src, final)
        cfg = read_config(final)
        return self._set(
            name,
            on_event,
            state="ready",
            folder=str(final),
            original="",
            files=e.original_files,
            original_files=[],
            disk_bytes=e.download_bytes,
            plan={"converted": False, "reason": reason, **plan_summary(cfg, folder=final)},
        )

    def convert(
        self,
        name: str,
        converter: Converter | None | object = _DEFAULT,
        widths: dict | None = None,
        on_event: Callback | None = None,
    ) -> LibraryEntry:
        """Convert a downloaded model into `<name>/`, atomically: the folder appears only when
        complete. The original is removed afterwards unless the entry says keep it."""
        e = self.get(name)
        conv = default_converter() if converter is _DEFAULT else converter
        if conv is None:
            raise LibraryError("the converter (app/engine/quant/convert.py) is not available")
        if e.busy:
            raise LibraryError(f"{name} is busy ({e.state})")
        src = Path(e.original) if e.original else None
        if src is None or not src.is_dir():
            raise LibraryError(f"{name}: the downloaded original is gone; download it again")
        widths = widths or e.options.get("widths")
        tmp = self._tmp_dir(name)
        self._remove_tmp(name)
        self._claim(name, "converting", on_event)
        last = [0.0]

        def progress(stage: str, fraction: float) -> None:
            last[0] = max(last[0], min(1.0, max(0.0, float(fraction))))  # monotonic for the UI
            if on_event is not None:
                on_event(ConvertProgress(name, stage, last[0]))

        try:
            progress("starting", 0.0)
            conv(src, tmp, {"widths": widths}, progress)
            from app.engine.loader import check_folder

            check_folder(tmp)
            progress("checking the result", last[0])
            files = folder_files(tmp)
            final = self.root / name
            if final.exists():  # an earlier conversion of the same download: replace it
                old = self.root / f".{name}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException as err:
            self._remove_tmp(name)
            self._set(
                name, on_event, state="downloaded", owner_pid=0, error=f"conversion failed: {err}"
            )
            raise
        progress("done", 1.0)
        cfg = read_config(final)
        keep = e.options.get("keep_original", False)
        disk = sum(f["size"] for f in files)
        e = self._set(
            name,
            on_event,
            state="ready",
            owner_pid=0,
            folder=str(final),
            files=files,
            disk_bytes=disk + (e.download_bytes if keep else 0),
            plan={"converted": True, **plan_summary(cfg, widths, folder=final)},
        )
        if not keep:
            shutil.rmtree(src, ignore_errors=True)
            e = self.store.update(name, original="", original_files=[])
        return e

    # -- other operations ---------------------------------------------------------------------

    def add_folder(
        self, folder: str | os.PathLike, name: str | None = None, source: str = ""
    ) -> LibraryEntry:
        """Register an existing model folder (hashes its files so verify can check them)."""
        from app.engine.loader import check_folder

        folder = Path(folder).resolve()
        config, manifest = check_folder(folder)
        name = name or folder.name
        files = folder_files(folder)
        return self.store.insert(
            LibraryEntry(
                name=name,
                state="ready",
                folder=str(folder),
                repo=source or (manifest.source if manifest else ""),
                architecture=str(config.get("model_type", "")),
                files=files,
                disk_bytes=sum(f["size"] for f in files),
                plan=plan_summary(config, folder=folder),
            )
        )

    def open_folder(
        self,
        folder: Path,
        on_event: Callback | None = None,
        converter: Converter | None | object = _DEFAULT,
    ) -> LibraryEntry:
        """A model folder the user already has: an MoE in Hugging Face form is converted into
        the library (the folder itself is never changed); anything else loadable is added
        where it is."""
        from app.engine.manifest import Manifest

        folder = Path(folder).expanduser().resolve()
        if not folder.is_dir():
            raise LibraryError(f"{folder} is not a folder")
        if not (folder / "config.json").is_file():
            raise LibraryError(f"{folder} has no config.json: not a model folder")
        known = next((e for e in self.store.all() if e.folder and Path(e.folder) == folder), None)
        if known is not None:
            raise LibraryError(f"{folder} is already in the library as {known.name!r}")
        cfg = read_config(folder)
        try:
            converted = bool((m := Manifest.load(folder)) and m.roles)
        except Exception:  # an unreadable manifest: check_folder below says what is wrong
            converted = False
        conv = default_converter() if converter is _DEFAULT else converter
        if converted or conv is None or not is_moe(cfg) or is_prequantized(cfg):
            return self.add_folder(folder, self._unique_name(slug(folder.name)))
        name = self._unique_name(slug(folder.name))
        self.store.insert(
            LibraryEntry(
                name=name,
                state="downloaded",
                original=str(folder),
                architecture=str(cfg.get("model_type", "")),
                options={"convert": True, "keep_original": True, "widths": None},
            )
        )
        try:
            return self.convert(name, conv, on_event=on_event)
        except BaseException:
            self.store.delete(name)  # nothing of the user's was touched; no entry left behind
            raise

    def _verify_builtin(self) -> VerifyReport:
        """The built-in model has no recorded hashes: its folder must load (structure)."""
        from app.engine.errors import ModelLoadError
        from app.engine.loader import check_folder

        b = self.builtin()
        if b is None:
            return VerifyReport(
                "built-in model", False, ("not prepared yet: run `rotaryquant prepare-default`",)
            )
        try:
            check_folder(b.folder)
        except ModelLoadError as err:
            return VerifyReport(
                b.name, False, (f"{err}; run `rotaryquant prepare-default --force`",)
            )
        return VerifyReport(b.name, True, (), len(b.files), b.disk_bytes, False)

    def remove(self, name: str, delete_files: bool = True) -> None:
        if self.is_builtin(name):
            raise LibraryError(f"{name} is built into the app and cannot be removed")
        e = self.get(name)
        if e.busy:
            raise LibraryError(f"{name} is {e.state} in process {e.owner_pid}; stop it first")
        if delete_files:
            for p in (e.folder, e.original, str(self._tmp_dir(name)), str(self._dl_dir(name))):
                # only folders the library made, under its root
                if p and Path(p).resolve().parent == self.root.resolve():
                    shutil.rmtree(p, ignore_errors=True)
        self.store.delete(name)

    def verify(self, name: str, deep: bool = False, structure: bool = True) -> VerifyReport:
        """Check a model's files against the sizes (and with `deep`, the sha256) recorded when it
        was downloaded or converted, and (`structure`) that the folder loads: config, shard
        headers, tokenizer. Marks it broken, or ready again, accordingly."""
        if self.is_builtin(name):
            return self._verify_builtin()
        e = self.get(name)
        if e.busy or e.state == "paused":
            raise LibraryError(f"{name} is {e.state}; verify it when the download is done")
        problems: list[str] = []
        n = nbytes = 0
        sets = []
        if e.folder:
            sets.append((Path(e.folder), e.files))
        if e.original and (e.state in ("downloaded", "broken") or e.options.get("keep_original")):
            sets.append((Path(e.original), e.original_files))
        if not sets:
            problems.append(f"{name} has no folder (state {e.state})")
        for folder, files in sets:
            if not folder.is_dir():
                problems.append(f"{folder}: the folder is missing")
                continue
            for f in files:
                p = folder / f["path"]
                if not p.is_file():
                    problems.append(f"{p}: missing")
                    continue
                size = p.stat().st_size
                if size != f["size"]:
                    problems.append(f"{p}: {size} bytes, expected {f['size']}")
                    continue
                if deep and f.get("sha256"):
                    got = transfer.hash_file(p).sha256.hexdigest()
                    if got != f["sha256"]:
                        problems.append(
                            f"{p}: sha256 {got[:12]}… differs from the recorded {f['sha256'][:12]}…"
                        )
                        continue
                n += 1
                nbytes += size
        records = 0
        if structure and not problems and e.folder and e.state in ("ready", "broken"):
            from app.engine.errors import ModelLoadError
            from app.engine.loader import check_folder
            from app.engine.offload.records import ExpertRecordError

            try:
                _, manifest = check_folder(e.folder)
                if manifest is not None and manifest.experts:
                    records = _verify_records(Path(e.folder), manifest.experts)
            except ModelLoadError as err:
                problems.append(str(err))
            except ExpertRecordError as err:
                problems.append(str(err))
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            self._set(name, None, state="broken", error=problems[0] + more)
        elif e.state == "broken":
            self._set(name, None, state="ready" if e.folder else "downloaded", error="")
        return VerifyReport(name, not problems, tuple(problems), n, nbytes, deep, records)
