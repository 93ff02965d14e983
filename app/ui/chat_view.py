"""The chat view: conversations, the transcript, the input and the sampling settings.

The transcript is rebuilt (one setHtml) only when a message is added, finished or removed;
streamed tokens are appended at the end with a text cursor, batched every FLUSH_MS, so the
cost per token stays constant however long the conversation grows.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import (
    QAction,
    QColor,
    QKeySequence,
    QShortcut,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from . import render
from .chat_model import ChatModel
from .history import Message
from .theme import current_colors

FLUSH_MS = 30  # tokens are painted in batches: ~33 updates a second at most, whatever the tok/s


class ChatView(QWidget):
    status = Signal(str)

    def __init__(self, model: ChatModel, parent=None):
        super().__init__(parent)
        self.model = model
        self.expanded: set[int] = set()  # messages whose thinking is shown
        self.splitter_think = render.ThinkSplitter()
        self.pending: list[str] = []
        self.flush_timer = QTimer(self)
        self.flush_timer.setSingleShot(True)
        self.flush_timer.setInterval(FLUSH_MS)
        self.flush_timer.timeout.connect(self.flush_tokens)
        self.unavailable_kv: dict[str, str] = {}
        self._build()
        m = model
        m.conversations_changed.connect(self.refresh_conversations)
        m.conversation_changed.connect(self._on_conversation)
        m.message_added.connect(self._on_message_added)
        m.message_changed.connect(lambda _m: self.render_all())
        m.message_removed.connect(lambda _id: self.render_all())
        m.token_received.connect(self._on_token)
        m.busy_changed.connect(lambda _b: self.update_actions())
        m.settings_changed.connect(self.load_settings)
        m.stream_failed.connect(self._on_stream_failed)
        m.session.state_changed.connect(lambda *_: self.update_actions())
        m.session.model_loaded.connect(self._on_model_loaded)
        self.refresh_conversations()
        self.load_settings()
        self.update_actions()

    # -- layout ------------------------------------------------------------------------------
    def _build(self) -> None:
        self.conv_list = QListWidget()
        self.conv_list.setAccessibleName("Conversations")
        self.conv_list.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conv_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conv_list.itemSelectionChanged.connect(self._on_conv_selected)
        # F2 or a double click renames a conversation in place
        self.conv_list.setEditTriggers(
            QAbstractItemView.EditTrigger.DoubleClicked
            | QAbstractItemView.EditTrigger.EditKeyPressed
        )
        self.conv_list.itemChanged.connect(self._on_conv_renamed)
        self.conv_list.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        for text, slot in (("Rename", self.rename_current), ("Delete", self.delete_current)):
            a = QAction(text, self.conv_list)
            a.triggered.connect(slot)
            self.conv_list.addAction(a)
        self.new_btn = QPushButton("&New chat")
        self.new_btn.clicked.connect(self.new_chat)
        self.delete_btn = QPushButton("Delete")
        self.delete_btn.clicked.connect(self.delete_current)
        row = QHBoxLayout()
        row.addWidget(self.new_btn, 1)
        row.addWidget(self.delete_btn)
        conv_box = QWidget()
        lay = QVBoxLayout(conv_box)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(row)
        lay.addWidget(self.conv_list, 1)

        self.settings_box = self._build_settings()
        self.left = QSplitter(Qt.Orientation.Vertical)
        self.left.setObjectName("chatLeftSplitter")
        self.left.addWidget(conv_box)
        self.left.addWidget(self.settings_box)
        self.left.setStretchFactor(0, 1)
        self.left.setStretchFactor(1, 0)

        self.transcript = QTextBrowser()
        self.transcript.setAccessibleName("Transcript")
        self.transcript.setOpenLinks(False)
        self.transcript.anchorClicked.connect(self._on_anchor)
        self.transcript.document().setDocumentMargin(12)
        self.input = QPlainTextEdit()
        self.input.setAccessibleName("Message")
        self.input.setPlaceholderText("Message — Ctrl+Enter to send, Esc to stop")
        self.input.setFixedHeight(84)
        self.input.setTabChangesFocus(True)
        self.enter_sends = False  # the settings' option: Enter sends, Shift+Enter a new line
        self.input.installEventFilter(self)
        self.regen_btn = QPushButton("&Regenerate")
        self.copy_btn = QPushButton("&Copy answer")
        self.stop_btn = QPushButton("Stop")
        self.send_btn = QPushButton("Send")
        self.send_btn.setDefault(True)
        self.regen_btn.clicked.connect(self.model.regenerate)
        self.copy_btn.clicked.connect(self.copy_last)
        self.stop_btn.clicked.connect(self.model.stop)
        self.send_btn.clicked.connect(self.send)
        self.hint = QLabel("")
        self.hint.setObjectName("muted")
        # a long engine message must not widen the window (it is elided; the tooltip has it)
        self.hint.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        buttons = QHBoxLayout()
        buttons.addWidget(self.hint, 1)
        for b in (self.regen_btn, self.copy_btn, self.stop_btn, self.send_btn):
            buttons.addWidget(b)
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.addWidget(self.transcript, 1)
        rl.addWidget(self.input)
        rl.addLayout(buttons)

        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("chatSplitter")
        self.splitter.addWidget(self.left)
        self.splitter.addWidget(right)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([250, 700])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(self.splitter)

        for seq in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(
                QKeySequence(seq),
                self,
                self.send,
                context=Qt.ShortcutContext.WidgetWithChildrenShortcut,
            )
        QShortcut(
            QKeySequence(Qt.Key.Key_Escape),
            self,
            self.model.stop,
            context=Qt.ShortcutContext.WidgetWithChildrenShortcut,
        )
        QShortcut(
            QKeySequence("Ctrl+Shift+C"),
            self,
            self.copy_last,
            context=Qt.ShortcutContext.WidgetWithChildrenShortcut,
        )
        QShortcut(
            QKeySequence("Ctrl+R"),
            self,
            self.model.regenerate,
            context=Qt.ShortcutContext.WidgetWithChildrenShortcut,
        )
        QShortcut(
            QKeySequence(Qt.Key.Key_Delete),
            self.conv_list,
            self.delete_current,
            context=Qt.ShortcutContext.WidgetShortcut,
        )

    def _build_settings(self) -> QGroupBox:
        box = QGroupBox("Settings for this chat")
        form = QFormLayout(box)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("System prompt (optional)")
        self.system_edit.setFixedHeight(60)
        self.system_edit.setTabChangesFocus(True)
        self.temp_spin = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2)
        self.temp_spin.setSpecialValueText("0 (greedy)")
        self.top_p_spin = QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05, decimals=2)
        self.top_k_spin = QSpinBox(minimum=0, maximum=1000)
        self.top_k_spin.setSpecialValueText("off")
        self.max_spin = QSpinBox(minimum=1, maximum=131072, singleStep=256)
        self.rep_spin = QDoubleSpinBox(minimum=0.5, maximum=2.0, singleStep=0.05, decimals=2)
        self.seed_spin = QSpinBox(minimum=-1, maximum=2**31 - 1)
        self.seed_spin.setSpecialValueText("random")
        self.kv_combo = QComboBox()
        self.kv_combo.setToolTip("How the KV cache is stored while this chat generates")
        form.addRow(self.system_edit)
        form.addRow("&Temperature", self.temp_spin)
        form.addRow("Top &p", self.top_p_spin)
        form.addRow("Top &k", self.top_k_spin)
        form.addRow("&Max tokens", self.max_spin)
        form.addRow("Repetition", self.rep_spin)
        form.addRow("S&eed", self.seed_spin)
        form.addRow("&KV cache", self.kv_combo)
        for w in (self.temp_spin, self.top_p_spin, self.rep_spin):
            w.valueChanged.connect(self.save_settings)
        for w in (self.top_k_spin, self.max_spin, self.seed_spin):
            w.valueChanged.connect(self.save_settings)
        self.kv_combo.currentIndexChanged.connect(self.save_settings)
        self.system_edit.textChanged.connect(self._system_changed)
        self.system_timer = QTimer(self, singleShot=True, interval=400)
        self.system_timer.timeout.connect(self.save_settings)
        return box

    # -- settings ----------------------------------------------------------------------------
    def set_kv_modes(self, modes: list[str], unavailable: dict[str, str]) -> None:
        """Modes the loaded model runs, and those that exist but not here, with the reason."""
        self.unavailable_kv = dict(unavailable)
        self.kv_combo.blockSignals(True)
        self.kv_combo.clear()
        for mode in modes:
            self.kv_combo.addItem(mode, mode)
        for mode, why in unavailable.items():
            if mode in modes:
                continue
            self.kv_combo.addItem(f"{mode} (unavailable)", mode)
            i = self.kv_combo.count() - 1
            item = self.kv_combo.model().item(i)
            item.setEnabled(False)
            item.setToolTip(why)
            self.kv_combo.setItemData(i, why, Qt.ItemDataRole.ToolTipRole)
        self.kv_combo.blockSignals(False)
        self.load_settings()

    def load_settings(self) -> None:
        s = self.model.settings()
        widgets = (
            self.temp_spin,
            self.top_p_spin,
            self.top_k_spin,
            self.max_spin,
            self.rep_spin,
            self.seed_spin,
            self.kv_combo,
            self.system_edit,
        )
        for w in widgets:
            w.blockSignals(True)
        self.temp_spin.setValue(float(s["temperature"]))
        self.top_p_spin.setValue(float(s["top_p"]))
        self.top_k_spin.setValue(int(s["top_k"]))
        self.max_spin.setValue(int(s["max_tokens"]))
        self.rep_spin.setValue(float(s["repetition_penalty"]))
        self.seed_spin.setValue(-1 if s["seed"] is None else int(s["seed"]))
        i = self.kv_combo.findData(s.get("kv_mode", "fp16"))
        self.kv_combo.setCurrentIndex(max(i, 0))
        if self.system_edit.toPlainText() != self.model.system_prompt():
            self.system_edit.setPlainText(self.model.system_prompt())
        for w in widgets:
            w.blockSignals(False)

    def _system_changed(self) -> None:
        self.system_timer.start()

    def save_settings(self) -> None:
        seed = self.seed_spin.value()
        s = {
            "temperature": self.temp_spin.value(),
            "top_p": self.top_p_spin.value(),
            "top_k": self.top_k_spin.value(),
            "max_tokens": self.max_spin.value(),
            "repetition_penalty": self.rep_spin.value(),
            "seed": None if seed < 0 else seed,
        }
        if self.kv_combo.currentData():
            s["kv_mode"] = self.kv_combo.currentData()
        self.model.set_settings(s, self.system_edit.toPlainText())

    # -- conversations -----------------------------------------------------------------------
    def refresh_conversations(self) -> None:
        cur = self.model.current.id if self.model.current else 0
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        for c in self.model.conversations():
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            item.setToolTip(f"{c.title}\n{c.model}" if c.model else c.title)
            self.conv_list.addItem(item)
            if c.id == cur:
                item.setSelected(True)
                self.conv_list.setCurrentItem(item)
        self.conv_list.blockSignals(False)

    def _on_conv_selected(self) -> None:
        items = self.conv_list.selectedItems()
        if items:
            self.model.open(items[0].data(Qt.ItemDataRole.UserRole))

    def _on_conversation(self, _cid: int) -> None:
        self.expanded.clear()
        self.refresh_conversations()
        self.render_all()
        self.update_actions()

    def new_chat(self) -> None:
        if self.model.new_conversation() is not None:
            self.input.setFocus()

    def set_enter_sends(self, on: bool) -> None:
        self.enter_sends = bool(on)
        keys = "Enter to send, Shift+Enter for a new line" if on else "Ctrl+Enter to send"
        self.input.setPlaceholderText(f"Message — {keys}, Esc to stop")

    def eventFilter(self, obj, event) -> bool:
        if (
            obj is self.input
            and self.enter_sends
            and event.type() == QEvent.Type.KeyPress
            and event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
            and not event.modifiers()
            & (Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.ControlModifier)
        ):
            self.send()
            return True
        return super().eventFilter(obj, event)

    def rename_current(self) -> None:
        item = self.conv_list.currentItem()
        if item is not None:
            self.conv_list.editItem(item)

    def _on_conv_renamed(self, item) -> None:
        cid = item.data(Qt.ItemDataRole.UserRole)
        if cid is not None and not self.model.rename_conversation(cid, item.text()):
            self.refresh_conversations()  # an empty name: the old one comes back

    def delete_current(self) -> None:
        c = self.model.current
        if c is None:
            return
        ok = QMessageBox.question(self, "Delete conversation", f"Delete “{c.title}”?")
        if ok == QMessageBox.StandardButton.Yes:
            self.model.delete_conversation(c.id)

    # -- sending -----------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText()
        if self.model.send(text):
            self.input.clear()

    def copy_last(self) -> None:
        if self.model.copy_last():
            self.status.emit("Answer copied to the clipboard")

    def update_actions(self) -> None:
        m, s = self.model, self.model.session
        busy = m.busy
        self.send_btn.setEnabled(m.can_send())
        self.stop_btn.setEnabled(busy)
        has_user = any(x.role == "user" for x in m.messages)
        self.regen_btn.setEnabled(m.can_send() and has_user)
        self.copy_btn.setEnabled(any(x.role == "assistant" and x.content for x in m.messages))
        self.delete_btn.setEnabled(m.current is not None and not busy)
        self.conv_list.setEnabled(not busy)  # the answer streams into the open conversation
        self.settings_box.setEnabled(not busy)
        if busy:
            self.hint.setText("Generating… Esc to stop")
        elif s.state == "ready":
            self.hint.setText("Ctrl+Enter to send")
        elif s.state == "crashed":  # the banner above says why, once
            self.hint.setText("The engine stopped: restart it above")
        else:
            self.hint.setText(s.message)
        self.hint.setToolTip(s.message)

    def _on_model_loaded(self, info: dict) -> None:
        self.update_actions()

    # -- transcript --------------------------------------------------------------------------
    def _who(self, m: Message) -> str:
        if m.role == "user":
            return "You"
        return m.meta.get("model") or "Assistant"

    def render_all(self) -> None:
        """Rebuild the transcript (per message, never per token); the message being streamed
        gets its header here and its text from `flush_tokens`."""
        self.flush_timer.stop()
        self.pending.clear()
        c = current_colors()
        parts = []
        for m in self.model.messages:
            if m is self.model.streaming:
                parts.append(render.message_html(m.id, m.role, "", "complete", self._who(m), c))
            else:
                parts.append(
                    render.message_html(
                        m.id,
                        m.role,
                        m.content,
                        m.state,
                        self._who(m),
                        c,
                        m.id in self.expanded,
                        m.meta,
                    )
                )
        if not parts:
            parts.append(
                f'<p style="color:{c.muted};">Ask anything. The answer streams here; '
                "Ctrl+Enter sends, Esc stops.</p>"
            )
        sb = self.transcript.verticalScrollBar()
        pos, at_end = sb.value(), sb.value() >= sb.maximum() - 4
        self.transcript.setHtml("".join(parts))
        self.splitter_think = render.ThinkSplitter()
        if self.model.streaming is not None:
            cur = QTextCursor(self.transcript.document())
            cur.movePosition(QTextCursor.MoveOperation.End)
            cur.insertBlock(QTextBlockFormat(), QTextCharFormat())  # the answer's own paragraph
            text = self.model.partial_text()  # a re-render mid-stream (theme change): repaint it
            if text:
                self._append(self.splitter_think.feed(text))
        if at_end or self.model.streaming is not None:
            sb.setValue(sb.maximum())
        else:  # setHtml goes back to the top: keep the place the user was reading
            sb.setValue(min(pos, sb.maximum()))

    def _on_stream_failed(self, why: str) -> None:
        if self.model.session.state != "crashed":  # a crash is said once, by the window's banner
            self.status.emit(f"The answer stopped: {why}")

    def _on_message_added(self, m: Message) -> None:
        self.render_all()
        self.update_actions()

    def _on_token(self, text: str) -> None:
        self.pending.append(text)
        if not self.flush_timer.isActive():
            self.flush_timer.start()

    def flush_tokens(self) -> None:
        if not self.pending or self.model.streaming is None:
            self.pending.clear()
            return
        text = "".join(self.pending)
        self.pending.clear()
        self._append(self.splitter_think.feed(text))

    def _append(self, pieces: list[tuple[str, str]]) -> None:
        sb = self.transcript.verticalScrollBar()
        at_end = sb.value() >= sb.maximum() - 4
        cur = QTextCursor(self.transcript.document())
        cur.movePosition(QTextCursor.MoveOperation.End)
        c = current_colors()
        for kind, text in pieces:
            fmt = QTextCharFormat()
            if kind == "think":
                fmt.setForeground(QColor(c.muted))
                fmt.setFontItalic(True)
            cur.insertText(text, fmt)
        if at_end:
            sb.setValue(sb.maximum())

    def _on_anchor(self, url) -> None:
        kind, _, arg = url.toString().partition(":")
        if kind == "think" and arg.isdigit():
            self.expanded ^= {int(arg)}
            self.render_all()
        elif kind == "copycode":
            mid, _, n = arg.partition(":")
            if mid.isdigit() and n.isdigit() and self.model.copy_code(int(mid), int(n)):
                self.status.emit("Code copied to the clipboard")
        elif kind == "copy" and arg.isdigit():
            self.model.copy_message(int(arg))
            self.status.emit("Copied to the clipboard")
        elif kind in ("http", "https"):
            from PySide6.QtGui import QDesktopServices

            QDesktopServices.openUrl(url)
