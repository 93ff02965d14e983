"""Light and dark themes that follow the system (Qt's color scheme hint), or a forced choice.

Fusion with an explicit palette looks the same on macOS, Windows and Linux and lets the chat's
HTML and the plots pick matching colors. `resources/style.qss` adds the few styles a palette
cannot express (banners, the plan's refusal box).
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from . import render

MODES = ("system", "light", "dark")
RESOURCES = Path(__file__).resolve().parents[2] / "resources"


def _palette(dark: bool) -> QPalette:
    p = QPalette()
    if dark:
        c = {
            "window": "#232427",
            "base": "#1b1c1f",
            "alt": "#26282c",
            "text": "#e8e8ea",
            "button": "#2d2f33",
            "highlight": "#2f6fcf",
            "htext": "#ffffff",
            "link": "#5aa2ff",
            "mid": "#3a3c41",
            "tip": "#2d2f33",
            "placeholder": "#8a8a90",
            "disabled": "#6b6b70",
        }
    else:
        c = {
            "window": "#f5f5f7",
            "base": "#ffffff",
            "alt": "#f0f0f3",
            "text": "#1d1d1f",
            "button": "#fbfbfd",
            "highlight": "#0a64d8",
            "htext": "#ffffff",
            "link": "#0a64d8",
            "mid": "#d0d0d6",
            "tip": "#ffffff",
            "placeholder": "#8a8a90",
            "disabled": "#a0a0a6",
        }
    R = QPalette.ColorRole
    roles = {
        R.Window: "window",
        R.WindowText: "text",
        R.Base: "base",
        R.AlternateBase: "alt",
        R.Text: "text",
        R.Button: "button",
        R.ButtonText: "text",
        R.Highlight: "highlight",
        R.HighlightedText: "htext",
        R.Link: "link",
        R.ToolTipBase: "tip",
        R.ToolTipText: "text",
        R.PlaceholderText: "placeholder",
        R.Mid: "mid",
        R.Midlight: "mid",
    }
    for role, key in roles.items():
        p.setColor(role, QColor(c[key]))
    for role in (R.WindowText, R.Text, R.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor(c["disabled"]))
    return p


class Theme(QObject):
    """The app's theme; `changed(dark)` tells views to re-color what a palette doesn't reach."""

    changed = Signal(bool)

    def __init__(self, app: QApplication, mode: str = "system"):
        super().__init__(app)
        self.app = app
        self.mode = mode if mode in MODES else "system"
        self.dark = False
        app.setStyle("Fusion")
        app.styleHints().colorSchemeChanged.connect(lambda _s: self.apply())
        self.apply()

    def system_is_dark(self) -> bool:
        return self.app.styleHints().colorScheme() == Qt.ColorScheme.Dark

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"theme must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.apply()

    def apply(self) -> None:
        dark = self.system_is_dark() if self.mode == "system" else self.mode == "dark"
        self.dark = dark
        self.app.setPalette(_palette(dark))
        self.app.setStyleSheet(stylesheet(dark))
        self.changed.emit(dark)

    @property
    def colors(self) -> render.Colors:
        return render.DARK if self.dark else render.LIGHT


def stylesheet(dark: bool) -> str:
    """resources/style.qss with its @tokens filled for the theme ('' if the file is absent:
    the palette alone still gives a usable app)."""
    path = RESOURCES / "style.qss"
    try:
        qss = path.read_text()
    except OSError:
        return ""
    c = render.DARK if dark else render.LIGHT
    tokens = {
        "@error_bg": "#3a1f1f" if dark else "#fdecea",
        "@error_border": c.error,
        "@error": c.error,
        "@muted": c.muted,
        "@accent": c.accent,
        "@ok_bg": "#1f3326" if dark else "#e9f6ec",
        "@card": "#26282c" if dark else "#ffffff",
        "@border": "#3a3c41" if dark else "#d0d0d6",
    }
    for k in sorted(tokens, key=len, reverse=True):
        qss = qss.replace(k, tokens[k])
    return qss


def current_colors() -> render.Colors:
    """The render colors for the app's palette (dark if the window color is dark)."""
    app = QGuiApplication.instance()
    if app is None:
        return render.LIGHT
    return (
        render.DARK
        if app.palette().color(QPalette.ColorRole.Window).lightness() < 128
        else render.LIGHT
    )
