"""Render the app icon (resources/icon.svg, the one design source) into resources/icon.icns.

The .icns is written directly (PNG-compressed entries, the format macOS reads since 10.7), so it
can be made without a Mac; on a Mac, `iconutil -c icns` can rebuild it from the folder that
`--iconset DIR` writes (see packaging/MACOS.md). The window icon (resources/icon.png) and the
SVG belong to the UI; this script only reads the SVG.

Run: QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/make_icon.py
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QRectF, Qt
from PySide6.QtGui import QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ROOT = Path(__file__).resolve().parents[1]
RESOURCES = ROOT / "resources"
SVG = RESOURCES / "icon.svg"

# ICNS entry types holding PNG data, by pixel size (Apple's "icp4".."icp6", "ic07".."ic14").
ICNS_TYPES = [
    (b"icp4", 16),
    (b"icp5", 32),
    (b"icp6", 64),
    (b"ic07", 128),
    (b"ic08", 256),
    (b"ic09", 512),
    (b"ic10", 1024),
    (b"ic11", 32),
    (b"ic12", 64),
    (b"ic13", 256),
    (b"ic14", 512),
]
# iconutil's file names: (name, pixel size)
ICONSET = [
    (f"icon_{s}x{s}{'@2x' if k == 2 else ''}.png", s * k)
    for s in (16, 32, 128, 256, 512)
    for k in (1, 2)
]


def render(svg: Path, size: int) -> QImage:
    """The SVG drawn into a transparent size x size image."""
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise ValueError(f"{svg}: not a valid SVG icon")
    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(p, QRectF(0, 0, size, size))
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
    ap.add_argument("--svg", type=Path, default=SVG)
    ap.add_argument("--out", type=Path, default=RESOURCES / "icon.icns")
    ap.add_argument("--iconset", type=Path, help="also write an iconutil .iconset folder here")
    args = ap.parse_args(argv)
    pngs = {n: png_bytes(render(args.svg, n)) for n in sorted({n for _, n in ICNS_TYPES})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(icns_bytes(pngs))
    if args.iconset:
        args.iconset.mkdir(parents=True, exist_ok=True)
        for name, n in ICONSET:
            (args.iconset / name).write_bytes(pngs[n])
    print(f"wrote {args.out} from {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
