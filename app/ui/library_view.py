"""The library view: models on this computer (load, pause, resume, cancel, convert, verify,
remove) with progress bars, and the catalog with a download button per model."""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, QRect, Qt, Signal
from PySide6.QtGui import QColor, QKeySequence, QPainter, QPalette, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSplitter,
    QStyledItemDelegate,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from ..downloads.catalog import find as cat_find
from .library_model import (
    CatalogModel,
    LibraryController,
    LocalModelsModel,
    ProgressRole,
    advice,
)


class ProgressDelegate(QStyledItemDelegate):
    """Draws the cell as a progress bar (its fraction filled) under one line of elided text."""

    def paint(self, painter, option, index):
        frac = index.data(ProgressRole)
        if frac is None:
            return super().paint(painter, option, index)
        pal = option.palette
        r = option.rect.adjusted(3, 4, -3, -4)
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(pal.color(QPalette.ColorRole.AlternateBase))
        painter.drawRoundedRect(r, 3, 3)
        fill = QColor(pal.color(QPalette.ColorRole.Highlight))
        fill.setAlpha(110)
        painter.setBrush(fill)
        done = QRect(r)
        done.setWidth(int(r.width() * max(0.0, min(1.0, float(frac)))))
        painter.drawRoundedRect(done, 3, 3)
        painter.setPen(pal.color(QPalette.ColorRole.Text))
        text = option.fontMetrics.elidedText(
            str(index.data(Qt.ItemDataRole.DisplayRole)), Qt.TextElideMode.ElideRight, r.width() - 8
        )
        painter.drawText(
            r.adjusted(4, 0, -4, 0),
            Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft,
            text,
        )
        painter.restore()


def _table(model) -> QTableView:
    t = QTableView()
    t.setModel(model)
    t.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    t.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    t.setAlternatingRowColors(True)
    t.verticalHeader().hide()
    t.setShowGrid(False)
    t.setWordWrap(False)
    t.verticalHeader().setDefaultSectionSize(28)
    t.setTabKeyNavigation(False)
    return t


