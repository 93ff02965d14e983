"""Draw the app icon with QPainter and write resources/icon.png and resources/icon.icns.

The .icns is written directly (PNG-compressed entries, the format macOS reads since 10.7), so it
can be made without a Mac; `iconutil -c icns` on a Mac can rebuild it from
`packaging/make_icon.py --iconset DIR` (see packaging/MACOS.md).

Run: QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/make_icon.py
"""

from __future__ import annotations

import argparse
import math
import struct
import sys
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QPointF, QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QImage, QLinearGradient, QPainter, QPainterPath, QPen

ROOT = Path(__file__).resolve().parents[1]
RESOURCES = ROOT / "resources"
PNG_SIZE = 512  # the window / Linux desktop icon

# ICNS entry types holding PNG data, by pixel size (Apple's "ic07".."ic14", "icp4".."icp6").
ICNS_TYPES = [
    (b"icp4", 16), (b"icp5", 32), (b"icp6", 64), (b"ic07", 128), (b"ic08", 256),
    (b"ic09", 512), (b"ic10", 1024), (b"ic11", 32), (b"ic12", 64), (b"ic13", 256), (b"ic14", 512),
]
# iconutil's file names: (name, pixel size)
ICONSET = [
    (f"icon_{s}x{s}{'@2x' if k == 2 else ''}.png", s * k)
    for s in (16, 32, 128, 256, 512) for k in (1, 2)
]


def draw(size: int) -> QImage:
    """The icon at `size` px: a rotation arrow around three stepped bars (few-bit levels)."""
    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = size / 1024.0  # drawn on a 1024 grid
    # macOS icon grid: an 824 px rounded square centred in 1024 leaves room for the shadow.
    body = QRectF(100 * s, 100 * s, 824 * s, 824 * s)
    g = QLinearGradient(body.topLeft(), body.bottomRight())
    g.setColorAt(0.0, QColor("#2f6fcf"))
    g.setColorAt(1.0, QColor("#16295a"))
    path = QPainterPath()
    path.addRoundedRect(body, 185 * s, 185 * s)
    p.fillPath(path, QBrush(g))

    # The rotation: a 300-degree ring with an arrowhead at its open end.
    c = QPointF(512 * s, 512 * s)
    r = 290 * s
    pen = QPen(QColor("#ffffff"), 58 * s, Qt.PenStyle.SolidLine, Qt.PenCapStyle.FlatCap)
    p.setPen(pen)
    p.setBrush(Qt.BrushStyle.NoBrush)
    p.drawArc(QRectF(c.x() - r, c.y() - r, 2 * r, 2 * r), 110 * 16, 300 * 16)
    # arrowhead at 50 degrees (the arc runs counter-clockwise from 110 to 410 = 50 degrees)
    head = QPainterPath()
    tip_in, tip_out = r - 75 * s, r + 75 * s
    a = math.radians(50)
    ux, uy = math.cos(a), -math.sin(a)  # radial unit vector (screen y points down)
    tx, ty = -math.sin(a), -math.cos(a)  # tangent, pointing along the arc's direction
    base = QPointF(c.x() + ux * r, c.y() + uy * r)
    head.moveTo(c.x() + ux * tip_in, c.y() + uy * tip_in)
    head.lineTo(c.x() + ux * tip_out, c.y() + uy * tip_out)
    head.lineTo(base.x() + tx * 120 * s, base.y() + ty * 120 * s)
    head.closeSubpath()
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QColor("#ffffff"))
    p.drawPath(head)

    # Three stepped bars: quantization levels.
    bar_w, gap = 70 * s, 34 * s
    heights = (120 * s, 200 * s, 280 * s)
    x0 = c.x() - (3 * bar_w + 2 * gap) / 2
    bottom = c.y() + 140 * s
    colors = ("#9cc3ff", "#d2e3ff", "#ffffff")
    for i, h in enumerate(heights):
        p.setBrush(QColor(colors[i]))
        p.drawRoundedRect(QRectF(x0 + i * (bar_w + gap), bottom - h, bar_w, h), 12 * s, 12 * s)
    p.end()
    return img


def png_bytes(img: QImage) -> bytes:
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    if not img.save(buf, "PNG"):
        raise RuntimeError("could not encode the icon as PNG")
    return bytes(data.data())


def icns_bytes(pngs: dict[int, bytes]) -> bytes:
    """An .icns container: 'icns' + total length, then (type, length, PNG data) entries."""
    body = b"".join(t + struct.pack(">I", 8 + len(pngs[n])) + pngs[n] for t, n in ICNS_TYPES)
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESOURCES)
    ap.add_argument("--iconset", type=Path, help="also write an iconutil .iconset folder here")
    args = ap.parse_args(argv)
    sizes = sorted({n for _, n in ICNS_TYPES} | {PNG_SIZE})
    pngs = {n: png_bytes(draw(n)) for n in sizes}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "icon.png").write_bytes(pngs[PNG_SIZE])
    (args.out / "icon.icns").write_bytes(icns_bytes(pngs))
    if args.iconset:
        args.iconset.mkdir(parents=True, exist_ok=True)
        for name, n in ICONSET:
            (args.iconset / name).write_bytes(pngs[n])
    print(f"wrote {args.out / 'icon.png'} and {args.out / 'icon.icns'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
