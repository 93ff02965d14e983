"""Building `mx.fast.cuda_kernel`s whose per-call host cost does not grow with the source.

MLX's CUDA custom kernels rebuild the whole .cu text (header + body) on every call and hash it
on every evaluation (the hash names the compiled module in MLX's in-memory cache). With our
~20-30 KB headers that is tens of µs of host time per call, more than the kernel itself at
short contexts. So the header goes to a file (named by its content hash, written once) that
the source includes by absolute path: MLX then copies and hashes a ~100-byte header and the
body, comments and blank lines stripped. NVRTC reads the included file when it compiles (once
per kernel and template), so a changed header gets a new name and a new module.

ROTARYQUANT_CUDA_INLINE=1 (or an unwritable cache directory) keeps the header inline.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

import mlx.core as mx

# comments and the literals they must not be looked for in, leftmost first
_TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def _keep_literals(m: re.Match) -> str:
    t = m.group(0)
    return t if t[0] in "\"'" else (" " if t.startswith("/*") else "")


def strip(text: str) -> str:
    """C/C++/CUDA source without comments, trailing blanks and empty lines (string and char
    literals, e.g. inline PTX, kept as they are; lines stay lines, so `#define` still ends)."""
    lines = (ln.rstrip() for ln in _TOKEN.sub(_keep_literals, text).splitlines())
    return "\n".join(ln for ln in lines if ln.strip()) + "\n"


def inline() -> bool:
    return os.environ.get("ROTARYQUANT_CUDA_INLINE", "0") == "1"


def _include_dir() -> Path | None:
    """The app's cache directory (or, where that is unavailable, a per-user temp folder)."""
    try:
        from ... import paths

        root = paths.cache_dir()
    except (ImportError, OSError):
        root = (
            Path(tempfile.gettempdir())
            / f"rotaryquant-{os.getuid() if hasattr(os, 'getuid') else 0}"
        )
    try:
        d = root / "cuda-include"
        d.mkdir(parents=True, exist_ok=True)
        return d
    except OSError:
        return None


def header_file(header: str) -> Path | None:
    """The file holding `header` (content-addressed, written atomically once), or None where
    it cannot be written."""
    d = _include_dir()
    if d is None:
        return None
    digest = hashlib.sha256(header.encode()).hexdigest()[:20]
    path = d / f"rq_{digest}.cuh"
    if path.exists():
        try:
            if path.read_text() == header:
                return path
        except OSError:
            return None
    try:
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(header)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def include_header(header: str) -> str:
    """What to pass as `header=`: an #include of the stripped header's file, or the stripped
    header itself (inline mode, or no writable cache directory)."""
    text = strip(header)
    if inline():
        return text
    path = header_file(text)
    if path is None or '"' in str(path) or "\\" in str(path):
        return text
    return f'#include "{path}"\n'


def cuda_kernel(name: str, input_names, output_names, source: str, header: str, **kw):
    """mx.fast.cuda_kernel with the header included from a file and the body stripped."""
    return mx.fast.cuda_kernel(
        name=name,
        input_names=input_names,
        output_names=output_names,
        source=strip(source),
        header=include_header(header),
        **kw,
    )


# -- template values baked into per-configuration kernels ------------------------------------
# MLX turns a call's `template=` list into C++ on every call (nanobind converts the list, then
# it formats one `constexpr` line per value into a fresh copy of the source and the kernel name):
# ~3-7 µs per call for 10 values, measured on an H200 machine's host. A BakedKernel writes those lines once per configuration instead: one
# mx.fast.cuda_kernel per distinct template, called with no template. Measured on IsoQuant's
# fused_attention (two kernel calls): graph build 16.1-17.4 -> 14.9-15.4 µs per call, encoding
# 15.9-16.9 -> 14.7-14.9 (results/isoquant_host.json).

_CUDA_DTYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}


def bake() -> bool:
    return os.environ.get("ROTARYQUANT_CUDA_BAKE", "1") != "0"


def template_lines(template) -> tuple[str, str]:
    """(the body's compile-time constants as MLX writes them, a name suffix) for (name, value)
    pairs: int -> constexpr int, bool -> constexpr bool, an mx dtype -> a type alias."""
    lines, suffix = [], []
    for name, v in template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {name} = {'true' if v else 'false'};")
            suffix.append("t" if v else "f")
        elif isinstance(v, int):
            lines.append(f"  constexpr int {name} = {v};")
            suffix.append(str(v))
        else:
            try:
                lines.append(f"  using {name} = {_CUDA_DTYPES[v]};")
            except KeyError:
                raise TypeError(f"template value {name}={v!r}: int, bool or an mx dtype") from None
            suffix.append(str(v).rsplit(".", 1)[-1])
    return "\n".join(lines) + "\n", "".join("_" + s for s in suffix)


class BakedKernel:
    """Drop-in for an mx.fast.cuda_kernel object whose calls pass `template=`: each distinct
    template gets its own kernel (constants written into its source, values in its name),
    built on first use and kept. The header goes through include_header once."""

    def __init__(self, name: str, input_names, output_names, source: str, header: str, **kw):
        self.name = name
        self._args = (list(input_names), list(output_names), strip(source), include_header(header))
        self._kw = kw
        self._by_template: dict = {}

    def kernel(self, template=None):
        key = () if not template else tuple(template)
        k = self._by_template.get(key)
        if k is None:
            ins, outs, src, hdr = self._args
            consts, suffix = template_lines(key)
            k = mx.fast.cuda_kernel(
                name=self.name + suffix,
                input_names=ins,
                output_names=outs,
                source=consts + src,
                header=hdr,
                **self._kw,
            )
            self._by_template[key] = k
        return k

    def __call__(self, *, template=None, **kw):
        return self.kernel(template)(**kw)