class LibraryView(QWidget):
    load_requested = Signal(str)  # a model reference for the worker
    plan_requested = Signal(str, str)  # target, label
    status = Signal(str)

    def __init__(self, ctl: LibraryController, parent=None):
        super().__init__(parent)
        self.ctl = ctl
        self.local = LocalModelsModel(ctl, self)
        self.cat = CatalogModel(ctl, self)
        self.buttons: dict[str, QPushButton] = {}
        self._build()
        ctl.catalog_changed.connect(self._update_download_buttons)
        ctl.failed.connect(self._on_failed)
        ctl.job_finished.connect(self._on_job_finished)
        ctl.message.connect(self.status)
        self._keep: str | None = None
        self.local.modelAboutToBeReset.connect(self._remember_selection)
        self.local.modelReset.connect(self._after_reload)
        self._update_download_buttons()
        self._update_actions()

    def _build(self) -> None:
        self.table = _table(self.local)
        self.table.setAccessibleName("Models on this computer")
        self.table.setItemDelegateForColumn(4, ProgressDelegate(self.table))
        h = self.table.horizontalHeader()
        h.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        h.setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        for col, w in enumerate((210, 90, 70, 200, 280)):
            self.table.setColumnWidth(col, w)
        self.table.selectionModel().selectionChanged.connect(self._on_local_selected)
        self.table.doubleClicked.connect(lambda _ix: self.load_selected())
        self.load_btn = QPushButton("&Load")
        self.plan_btn = QPushButton("&Plan…")
        self.pause_btn = QPushButton("Pa&use")
        self.resume_btn = QPushButton("Re&sume")
        self.cancel_btn = QPushButton("Cancel")
        self.convert_btn = QPushButton("Con&vert")
        self.verify_btn = QPushButton("&Verify")
        self.remove_btn = QPushButton("Remove")
        self.open_btn = QPushButton("&Open folder…")
        self.open_btn.setToolTip(
            "Add a model folder you already have (MLX or Hugging Face "
            "safetensors); a mixture-of-experts model is converted"
        )
        self.open_btn.clicked.connect(lambda: self.open_folder())
        actions = (
            (self.load_btn, self.load_selected),
            (self.plan_btn, self.plan_selected),
            (self.pause_btn, lambda: self._on_selected(self.ctl.pause)),
            (self.resume_btn, lambda: self._on_selected(self.ctl.resume)),
            (self.cancel_btn, lambda: self._on_selected(self.ctl.cancel)),
            (self.convert_btn, lambda: self._on_selected(self.ctl.convert)),
            (self.verify_btn, lambda: self._on_selected(self.ctl.verify)),
            (self.remove_btn, lambda: self._on_selected(self.ctl.remove)),
        )
        row = QHBoxLayout()
        for b, fn in actions:
            b.clicked.connect(fn)
            row.addWidget(b)
        row.addStretch(1)
        row.addWidget(self.open_btn)
        self.detail = QLabel("")
        self.detail.setWordWrap(True)
        self.detail.setObjectName("error")
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        QShortcut(
            QKeySequence(Qt.Key.Key_Return),
            self.table,
            self.load_selected,
            context=Qt.ShortcutContext.WidgetShortcut,
        )
        QShortcut(
            QKeySequence(Qt.Key.Key_Delete),
            self.table,
            lambda: self._on_selected(self.ctl.remove),
            context=Qt.ShortcutContext.WidgetShortcut,
        )
        QShortcut(
            QKeySequence(Qt.Key.Key_F5),
            self,
            lambda: self.ctl.refresh(check=True),
            context=Qt.ShortcutContext.WidgetWithChildrenShortcut,
        )

        top = QWidget()
        tl = QVBoxLayout(top)
        tl.setContentsMargins(0, 0, 0, 0)
        head = QLabel("On this computer")
        head.setObjectName("heading")
        tl.addWidget(head)
        tl.addWidget(self.table, 1)
        tl.addLayout(row)
        tl.addWidget(self.detail)

        self.catalog = _table(self.cat)
        self.catalog.setAccessibleName("Catalog")
        ch = self.catalog.horizontalHeader()
        for col, w in enumerate((190, 90, 125, 70, 200, 100)):
            self.catalog.setColumnWidth(col, w)
        ch.setSectionResizeMode(4, QHeaderView.ResizeMode.Stretch)
        for i, e in enumerate(self.ctl.catalog):
            b = QPushButton("Download")
            b.setAccessibleName(f"Download {e.name}")
            b.clicked.connect(lambda _c=False, i=i: self.download_catalog_row(i))
            self.buttons[e.repo.lower()] = b
            self.catalog.setIndexWidget(self.cat.index(i, 5), b)
        self.catalog.doubleClicked.connect(self._plan_catalog)
        # one selection across the two tables: "Plan…" plans the selected model, local or not
        self.catalog.selectionModel().selectionChanged.connect(self._on_catalog_selected)
        self.repo_edit = QLineEdit()
        self.repo_edit.setPlaceholderText(
            "Any Hugging Face repo id, e.g. mlx-community/Qwen3-30B-A3B-4bit"
        )
        self.repo_btn = QPushButton("Download repo")
        self.repo_btn.clicked.connect(self._download_repo)
        self.repo_edit.returnPressed.connect(self._download_repo)
        free = QHBoxLayout()
        free.addWidget(self.repo_edit, 1)
        free.addWidget(self.repo_btn)
        self.catalog_error = QLabel("")
        self.catalog_error.setObjectName("error")
        self.catalog_error.setWordWrap(True)
        self.catalog_error.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.retry_btn = QPushButton("&Retry")
        self.retry_btn.clicked.connect(self.retry)
        self.retry_btn.hide()
        self._retry_repo: str | None = None
        errors = QHBoxLayout()
        errors.addWidget(self.catalog_error, 1)
        errors.addWidget(self.retry_btn, 0, Qt.AlignmentFlag.AlignTop)
        bottom = QWidget()
        bl = QVBoxLayout(bottom)
        bl.setContentsMargins(0, 0, 0, 0)
        head2 = QLabel("Download from the Hugging Face hub")
        head2.setObjectName("heading")
        bl.addWidget(head2)
        bl.addWidget(self.catalog, 1)
        bl.addLayout(free)
        bl.addLayout(errors)

        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.setObjectName("librarySplitter")
        self.splitter.addWidget(top)
        self.splitter.addWidget(bottom)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addWidget(self.splitter)

    # -- selection ---------------------------------------------------------------------------
    def selected_row(self):
        ix = self.table.selectionModel().selectedRows()
        return self.local.rows[ix[0].row()] if ix else None

    def select(self, name: str) -> None:
        i = self.local.row_of(name)
        if i >= 0:
            self.table.selectRow(i)

    def _on_selected(self, fn) -> None:
        r = self.selected_row()
        if r is not None and not r.builtin:
            fn(r.name)

    def load_selected(self) -> None:
        r = self.selected_row()
        if r is not None and r.state == "ready":
            self.load_requested.emit(r.ref)

    def plan_selected(self) -> None:
        r = self.selected_row()
        if r is not None and r.state == "ready":
            self.plan_requested.emit(r.ref, r.name)
            return
        e = self.selected_catalog()
        if e is not None and e.config:
            self.plan_requested.emit(e.config, e.name)

    def selected_catalog(self):
        ix = self.catalog.selectionModel().selectedRows()
        return self.ctl.catalog[ix[0].row()] if ix else None

    def _on_local_selected(self, *_):
        if self.table.selectionModel().hasSelection():
            self.catalog.clearSelection()
        self._update_actions()

    def _on_catalog_selected(self, *_):
        if self.catalog.selectionModel().hasSelection():
            self.table.clearSelection()
        self._update_actions()

    def open_folder(self, folder: str | None = None) -> None:
        """Add a model folder the user has; asks for it when not given."""
        if folder is None:
            from PySide6.QtWidgets import QFileDialog

            folder = QFileDialog.getExistingDirectory(self, "Open a model folder")
            if not folder:
                return
        self.catalog_error.clear()
        self.status.emit(f"Checking {folder}…")
        self.ctl.open_folder(folder)

    def _plan_catalog(self, ix: QModelIndex) -> None:
        e = self.ctl.catalog[ix.row()]
        if e.config:
            self.plan_requested.emit(e.config, e.name)

    def download_catalog_row(self, i: int) -> None:
        """The Download button of catalog row `i`: that row becomes the selected one."""
        self.catalog.selectRow(i)
        self._start(self.ctl.catalog[i].repo)

    def _download_repo(self) -> None:
        # the typed id stays until its download is done: a failure leaves it to retry or fix
        self._start(self.repo_edit.text())

    def _start(self, repo: str) -> None:
        self.catalog_error.clear()
        self.retry_btn.hide()
        self.ctl.download(repo)

    def retry(self) -> None:
        if self._retry_repo:
            self._start(self._retry_repo)

    def _on_job_finished(self, repo: str, outcome: str) -> None:
        if outcome == "done" and self.repo_edit.text().strip().lower() == repo.lower():
            self.repo_edit.clear()

    def _remember_selection(self) -> None:
        r = self.selected_row()
        self._keep = r.name if r else None

    def _after_reload(self) -> None:
        if self._keep is not None:  # a refresh keeps the user's selection
            self.select(self._keep)
        self._update_actions()
        self._update_download_buttons()

    def _update_actions(self) -> None:
        r = self.selected_row()
        st = r.state if r else ""
        builtin = bool(r and r.builtin)
        self.load_btn.setEnabled(st == "ready")
        cat_entry = self.selected_catalog() if r is None else None
        self.plan_btn.setEnabled(st == "ready" or bool(cat_entry and cat_entry.config))
        self.pause_btn.setEnabled(st == "downloading")
        self.resume_btn.setEnabled(st == "paused")
        self.cancel_btn.setEnabled(st in ("downloading", "paused"))
        self.convert_btn.setEnabled(st == "downloaded")
        self.verify_btn.setEnabled(st in ("ready", "downloaded", "broken") and not builtin)
        self.remove_btn.setEnabled(
            st in ("ready", "paused", "downloaded", "broken") and not builtin
        )
        if r is None or r.entry is None:
            self.detail.clear()
            return
        self.detail.setText("\n".join(x for x in (r.error, advice(r.entry)) if x))

    def _update_download_buttons(self) -> None:
        for e in self.ctl.catalog:
            b = self.buttons[e.repo.lower()]
            state = self.cat.local_state(e)
            job = self.ctl.manager.job(e.repo)
            running = job is not None and not job.finished.is_set()
            if running or state in ("downloading", "converting"):
                b.setText("Downloading…" if state != "converting" else "Converting…")
                b.setEnabled(False)
            elif state == "paused":
                b.setText("Resume")
                b.setEnabled(True)
            elif state:
                b.setText("In library")
                b.setEnabled(False)
            else:
                b.setText("Download")
                b.setEnabled(True)

    def _on_failed(self, who: str, message: str) -> None:
        self.catalog_error.setText(f"{who}: {message}")
        # a download that failed before it began (not a local model's conversion or verify)
        e = cat_find(who)
        self._retry_repo = (
            who if (e.repo if e else who).strip().lower() in self.ctl.errors else None
        )
        self.retry_btn.setVisible(self._retry_repo is not None)
        self._update_actions()
        self._update_download_buttons()
