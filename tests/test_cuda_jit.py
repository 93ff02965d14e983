"""What the CUDA kernels hand to mx.fast.cuda_kernel: the stripped body and a one-line header
that includes the stripped header from a content-addressed file (app/engine/kvcache/jit.py).
The nvcc compile checks (test_isoquant_kernels_compile.py, test_zipfusion_kernels.py) compile
exactly that; here: stripping loses no token, and the include file is right and robust."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from app.engine.kvcache import jit
from app.engine.kvcache.isoquant import cuda_prologue as cuda_iq
from app.engine.kvcache.isoquant import kernels as iq
from app.engine.kvcache.zipfusion import kernels as zk

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


def test_baked_kernels_write_the_template_into_the_source_once_per_configuration(monkeypatch):
    """jit.BakedKernel: a call with `template=` runs a kernel whose source starts with the
    constants MLX would write (and whose name carries the values) and gets no template itself;
    a configuration is built once, a new one gets its own kernel."""
    import mlx.core as mx

    built, called = [], []

    def fake_cuda_kernel(**kw):
        built.append(kw)

        def run(**call):
            called.append((kw["name"], call))
            return ["out"]

        return run

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)
    k = jit.BakedKernel("k", ["a"], ["o"], "o[0] = a[0]; // body\n", "// header\n")
    tmpl = (("D", 128), ("CAUSAL", False), ("TO", mx.bfloat16))
    for t in (tmpl, list(tmpl), tmpl):  # a list and a tuple of the same values: one kernel
        assert k(inputs=[1], template=t, grid=(1, 1, 1)) == ["out"]
    assert len(built) == 1 and built[0]["name"] == "k_128_f_bfloat16"
    src = built[0]["source"]
    assert src.startswith(
        "  constexpr int D = 128;\n  constexpr bool CAUSAL = false;\n  using TO = __nv_bfloat16;\n"
    )
    assert src.endswith("o[0] = a[0];\n")  # the body, stripped
    assert all("template" not in call for _, call in called)
    assert called[0][1] == dict(inputs=[1], grid=(1, 1, 1))
    k(inputs=[1], template=[("D", 64), ("CAUSAL", True), ("TO", mx.float16)], grid=(1, 1, 1))
    assert len(built) == 2 and built[1]["name"] == "k_64_t_float16"
    assert "using TO = __half;" in built[1]["source"]
    with pytest.raises(TypeError, match="int, bool or an mx dtype"):
        jit.template_lines([("X", 1.5)])


def test_isoquant_cuda_kernels_are_baked_unless_turned_off(monkeypatch):
    """The IsoQuant CUDA prologue builds baked kernels; ROTARYQUANT_CUDA_BAKE=0 gives MLX's own
    per-call templates (the side-by-side baseline of benchmarks/isoquant_host.py)."""
    import mlx.core as mx

    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: ("mlx", kw["name"]))
    hdr, body = iq.source("iq_combine", "cuda")
    monkeypatch.setenv("ROTARYQUANT_CUDA_BAKE", "1")
    assert isinstance(cuda_iq.build("iq_combine_x", ["a"], ["o"], body, hdr), jit.BakedKernel)
    monkeypatch.setenv("ROTARYQUANT_CUDA_BAKE", "0")
    assert cuda_iq.build("iq_combine_x", ["a"], ["o"], body, hdr) == ("mlx", "iq_combine_x")
