"""What the CUDA kernels hand to mx.fast.cuda_kernel: the stripped body and a one-line header
that includes the stripped header from a content-addressed file (app/engine/cuda_kernels/jit.py).
The nvcc compile checks (test_isoquant_kernels_compile.py, test_zipfusion_kernels.py) compile
exactly that; here: stripping loses no token, and the include file is right and robust."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from app.engine.cuda_kernels import isoquant as cuda_iq
from app.engine.cuda_kernels import jit
from app.engine.cuda_kernels import zipfusion as zk
from app.engine.kvcache_kernels import isoquant as iq

TRICKY = r"""
#define A 1 // comment "with quotes"
const char* s = "keep // this /* and this */";  // but not "this"
asm volatile("mma.sync; // not a comment\n" ::);
/* a block
   comment */ int x = '/' + '\'';
// a lane's comment with an apostrophe
int y = 2; /* inline */ int z = 3;
"""


def _gpp_tokens(text: str, tmp_path) -> list[str]:
    """Tokens of `text` after g++'s own comment removal (-fpreprocessed keeps directives)."""
    src = tmp_path / "x.cpp"
    src.write_text(text)
    r = subprocess.run(
        ["g++", "-fpreprocessed", "-dD", "-E", "-P", "-x", "c++", str(src)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return r.stdout.split()


def _sources() -> dict[str, str]:
    out = {"tricky": TRICKY, "zipfusion header": zk.HEADER}
    for name in ("iq_fused_tc", "iq_combine"):
        hdr, body = iq.source(name, "cuda")
        out[f"{name} header"] = cuda_iq.HEADER + hdr
        out[f"{name} body"] = cuda_iq.BODY + body
    for name, (_, _, body) in zk.SOURCES.items():
        out[name] = body
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to strip comments itself")
@pytest.mark.parametrize("name", sorted(_sources()))
def test_strip_keeps_every_token(name, tmp_path):
    text = _sources()[name]
    stripped = jit.strip(text)
    assert "//" not in stripped.replace("// not a comment", "").replace("keep // this", "")
    assert _gpp_tokens(stripped, tmp_path) == _gpp_tokens(text, tmp_path)
    assert len(stripped) < len(text)


def test_strip_keeps_literals_and_lines():
    out = jit.strip(TRICKY)
    assert '"keep // this /* and this */"' in out
    assert r'"mma.sync; // not a comment\n"' in out
    assert "#define A 1\n" in out  # the directive still ends where it did
    assert "'\\''" in out and "'/'" in out
    assert "comment" not in out.replace("not a comment", "")
    assert "\n\n" not in out


def test_header_is_included_from_a_content_addressed_file(monkeypatch):
    monkeypatch.delenv("ROTARYQUANT_CUDA_INLINE", raising=False)
    header = "// doc\n__device__ int f() { return 1; }  // one\n"
    line = jit.include_header(header)
    assert line.startswith('#include "') and line.endswith('"\n') and line.count("\n") == 1
    path = jit.Path(line[len('#include "') : -2])
    assert path.read_text() == jit.strip(header) == "__device__ int f() { return 1; }\n"
    assert jit.include_header(header) == line  # same header, same file
    other = jit.include_header(header.replace("1", "2"))
    assert other != line  # a changed header gets a new name (and MLX a new module)


def test_a_damaged_header_file_is_rewritten(monkeypatch):
    monkeypatch.delenv("ROTARYQUANT_CUDA_INLINE", raising=False)
    header = "__device__ int g() { return 7; }\n"
    path = jit.Path(jit.include_header(header)[len('#include "') : -2])
    path.write_text("__device__ int g() { return")  # e.g. a crash mid-write by an old version
    assert jit.include_header(header) == f'#include "{path}"\n'
    assert path.read_text() == header


def test_inline_where_no_file_can_be_written(monkeypatch):
    header = "// c\n__device__ int h();\n"
    monkeypatch.setenv("ROTARYQUANT_CUDA_INLINE", "1")
    assert jit.include_header(header) == "__device__ int h();\n"
    monkeypatch.delenv("ROTARYQUANT_CUDA_INLINE")
    monkeypatch.setattr(jit, "_include_dir", lambda: None)
    assert jit.include_header(header) == "__device__ int h();\n"
