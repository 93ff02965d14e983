"""The model library as Qt models: local models (with download/conversion progress) and the
catalog, fed by `app.downloads` through one controller.

Download events arrive on download threads; the controller re-emits them as queued signals and
keeps the latest progress per model, so the table repaints one row per event (events are
already throttled at the source to 5 a second per download).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, Qt, Signal
from PySide6.QtGui import QColor

from ..downloads import catalog as cat
from ..downloads import jobs as lib_jobs
from ..downloads.events import ConvertProgress, DownloadProgress, StateChanged
from ..downloads.library import Library
from ..downloads.manager import DownloadManager
from ..downloads.store import LibraryEntry
from ..engine import jobs
from ..units import size
from .session import DEFAULT_MODEL_REF
from .tasks import TaskRunner
from .theme import current_colors

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
ProgressRole = Qt.ItemDataRole.UserRole + 1  # float 0..1 or None: the status cell's bar
RefRole = Qt.ItemDataRole.UserRole + 2  # what the worker loads for this row


def gib(n: float | int | None) -> str:
    return size(n) if n else "—"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "time left unknown"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s left"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s left"
    return f"{s // 3600} h {s % 3600 // 60:02d} min left"


def rate(bps: float) -> str:
    return f"{bps / 1e6:.1f} MB/s" if bps >= 1e5 else f"{bps / 1e3:.0f} kB/s"


def short_plan(plan: dict, compact: bool = False) -> str:
    """One line from a library entry's plan summary (app.downloads.library.plan_summary)."""
    if not plan:
        return "—"
    if plan.get("planner_refused"):
        return "does not fit this machine"
    p = plan.get("planner")
    if not p:
        return (
            gib(plan.get("converted_bytes")) + " converted" if plan.get("converted_bytes") else "—"
        )
    kv = p.get("kv_modes", {}).get("full", "fp16")
    if compact:
        paged = p.get("paging") and p.get("expert_bytes")
        share = (
            f", {p['expert_budget'] / p['expert_bytes']:.0%} of experts resident" if paged else ""
        )
        return f"fits: peak {gib(p.get('process_peak'))}{share}"
    experts = (
        f"experts paged ({gib(p['expert_budget'])} of {gib(p['expert_bytes'])})"
        if p.get("paging")
        else "experts resident"
        if p.get("expert_bytes")
        else "dense"
    )
    return f"peak {gib(p.get('process_peak'))} · KV {kv} · {experts}"


def advice(e: LibraryEntry) -> str:
    """What the user can do about an entry's state and error, in words."""
    if e.state == "paused":
        return "Resume to continue the download; it picks up where it stopped."
    if e.state == "downloaded" and e.error:
        return "Convert again. If it fails again, remove the model and download it again."
    if e.state == "downloaded":
        return "Convert it to the app's format to page its experts."
    if e.state == "broken":
        return "Verify again after fixing the files, or remove the model and download it again."
    return ""


@dataclass
class Row:
    name: str
    ref: str  # folder path for the worker, or the embedded model's reference
    architecture: str
    size: int
    plan: str
    state: str
    error: str = ""
    repo: str = ""
    builtin: bool = False
    entry: LibraryEntry | None = None


def embedded_row() -> Row:
    from ..engine.embedded import default_model_path

    folder = default_model_path()
    size = sum(p.stat().st_size for p in folder.glob("*") if p.is_file()) if folder.is_dir() else 0
    return Row(
        name=f"{EMBEDDED_NAME} (built in)",
        ref=DEFAULT_MODEL_REF,
        architecture="llama",
        size=size or 100 * 2**20,
        plan="small enough for any machine",
        state="ready",
        builtin=True,
    )


