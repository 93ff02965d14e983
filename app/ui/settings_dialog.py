"""The app's settings: where its data lives, the model loaded at start, the sampling new
conversations start with, how Enter behaves in the message box; other parts of the app (the
local server's switch) add their own section with `add_section`."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from .. import paths


class SettingsDialog(QDialog):
    def __init__(self, window, parent=None):
        super().__init__(parent or window)
        self.setWindowTitle("Settings")
        self.window_ = window
        s = window.settings
        lay = QVBoxLayout(self)

        data = QGroupBox("Data folder")
        dl = QVBoxLayout(data)
        row = QHBoxLayout()
        self.data_edit = QLineEdit(str(paths.data_dir()))
        choose = QPushButton("Choose…")
        choose.clicked.connect(self._choose_data)
        row.addWidget(self.data_edit, 1)
        row.addWidget(choose)
        dl.addLayout(row)
        note = QLabel(
            "Models, the library and conversations. A new folder is used from the "
            "next start; the old one is left as it is."
        )
        note.setObjectName("muted")
        note.setWordWrap(True)
        dl.addWidget(note)
        lay.addWidget(data)

        chat = QGroupBox("Chat")
        form = QFormLayout(chat)
        self.model_combo = QComboBox()
        self.model_combo.addItem("The last model used", "")
        for i in range(window.model_combo.count()):
            self.model_combo.addItem(window.model_combo.itemText(i), window.model_combo.itemData(i))
        i = self.model_combo.findData(str(s.value("default_model", "") or ""))
        self.model_combo.setCurrentIndex(max(i, 0))
        form.addRow("Model at start:", self.model_combo)
        d = window.chat.default_settings
        self.temp_spin = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2)
        self.temp_spin.setValue(float(d["temperature"]))
        self.top_p_spin = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, decimals=2)
        self.top_p_spin.setValue(float(d["top_p"]))
        self.max_spin = QSpinBox(minimum=1, maximum=1 << 20)
        self.max_spin.setValue(int(d["max_tokens"]))
        form.addRow("Temperature (new chats):", self.temp_spin)
        form.addRow("Top p (new chats):", self.top_p_spin)
        form.addRow("Max tokens (new chats):", self.max_spin)
        self.enter_check = QCheckBox("Enter sends the message (Shift+Enter for a new line)")
        self.enter_check.setChecked(window.chat_view.enter_sends)
        form.addRow(self.enter_check)
        lay.addWidget(chat)

        self.sections = QVBoxLayout()  # sections added by other parts of the app
        lay.addLayout(self.sections)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
        self.accepted.connect(self.apply)

    def add_section(self, title: str, widget: QWidget) -> QGroupBox:
        box = QGroupBox(title)
        QVBoxLayout(box).addWidget(widget)
        self.sections.addWidget(box)
        return box

    def _choose_data(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Data folder", self.data_edit.text())
        if d:
            self.data_edit.setText(d)

    def apply(self) -> None:
        w, s = self.window_, self.window_.settings
        s.setValue("default_model", self.model_combo.currentData() or "")
        w.chat.default_settings.update(
            temperature=self.temp_spin.value(),
            top_p=self.top_p_spin.value(),
            max_tokens=self.max_spin.value(),
        )
        s.setValue("chat/enter_sends", self.enter_check.isChecked())
        w.chat_view.set_enter_sends(self.enter_check.isChecked())
        folder = Path(self.data_edit.text().strip()).expanduser()
        if self.data_edit.text().strip() and folder.resolve() != paths.data_dir().resolve():
            paths.set_data_dir(folder)
            w.statusBar().showMessage(f"The data folder is {folder} from the next start", 8000)
        w.save_state()
