"""What the packaged app keeps and drops (used by rotaryquant.spec; unit-tested without a build).

transformers is ~130 MB of Python, and its model files (modeling_*, image/video processors)
are not used: mlx-lm only needs AutoTokenizer, which imports tokenizer and config classes by
name. So the spec hidden-imports every `tokenization_*` / `configuration_*` module and excludes
the rest of `transformers.models`.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import subprocess
from pathlib import Path

# Never needed at run time; some are optional imports that would drag in hundreds of MB.
EXCLUDED_MODULES = [
    "torch",
    "torchvision",
    "torchaudio",
    "tensorflow",
    "tf_keras",
    "keras",
    "flax",
    "jax",
    "jaxlib",
    "onnxruntime",
    "accelerate",
    "datasets",
    "pandas",
    "scipy",
    "sklearn",
    "cv2",
    "matplotlib",
    "IPython",
    "jedi",
    "tkinter",
    "_tkinter",
    "pytest",
    "_pytest",
    "pytestqt",
    "PyQt5",
    "PyQt6",
    "PySide2",
    "setuptools",
    "pkg_resources",
    "_distutils_hack",
    "pytest_timeout",
    "app.engine.testing",  # test and benchmark fixtures (random models)
    # huggingface_hub's CLI, inference client, webhooks and Xet uploader (the app does its own
    # resumable downloads over plain HTTP, app/downloads/transfer.py)
    "hf_xet",
    "pydantic",
    "pydantic_core",
    "typer",
    "click",
    "rich",
    "pygments",
    "markdown_it",
    "huggingface_hub.cli",
    "huggingface_hub.commands",
    "huggingface_hub.inference",
    "huggingface_hub._webhooks_payload",
    "huggingface_hub._webhooks_server",
    # mlx-lm's training, serving and evaluation code
    "mlx_lm.tuner",
    "mlx_lm.lora",
    "mlx_lm.fuse",
    "mlx_lm.server",
    "mlx_lm.evaluate",
    "mlx_lm.upload",
    "mlx_lm.share",
    "mlx_lm.chat",
    "mlx_lm.cli_ui",
    "mlx_lm.perplexity",
    "mlx_lm.benchmark",
    "mlx_lm.manage",
    "mlx_lm.cache_prompt",
    # transformers: training, pipelines, export and test helpers
    "transformers.trainer",
    "transformers.trainer_seq2seq",
    "transformers.trainer_pt_utils",
    "transformers.training_args",
    "transformers.training_args_seq2seq",
    "transformers.pipelines",
    "transformers.exporters",
    "transformers.cli",
    "transformers.commands",
    "transformers.data",
    "transformers.testing_utils",
    "transformers.loss",
    "transformers.distributed",
    # Qt modules the app does not use (pyside6-essentials ships some of them)
    "PySide6.QtQml",
    "PySide6.QtQuick",
    "PySide6.QtQuickWidgets",
    "PySide6.QtQuickControls2",
    "PySide6.QtQuick3D",
    "PySide6.QtWebEngineCore",
    "PySide6.QtWebEngineWidgets",
    "PySide6.QtWebChannel",
    "PySide6.QtWebSockets",
    "PySide6.QtMultimedia",
    "PySide6.QtPdf",
    "PySide6.QtDesigner",
    "PySide6.QtUiTools",
    "PySide6.QtHelp",
    "PySide6.QtSql",
    "PySide6.QtTest",
    "PySide6.QtConcurrent",
    "PySide6.QtXml",
    "PySide6.QtNetwork",
    "PySide6.Qt3DCore",
    "PySide6.QtCharts",
    "PySide6.QtDataVisualization",
    "PySide6.QtGraphs",
    "pyqtgraph.opengl",
    "pyqtgraph.examples",
    "pyqtgraph.jupyter",
]

# Files (by their path inside the bundle) left out after analysis.
DROPPED_FILES = [
    "PySide6/Qt/translations/*",  # Qt's own dialog translations; the app is English-only
    "PySide6/Qt/plugins/imageformats/libqpdf*",
    "PySide6/Qt/plugins/imageformats/*qtiff*",
    "PySide6/Qt/plugins/imageformats/*qwebp*",
    "PySide6/Qt/plugins/imageformats/*qicns*",
    "PySide6/Qt/plugins/imageformats/*qtga*",
    "PySide6/Qt/plugins/imageformats/*qwbmp*",
    # embedded-device platforms (framebuffer, EGLFS, VNC); desktops use xcb or wayland
    "PySide6/Qt/plugins/platforms/libqeglfs*",
    "PySide6/Qt/plugins/platforms/libqlinuxfb*",
    "PySide6/Qt/plugins/platforms/libqminimal*",
    "PySide6/Qt/plugins/platforms/libqvnc*",
    "PySide6/Qt/plugins/platforms/libqvkkhrdisplay*",
    "PySide6/Qt/plugins/egldeviceintegrations/*",
    "PySide6/Qt/lib/libQt6EglF*",
    "libQt6EglF*",
    # GTK3 theme plugin: the app draws its own Fusion palette (app/ui/theme.py)
    "PySide6/Qt/plugins/platformthemes/libqgtk3*",
    "PySide6/Qt/plugins/generic/*",  # touch/tablet input plugins (evdev, tuio)
    "PySide6/Qt/plugins/platforminputcontexts/*",  # on-screen keyboards / IMEs via Qt plugins
    "PySide6/Qt/plugins/networkinformation/*",
    "PySide6/Qt/plugins/tls/*",
    "PySide6/Qt/lib/libQt6Pdf*",
    "PySide6/Qt/lib/libQt6Qml*",
    "PySide6/Qt/lib/libQt6Quick*",
    "PySide6/Qt/lib/libQt6Network*",
    "libcudart*",  # found through a ctypes reference; the Linux build is MLX's CPU backend
    "mlx/include/*",
    "mlx/share/*",  # C++ headers and CMake files for building extensions
    "*/tests/*",
    "*/test/*",
    "app/*.md",  # developer notes beside kernel sources
]

# Runtime hooks that run in every process of the app (see packaging/launcher.py: qt_env).
DROPPED_RUNTIME_HOOKS = ("pyi_rth_pyside6",)

KEPT_MODEL_PREFIXES = ("tokenization_", "configuration_")


def _models_dir() -> Path:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("transformers is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "models"


def _model_modules(models: Path | None = None) -> list[str]:
    """Every module name under transformers.models, from the files (nothing is imported)."""
    models = models or _models_dir()
    out = []
    for f in sorted(models.rglob("*.py")):
        rel = f.relative_to(models).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(["transformers", "models", *parts]))
    return out


def keep_model_module(name: str) -> bool:
    """transformers.models.X[.Y]: keep packages, tokenizer/config modules and all of `auto`."""
    parts = name.split(".")
    if parts[:2] != ["transformers", "models"] or len(parts) <= 3:
        return True  # transformers.models itself and each model's package (its __init__)
    if parts[2] == "auto":
        return True  # the Auto* registries, small and all consulted
    return parts[-1].startswith(KEPT_MODEL_PREFIXES)


def transformers_keep(models: Path | None = None) -> list[str]:
    return [m for m in _model_modules(models) if keep_model_module(m)]


def transformers_drop(models: Path | None = None) -> list[str]:
    return [m for m in _model_modules(models) if not keep_model_module(m)]


def _dist_info_patterns() -> list[str]:
    """Metadata of excluded packages: huggingface_hub and transformers test for a package by
    its metadata, then import it; metadata without the module would make them try and fail."""
    tops = [m for m in EXCLUDED_MODULES if "." not in m]
    return [f"{t}-*.dist-info/*" for t in tops] + [f"{t.lower()}-*.dist-info/*" for t in tops]


def dropped(dest: str) -> bool:
    dest = dest.replace("\\", "/")
    return any(fnmatch.fnmatch(dest, pat) for pat in DROPPED_FILES + _dist_info_patterns())


def filter_toc(toc):
    """PyInstaller TOC entries are (dest_name, src_name, typecode) tuples."""
    return [entry for entry in toc if not dropped(entry[0])]


# Loaded by the bootloader itself (dlopen), so no collected binary lists it as a dependency.
ALWAYS_KEPT_LIBS = ("libpython*",)
_LDD_LINE = re.compile(r"^\s*(\S+)(?:\s+=>\s+(\S+))?")


def parse_ldd(text: str) -> set[str]:
    """Library basenames in `ldd` output (one or several files; headers and notes skipped)."""
    names: set[str] = set()
    for line in text.splitlines():
        if (
            not line.strip()
            or line.endswith(":")
            or "statically linked" in line
            or "not a dynamic" in line
        ):
            continue
        m = _LDD_LINE.match(line)
        if m:
            names.add(os.path.basename(m.group(1)))
    return names


def ldd_needed(paths: list[str], chunk: int = 64) -> set[str]:
    """Basenames of every shared library that `paths` load (ldd lists them transitively)."""
    names: set[str] = set()
    for i in range(0, len(paths), chunk):
        out = subprocess.run(["ldd", *paths[i : i + chunk]], capture_output=True, text=True).stdout
        names |= parse_ldd(out)
    return names


def prune_orphan_libs(toc, needed: set[str] | None = None):
    """Drop top-level libraries (PyInstaller puts system dependencies there) that no kept binary
    loads any more: what only a dropped plugin needed, e.g. the GTK stack of libqgtk3.
    Returns (kept toc, dropped dest names)."""

    def candidate(entry) -> bool:
        dest, _src, typecode = entry
        return (
            typecode == "BINARY"
            and "/" not in dest.replace("\\", "/")
            and not any(fnmatch.fnmatch(dest, p) for p in ALWAYS_KEPT_LIBS)
        )

    if needed is None:
        roots = [
            src
            for dest, src, typecode in toc
            if typecode in ("BINARY", "EXTENSION") and not candidate((dest, src, typecode))
        ]
        needed = ldd_needed(roots)
    kept, gone = [], []
    for entry in toc:
        if candidate(entry) and os.path.basename(entry[0]) not in needed:
            gone.append(entry[0])
        else:
            kept.append(entry)
    return kept, gone