class LibraryController(QObject):
    entries_changed = Signal()
    progress_changed = Signal(str)  # model name or repo id
    state_changed = Signal(object)  # StateChanged
    catalog_changed = Signal()
    failed = Signal(str, str)  # name or repo, message
    message = Signal(str)
    job_finished = Signal(str, str)  # repo, outcome (done, paused, cancelled, failed)
    _event = Signal(object)  # from download threads
    _job_done = Signal(str, str, str)  # repo, outcome, error

    def __init__(
        self, library: Library | None = None, transfer_options: dict | None = None, parent=None
    ):
        super().__init__(parent)
        self.library = library or Library()
        self.transfer_options = dict(transfer_options or {})
        self.manager = DownloadManager(self.library, on_event=self._emit_event)
        self.runner = TaskRunner(self, "library")
        self.conversions = TaskRunner(self, "conversions")  # long: not in the way of refreshes
        self.entries: list[LibraryEntry] = []
        self.progress: dict[str, dict] = {}  # name or repo (lower) -> {"fraction", "text"}
        self.errors: dict[str, str] = {}  # repo (lower) -> error of a download that never began
        self.catalog = cat.load_catalog()
        self.verdicts: dict[str, str] = {}
        self._event.connect(self._on_event)
        self._job_done.connect(self._on_job_done)

    def _emit_event(self, ev) -> None:
        """Called on download threads; the window may have closed (it pauses downloads then)."""
        try:
            self._event.emit(ev)
        except RuntimeError:  # the controller is gone: the library's store still has the state
            pass

    # -- reading -----------------------------------------------------------------------------
    def refresh(self, check: bool = False) -> None:
        self.runner.submit("refresh", lambda: self.library.entries(check=check), self._set_entries)

    def _set_entries(self, entries: list[LibraryEntry]) -> None:
        self.entries = entries
        self.entries_changed.emit()

    def _lib_args(self) -> tuple[str, str]:
        return str(self.library.root), str(self.library.db_path)

    def load_verdicts(self) -> None:
        def run() -> dict[str, str]:
            plans = jobs.shared().call(lib_jobs.catalog_plans, *self._lib_args())
            out = {}
            for e in self.catalog:
                d = plans.get(e.name, {})
                if d.get("planner_refused"):
                    out[e.name] = "too large: " + d["planner_refused"].split(";")[0]
                elif d.get("planner"):
                    out[e.name] = short_plan(d, compact=True)
                else:
                    out[e.name] = "—"
            return out

        def done(v: dict) -> None:
            self.verdicts = v
            self.catalog_changed.emit()

        self.runner.submit("verdicts", run, done)

    def entry(self, name: str) -> LibraryEntry | None:
        return next((e for e in self.entries if e.name == name), None)

    def progress_for(self, e: LibraryEntry) -> dict | None:
        if e.state == "converting":
            return self.progress.get(e.name)
        if e.state == "downloading":
            return self.progress.get(e.repo.lower())
        return None

    # -- actions -----------------------------------------------------------------------------
    def download(self, repo: str, widths: dict | None = None) -> bool:
        repo = repo.strip()
        if "/" not in repo and cat.find(repo) is None:
            self.failed.emit(repo, f"{repo!r} is not a catalog model or a repo id (owner/name)")
            return False
        key = (cat.find(repo).repo if cat.find(repo) else repo).lower()
        self.errors.pop(key, None)
        try:
            opts = {"transfer_options": self.transfer_options} if self.transfer_options else {}
            if widths:
                opts["widths"] = widths
            job = self.manager.start(repo, finish=False, **opts)
        except Exception as e:  # already downloading, bad name: shown where the user clicked
            self.errors[key] = str(e)
            self.failed.emit(repo, str(e))
            return False
        self._watch(job)
        self.message.emit(f"Downloading {repo}…")
        self.catalog_changed.emit()
        return True

    def _watch(self, job) -> None:
        def wait():
            job.wait()
            try:
                self._job_done.emit(
                    job.repo, job.outcome, "" if job.error is None else str(job.error)
                )
            except RuntimeError:  # the window closed first
                pass

        threading.Thread(target=wait, name=f"watch {job.repo}", daemon=True).start()

    def pause(self, name: str) -> None:
        e = self.entry(name)
        if e is not None:
            self.manager.pause(e.repo)

    def resume(self, name: str) -> None:
        e = self.entry(name)
        if e is None:
            return
        try:
            opts = {"transfer_options": self.transfer_options} if self.transfer_options else {}
            job = self.manager.resume(name, finish=False, **opts)
        except Exception as err:
            self.failed.emit(name, str(err))
            return
        self._watch(job)

    def cancel(self, name: str, remove_partial: bool = True) -> None:
        e = self.entry(name)
        if e is None:
            return
        job = self.manager.job(e.repo)
        if job is not None and not job.finished.is_set():
            self.manager.cancel(e.repo, remove_partial)
        elif e.state == "paused" and remove_partial:
            self.remove(name)

    def remove(self, name: str) -> None:
        self.runner.submit(
            f"remove {name}",
            lambda: self.library.remove(name),
            lambda _r: (self.message.emit(f"Removed {name}"), self.refresh()),
            lambda err: self.failed.emit(name, str(err)),
            replace=False,
        )

    def _in_process(self, what: str, name: str, fn, *args) -> None:
        """Run a library job that imports MLX in a process of its own; a crash there is
        reported on the entry and the window goes on."""

        def run():
            try:
                return jobs.run_once(
                    fn,
                    *self._lib_args(),
                    *args,
                    name=f"rotaryquant-{what}",
                    on_event=self._emit_event,
                )
            except jobs.JobCrashed as err:
                # the dead process may have claimed the entry: put it back, then say why
                self.library.recover(name)
                e = self.library.store.get(name)
                if e is not None and not e.busy:
                    self.library.store.update(name, error=f"{what} failed: {err}")
                raise

        def failed(err) -> None:
            self.failed.emit(name, str(err))
            self.refresh()

        self.conversions.submit(
            f"{what} {name}", run, lambda _r: self.refresh(), failed, replace=False
        )

    def convert(self, name: str) -> None:
        self._in_process("conversion", name, lib_jobs.convert, name)

    def finish(self, name: str) -> None:
        """A finished download to ready (converted or registered), in its own process."""
        self._in_process("conversion", name, lib_jobs.finish, name)

    def open_folder(self, folder: str) -> None:
        """Add a model folder the user has: checked, converted if it needs it, then listed."""

        def done(e) -> None:
            self.message.emit(f"Added {e.name} to the library")
            self.refresh()

        def run():
            return jobs.run_once(
                lib_jobs.open_folder,
                *self._lib_args(),
                str(folder),
                name="rotaryquant-conversion",
                on_event=self._emit_event,
            )

        self.conversions.submit(
            f"open {folder}",
            run,
            done,
            lambda err: (self.failed.emit(str(folder), str(err)), self.refresh()),
            replace=False,
        )

    def verify(self, name: str) -> None:
        def done(report) -> None:
            self.message.emit(f"{name}: {'verified' if report.ok else report.problems[0]}")
            self.refresh()

        def run():
            return jobs.run_once(
                lib_jobs.verify, *self._lib_args(), name, True, name="rotaryquant-verify"
            )

        self.runner.submit(
            f"verify {name}", run, done, lambda err: self.failed.emit(name, str(err)), replace=False
        )

    def shutdown(self) -> None:
        self.manager.shutdown()

    # -- events ------------------------------------------------------------------------------
    def _on_event(self, ev) -> None:
        if isinstance(ev, DownloadProgress):
            key = ev.repo.lower()
            text = f"Downloading {ev.fraction:.0%} · {gib(ev.done)} of {gib(ev.total)}"
            if ev.rate > 0:
                text += f" · {rate(ev.rate)} · {duration(ev.eta)}"
            self.progress[key] = {"fraction": ev.fraction, "text": text, "total": ev.total}
            self.progress_changed.emit(key)
        elif isinstance(ev, ConvertProgress):
            self.progress[ev.name] = {
                "fraction": ev.fraction,
                "text": f"Converting {ev.fraction:.0%} · {ev.stage}",
            }
            self.progress_changed.emit(ev.name)
        elif isinstance(ev, StateChanged):
            self.state_changed.emit(ev)
            self.refresh()

    def _on_job_done(self, repo: str, outcome: str, error: str) -> None:
        self.progress.pop(repo.lower(), None)
        if outcome == "failed":
            self.errors[repo.lower()] = error
            self.failed.emit(repo, error)
        elif outcome == "done":
            e = self.library.find_repo(repo)
            if e is not None and e.state == "downloaded":
                self.finish(e.name)
        self.refresh()
        self.catalog_changed.emit()
        self.job_finished.emit(repo, outcome)


# ---------------------------------------------------------------------------------------------
class LocalModelsModel(QAbstractTableModel):
    COLUMNS = ("Model", "Architecture", "Size", "Plan on this machine", "Status")

    def __init__(self, ctl: LibraryController, parent=None):
        super().__init__(parent)
        self.ctl = ctl
        self.rows: list[Row] = []
        ctl.entries_changed.connect(self.reload)
        ctl.progress_changed.connect(self._on_progress)
        self.reload()

    def reload(self) -> None:
        self.beginResetModel()
        rows = [embedded_row()]
        for e in self.ctl.entries:
            p = self.ctl.progress.get(e.repo.lower(), {})
            rows.append(
                Row(
                    name=e.name,
                    ref=e.folder,
                    architecture=e.architecture or "—",
                    size=e.disk_bytes or e.download_bytes or p.get("total", 0),
                    plan=short_plan(e.plan),
                    state=e.state,
                    error=e.error,
                    repo=e.repo,
                    entry=e,
                )
            )
        self.rows = rows
        self.endResetModel()

    def row_of(self, name: str) -> int:
        return next((i for i, r in enumerate(self.rows) if r.name == name), -1)

    def _on_progress(self, key: str) -> None:
        for i, r in enumerate(self.rows):
            if r.name == key or r.repo.lower() == key:
                ix = self.index(i, len(self.COLUMNS) - 1)
                self.dataChanged.emit(ix, ix)

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.COLUMNS[section]
        return None

    def status(self, r: Row) -> tuple[str, float | None]:
        if r.entry is not None:
            p = self.ctl.progress_for(r.entry)
            if p is not None:
                return p["text"], p["fraction"]
        if r.state == "downloading":
            return "Downloading…", 0.0
        if r.state == "converting":
            return "Converting…", 0.0
        labels = {
            "ready": "Ready",
            "paused": "Paused",
            "downloaded": "Downloaded, not converted",
            "broken": "Broken",
        }
        text = labels.get(r.state, r.state)
        if r.error:
            text += f" — {r.error}"
        return text, None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        r = self.rows[index.row()]
        col = index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return (r.name, r.architecture, gib(r.size), r.plan, self.status(r)[0])[col]
        if role == ProgressRole and col == 4:
            return self.status(r)[1]
        if role == RefRole:
            return r.ref
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == 4 and (r.error or r.entry is not None and advice(r.entry)):
                return "\n".join(x for x in (r.error, advice(r.entry) if r.entry else "") if x)
            if col == 3 and r.entry is not None:
                return r.entry.plan.get("planner_summary") or r.entry.plan.get("planner_refused")
            if col == 0:
                return r.repo or r.ref
        if role == Qt.ItemDataRole.ForegroundRole and col == 4 and (r.error or r.state == "broken"):
            return QColor(current_colors().error)
        return None


class CatalogModel(QAbstractTableModel):
    COLUMNS = ("Model", "Architecture", "Parameters", "Download", "On this machine", "")

    def __init__(self, ctl: LibraryController, parent=None):
        super().__init__(parent)
        self.ctl = ctl
        ctl.catalog_changed.connect(self._changed)
        ctl.entries_changed.connect(self._changed)
        ctl.progress_changed.connect(self._changed)

    def _changed(self, *_):
        if self.rowCount():
            self.dataChanged.emit(
                self.index(0, 0), self.index(self.rowCount() - 1, self.columnCount() - 1)
            )

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.ctl.catalog)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.COLUMNS[section]
        return None

    def local_state(self, e: cat.CatalogEntry) -> str:
        """'' (not here), or the library state of this catalog model."""
        le = next((x for x in self.ctl.entries if x.repo.lower() == e.repo.lower()), None)
        return le.state if le else ""

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        e = self.ctl.catalog[index.row()]
        col = index.column()
        err = self.ctl.errors.get(e.repo.lower(), "")
        if role == Qt.ItemDataRole.DisplayRole:
            if col == 4 and err:
                return err
            return (
                e.name + (" (gated)" if e.gated else ""),
                e.architecture,
                f"{e.params / 1e9:.0f}B, {e.active_params / 1e9:.1f}B active",
                gib(e.approx_bytes),
                self.ctl.verdicts.get(e.name, "planning…"),
                "",
            )[col]
        if (
            role == Qt.ItemDataRole.ForegroundRole
            and col == 4
            and (err or self.ctl.verdicts.get(e.name, "").startswith("too large"))
        ):
            return QColor(current_colors().error)
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == 4:
                return err or self.ctl.verdicts.get(e.name, "")
            return e.repo
        if role == Qt.ItemDataRole.UserRole:
            return e.repo
        return None
