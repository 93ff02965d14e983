"""ZipFusion's CUDA kernel bodies run on the CPU through the thread-level emulator in
tests/cuda_emu/emu.h (one std::thread per GPU thread; shuffles, barriers and mma.sync through
per-warp buffers). The PTX primitives (bf16 mma, cp.async) get emulated twins here; cp.async
copies land only at the matching wait_group, as on the GPU. Correctness only, small shapes."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from app.engine.kvcache import zipfusion as zf
from app.engine.kvcache.zipfusion import codec
from app.engine.kvcache.zipfusion import kernels as zk

EMU_DIR = Path(__file__).parent / "cuda_emu"
_CACHE = Path(tempfile.gettempdir()) / f"zf_emu_{os.getuid()}"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("g++") is None or not (EMU_DIR / "emu.h").exists(),
        reason="needs g++ and tests/cuda_emu/emu.h",
    ),
]

_CT = {
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.int32: "int32_t",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
_NP = {
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.int32: np.int32,
    mx.float32: np.float32,
}

# Emulated twins of HEADER_PTX (plus the CUDA vector types emu.h lacks).
EMU_PTX = r"""
#include "emu.h"
#include <cmath>
#include <vector>
// uint4, uint2 and float4 come from emu.h.
struct alignas(8) float2 { float x, y; };
inline uint32_t min(uint32_t a, uint32_t b) { return a < b ? a : b; }
inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; }
inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int __popc(uint32_t x) { return __builtin_popcount(x); }
inline float zf_exp2(float x) { return std::exp2(x); }
inline float emu_bf(uint32_t reg, int hi) {
  uint32_t u = (hi ? reg >> 16 : reg & 0xFFFFu) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 (emu.h's fragment layouts)
inline void zf_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  const uint32_t r[6] = {a[0], a[1], a[2], a[3], b0, b1};
  emu_mma<16>(c, r, emu_bf);
}
inline uint32_t zf_pack_bf16(float lo, float hi) {
  __nv_bfloat16 a(lo), b(hi);
  return uint32_t(a.x) | (uint32_t(b.x) << 16);
}
inline uint8_t* zf_emu_smem = nullptr;
#define ZF_DYN_SMEM(name) alignas(16) static uint8_t name[1 << 20]; zf_emu_smem = name
inline uint32_t zf_smem_addr(const void* p) { return uint32_t((const uint8_t*)p - zf_emu_smem); }
// cp.async: a thread's copies land only when a wait_group retires their group.
struct ZfCopy { uint32_t dst; const void* src; };
inline thread_local std::vector<std::vector<ZfCopy>> zf_groups;
inline thread_local std::vector<ZfCopy> zf_open;
#ifdef ZF_EMU_EAGER  // copies land at once: catches a page overwritten while still being read
inline void zf_cp16(uint32_t a, const void* g) { std::memcpy(zf_emu_smem + a, g, 16); }
#else  // copies land at their wait_group: catches a page read before its copy is waited for
inline void zf_cp16(uint32_t a, const void* g) { zf_open.push_back({a, g}); }
#endif
inline void zf_cp_commit() { zf_groups.push_back(zf_open); zf_open.clear(); }
template <int N> inline void zf_cp_wait() {
  while ((int)zf_groups.size() > N) {
    for (auto& c : zf_groups.front()) std::memcpy(zf_emu_smem + c.dst, c.src, 16);
    zf_groups.erase(zf_groups.begin());
  }
}
"""


EMU_MODE = {"eager": False}  # cp.async copies of kernels made from now on land at once


class EmuKernel:
    """Same call signature as an `mx.fast.cuda_kernel` object; compiles once per template."""

    def __init__(
        self, name: str, inputs: list[str], outputs: list[str], body: str, eager: bool = False
    ):
        self.name, self.inputs, self.outputs, self.body = name, inputs, outputs, body
        self.eager = eager

    def _exe(self, in_t: list[str], out_t: list[str], template) -> Path:
        params = [f"    const {t}* {n}" for t, n in zip(in_t, self.inputs, strict=True)]
        params += [f"    {t}* {n}" for t, n in zip(out_t, self.outputs, strict=True)]
        consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in template)
        args = [f"(const {t}*)in{i}.data()" for i, t in enumerate(in_t)]
        args += [f"({t}*)out{i}.data()" for i, t in enumerate(out_t)]
        main = [
            "#include <fstream>\n#include <iterator>\n#include <string>",
            "static std::vector<char> rd(const std::string& p) {",
            "  std::ifstream f(p, std::ios::binary);",
            "  return std::vector<char>(std::istreambuf_iterator<char>(f), {}); }",
            "int main(int, char** argv) {",
            "  std::string dir = argv[1];",
            '  std::ifstream pf(dir + "/params.txt");',
            "  unsigned gx, gy, gz; int nt; pf >> gx >> gy >> gz >> nt;",
        ]
        main += [f'  auto in{i} = rd(dir + "/in{i}.bin");' for i in range(len(in_t))]
        for i in range(len(out_t)):
            main.append(f"  size_t nb{i}; pf >> nb{i}; std::vector<char> out{i}(nb{i});")
            main.append(f"  std::memset(out{i}.data(), 0xFF, nb{i});  // poison")
        main.append(
            f"  emu_launch(gx, gy, gz, nt, [&] {{ mlx::core::cu::k_{self.name}({', '.join(args)}); }});"
        )
        main += [
            f'  {{ std::ofstream f(dir + "/out{i}.bin", std::ios::binary); f.write(out{i}.data(), nb{i}); }}'
            for i in range(len(out_t))
        ]
        main.append("  return 0;\n}\n")
        src = (
            ("#define ZF_EMU_EAGER 1\n" if self.eager else "") + EMU_PTX + zk.HEADER_COMMON + "namespace mlx::core::cu {\n"
            + f"void k_{self.name}(\n" + ",\n".join(params) + ") {\n" + consts + self.body
            + "\n}\n}  // namespace mlx::core::cu\n" + "\n".join(main)
        )  # fmt: skip
        # the binary's name covers emu.h too: a changed emulator must rebuild it
        digest = hashlib.sha256(src.encode() + (EMU_DIR / "emu.h").read_bytes()).hexdigest()
        exe = _CACHE / f"{self.name}_{digest[:16]}"
        if not exe.exists():
            _CACHE.mkdir(parents=True, exist_ok=True)
            exe.with_suffix(".cpp").write_text(src)
            cmd = [
                "g++",
                "-std=c++20",
                "-O1",
                "-pthread",
                "-w",
                f"-I{EMU_DIR}",
                "-o",
                f"{exe}.tmp",
                f"{exe}.cpp",
            ]
            r = subprocess.run(cmd, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-3000:]
            os.replace(f"{exe}.tmp", exe)
        return exe

    def __call__(
        self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, template=(), **_
    ):
        exe = self._exe([_CT[a.dtype] for a in inputs], [_CT[d] for d in output_dtypes], template)
        blocks = [-(-g // t) for g, t in zip(grid, threadgroup, strict=True)]
        with tempfile.TemporaryDirectory() as d:
            for i, a in enumerate(inputs):
                a = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
                Path(d, f"in{i}.bin").write_bytes(np.ascontiguousarray(np.array(a)).tobytes())
            sizes = [
                int(np.prod(s)) * t.size for s, t in zip(output_shapes, output_dtypes, strict=True)
            ]
            Path(d, "params.txt").write_text(" ".join(map(str, [*blocks, threadgroup[0], *sizes])))
            r = subprocess.run([str(exe), d], capture_output=True, timeout=600)
            assert r.returncode == 0, r.stderr[-2000:]
            outs = []
            for i, (shape, dt) in enumerate(zip(output_shapes, output_dtypes, strict=True)):
                raw = Path(d, f"out{i}.bin").read_bytes()
                if dt == mx.bfloat16:
                    outs.append(
                        mx.array(np.frombuffer(raw, np.uint16).reshape(shape)).view(mx.bfloat16)
                    )
                else:
                    outs.append(mx.array(np.frombuffer(raw, _NP[dt]).reshape(shape)))
            return outs


@pytest.fixture
def emulated(monkeypatch):
    kernels = {}
    for name, (ins, outs, body) in zk.SOURCES.items():
        if name == "zipfusion_attn_pipe":
            for d in zk.PIPE_HEAD_DIMS:
                key = (name, d, zk.NUM_WARPS, zk.PIPE_STAGES)
                kernels[key] = EmuKernel(f"{name}_d{d}", ins, outs, body)
        elif name != "zipfusion_attn_ring":
            kernels[name] = EmuKernel(name, ins, outs, body)
    # Ring kernels (any head dim / warps / ring size) are made on first use, as on the GPU.
    ins, outs, body = zk.SOURCES["zipfusion_attn_ring"]
    monkeypatch.setattr(
        zk,
        "_make_ring",
        lambda d, nw, rk: EmuKernel(
            f"zipfusion_attn_ring_d{d}_r{rk}_w{nw}", ins, outs, body, EMU_MODE["eager"]
        ),
    )
    monkeypatch.setattr(zk, "_KERNELS", kernels)
    return kernels


def _bf16(rng, shape, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(mx.bfloat16)


def test_emulated_compress_kernel_is_bit_exact(emulated):
    rng = np.random.default_rng(0)
    blocks = mx.concatenate(
        [
            mx.array(rng.integers(0, 1 << 16, (3, 512), dtype=np.uint16)),
            _bf16(rng, (6, 512)).view(mx.uint16),
            (_bf16(rng, (2, 512)) * 1e-38).view(mx.uint16),
            mx.array(np.full((1, 512), 0x7FC0, np.uint16)),
        ]
    )
    f_ref, p_ref = codec.encode_blocks(blocks)
    f_k, p_k = zk.compress_blocks(blocks, use_kernel=True)
    assert bool(mx.all(f_ref == f_k)) and bool(mx.all(p_ref == p_k))


def _stores(lengths, n_kv, d, rng):
    kv = [(_bf16(rng, (1, n_kv, n, d), 2.0), _bf16(rng, (1, n_kv, n, d))) for n in lengths]
    budget = (sum(-(-n // 16) for n in lengths) + 64) * n_kv * 2 * (d // 32) * 1024 * 2
    out = []
    for compress in (True, False):
        cfg = zf.ZipConfig(
            1,
            n_kv,
            d,
            budget,
            max_seqs=len(lengths),
            max_tokens_per_seq=max(lengths) + 32,
            compress=compress,
        )
        st = zf.ZipStore(cfg, use_kernel=True)
        st.pool = mx.full(st.pool.shape, 0x7FC0, mx.uint16)  # stale NaN where nothing was written
        for k, v in kv:
            sid = st.add_sequence()
            n = k.shape[2]
            cut = n - n % 16 if n % 16 else max(0, n - 16)
            for a, b in ((0, cut), (cut, n)):
                if b > a:
                    st.begin([sid])
                    st.stage(0, k[:, :, a:b], v[:, :, a:b])
                    st.commit()
        out.append(st)
    return out


@pytest.mark.parametrize("d,n_q,n_kv,lengths", [(128, 8, 2, [1, 17, 70]), (64, 6, 2, [16, 45])])
def test_emulated_attention_is_lossless_and_matches_reference(emulated, d, n_q, n_kv, lengths):
    rng = np.random.default_rng(d)
    zst, rst = _stores(lengths, n_kv, d, rng)
    assert zst.stats["blocks_compressed"] > 0
    b = len(lengths)
    q = _bf16(rng, (b, n_q, d))
    kn, vn = _bf16(rng, (b, n_kv, d)), _bf16(rng, (b, n_kv, d))
    res = {}
    for st, tag in ((zst, "zip"), (rst, "raw")):
        st.begin(list(range(b)))
        for variant in ("simple", "pipe", "ring"):
            for splits in (1, 2):
                res[tag, variant, splits] = zk.paged_decode_attention(
                    q, st.pool, st.meta, st.page_table, st.seq_len, kn, vn, layer=0,
                    n_ids=st.n_ids, scale=d**-0.5, n_splits=splits, use_kernel=True, variant=variant,
                )  # fmt: skip
        st.staged = [None]
    ref = zk.paged_attention_reference(
        q, rst.pool, rst.meta, rst.page_table, rst.seq_len, kn, vn, 0, rst.n_ids, d**-0.5
    ).astype(mx.float32)
    for splits in (1, 2):
        z = res["zip", "pipe", splits]
        assert bool(mx.all(mx.isfinite(z.astype(mx.float32))))
        assert bool(mx.all(z == res["raw", "pipe", splits]))
        assert bool(mx.all(z == res["zip", "simple", splits]))
        assert bool(mx.all(res["zip", "simple", splits] == res["raw", "simple", splits]))
        assert bool(mx.all(res["zip", "ring", splits] == res["raw", "ring", splits]))
        err = float(
            mx.linalg.norm(res["zip", "ring", splits].astype(mx.float32) - ref)
            / mx.linalg.norm(ref)
        )
        assert err < 1e-2, err
        err = float(mx.linalg.norm(z.astype(mx.float32) - ref) / mx.linalg.norm(ref))
        assert err < 1e-2, err


@pytest.mark.parametrize("d,g,n_parts", [(128, 4, 1), (128, 4, 37), (64, 3, 6), (256, 2, 9)])
def test_emulated_reduce_merges_partials(emulated, d, g, n_parts):
    """The partials' merge (warps share the partials, online softmax) against the same merge in
    numpy: random partials, some of them empty (m = -inf, as a split without tokens), one
    (sequence, KV head) with every partial empty (the output is then the new token's V)."""
    rng = np.random.default_rng(n_parts)
    b, n_kv = 2, 2
    hq = n_kv * g
    m = (rng.standard_normal((b, n_kv, n_parts, g)) * 4).astype(np.float32)
    m[rng.random(m.shape) < 0.3] = -np.inf
    m[1, 0] = -np.inf
    lsum = np.where(np.isinf(m), 0, rng.uniform(0.5, 20, m.shape)).astype(np.float32)
    o = np.where(np.isinf(m)[..., None], 0, rng.standard_normal((*m.shape, d))).astype(np.float32)
    q, kn, vn = (_bf16(rng, sh) for sh in ((b, hq, d), (b, n_kv, d), (b, n_kv, d)))
    sl2 = np.float32(d**-0.5 * np.log2(np.e))
    (out,) = zk._KERNELS["zipfusion_reduce"](
        inputs=[
            mx.array(o), mx.array(np.stack([m, lsum], -1)), q, kn, vn,
            mx.array([n_parts], dtype=mx.int32), mx.array([float(sl2)]),
        ],
        template=[("D", d), ("G", g), ("RW", zk.REDUCE_WARPS)],
        grid=(32 * zk.REDUCE_WARPS, hq, b),
        threadgroup=(32 * zk.REDUCE_WARPS, 1, 1),
        output_shapes=[(b, hq, d)],
        output_dtypes=[mx.bfloat16],
    )  # fmt: skip
    qf, kf, vf = (np.array(x.astype(mx.float32)) for x in (q, kn, vn))
    want = np.zeros((b, hq, d), np.float64)
    for bi in range(b):
        for h in range(hq):
            kv, r = h // g, h % g
            s_new = float(qf[bi, h] @ kf[bi, kv]) * sl2
            ms = np.append(m[bi, kv, :, r], s_new)
            top = ms.max()
            w = np.exp2(ms - top)
            num = (w[:-1, None] * o[bi, kv, :, r]).sum(0) + w[-1] * vf[bi, kv]
            want[bi, h] = num / ((w[:-1] * lsum[bi, kv, :, r]).sum() + w[-1])
    got = np.array(out.astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    # every partial of (sequence 1, KV head 0) empty: the new token alone
    np.testing.assert_allclose(got[1, :g], np.repeat(vf[1, :1], g, 0), rtol=1e-2, atol=1e-3)


def _mixed_stores(lengths, n_kv, d, rng):
    """Stores whose pages mix raw and compressed blocks: K Gaussian (wide exponent range: some
    blocks stay raw), V of magnitude in [0.5, 2) (always compressible)."""
    budget = (sum(-(-n // 16) for n in lengths) + 64) * n_kv * 2 * (d // 32) * 1024 * 2
    kv = []
    for n in lengths:
        k = _bf16(rng, (1, n_kv, n, d), 3.0)
        mag = rng.uniform(0.5, 2.0, (1, n_kv, n, d)) * rng.choice([-1.0, 1.0], (1, n_kv, n, d))
        kv.append((k, mx.array(mag.astype(np.float32)).astype(mx.bfloat16)))
    out = []
    for compress in (True, False):
        cfg = zf.ZipConfig(
            1, n_kv, d, budget, max_seqs=len(lengths),
            max_tokens_per_seq=max(lengths) + 32, compress=compress,
        )  # fmt: skip
        st = zf.ZipStore(cfg, use_kernel=True)
        st.pool = mx.full(st.pool.shape, 0x7FC0, mx.uint16)
        for k, v in kv:
            sid = st.add_sequence()
            n = k.shape[2]
            cut = n - n % 16
            for a, b in ((0, cut), (cut, n)):
                if b > a:
                    st.begin([sid])
                    st.stage(0, k[:, :, a:b], v[:, :, a:b])
                    st.commit()
        out.append(st)
    return out


@pytest.mark.parametrize(
    "d,n_q,n_kv,nw,ring_kb,lengths",
    [
        (128, 8, 1, 2, 8, [300, 21]),  # ring of one raw page: one page in flight at a time
        (128, 8, 1, 2, 16, [300, 21]),  # 2-3 pages queued, positions skip the ring's end
        (64, 3, 1, 1, 12, [200, 16]),  # head dim 64, G = 3, up to 4 pages queued
        (128, 8, 1, 3, 16, [300, 21]),  # 3 warps per CTA: pages dealt round-robin by 3
        (64, 3, 1, 3, 12, [33, 2, 200]),  # 3 warps, sequences shorter than the warps' share
    ],
)
def test_emulated_ring_variant_byte_packed_ring(emulated, d, n_q, n_kv, nw, ring_kb, lengths):
    """The ring variant with long sequences (many pages per warp, so the byte-packed ring fills,
    skips its end and refills), pages with raw blocks, all-compressed pages (fast path) and
    partial last pages: compressed == raw pages bit for bit, close to the reference."""
    rng = np.random.default_rng(7 + d)
    zst, rst = _mixed_stores(lengths, n_kv, d, rng)
    assert 0 < zst.stats["blocks_compressed"] < zst.stats["blocks"]
    b = len(lengths)
    q = _bf16(rng, (b, n_q, d))
    kn, vn = _bf16(rng, (b, n_kv, d)), _bf16(rng, (b, n_kv, d))
    for st in (zst, rst):
        st.begin(list(range(b)))
    ref = zk.paged_attention_reference(
        q, rst.pool, rst.meta, rst.page_table, rst.seq_len, kn, vn, 0, rst.n_ids, d**-0.5
    ).astype(mx.float32)
    for splits, eager in ((1, False), (3, False), (1, True)):
        EMU_MODE["eager"] = eager
        zk._KERNELS.pop(("zipfusion_attn_ring", d, nw, ring_kb), None)
        outs = []
        for st in (zst, rst):
            outs.append(
                zk.paged_decode_attention(
                    q, st.pool, st.meta, st.page_table, st.seq_len, kn, vn, layer=0,
                    n_ids=st.n_ids, scale=d**-0.5, n_splits=splits, use_kernel=True,
                    variant="ring", num_warps=nw, ring_kb=ring_kb,
                )
            )  # fmt: skip
        assert bool(mx.all(mx.isfinite(outs[0].astype(mx.float32))))
        assert bool(mx.all(outs[0] == outs[1]))
        err = float(mx.linalg.norm(outs[0].astype(mx.float32) - ref) / mx.linalg.norm(ref))
        assert err < 1e-2, err
    EMU_MODE["eager"] = False


def test_emulated_partials_then_reduce_equals_one_call(emulated):
    """partials_only + reduce_partials (how the benchmark times the reduce alone) give the
    same bits as one paged_decode_attention call, and that call matches the reference."""
    rng = np.random.default_rng(5)
    zst, _ = _stores([40, 17], 2, 64, rng)
    q = _bf16(rng, (2, 6, 64))
    kn, vn = _bf16(rng, (2, 2, 64)), _bf16(rng, (2, 2, 64))
    zst.begin([0, 1])
    args = (q, zst.pool, zst.meta, zst.page_table, zst.seq_len, kn, vn)
    kw = dict(layer=0, n_ids=zst.n_ids, scale=0.125, n_splits=2, use_kernel=True, variant="ring")
    whole = zk.paged_decode_attention(*args, **kw)
    o, ml = zk.paged_decode_attention(*args, **kw, partials_only=True)
    assert o.shape[2] == 2 * zk.RING_NUM_WARPS and ml.shape[-1] == 2
    assert bool(mx.all(zk.reduce_partials(o, ml, q, kn, vn, scale=0.125) == whole))
    ref = zk.paged_attention_reference(*args, 0, zst.n_ids, 0.125).astype(mx.float32)
    err = float(mx.linalg.norm(whole.astype(mx.float32) - ref) / mx.linalg.norm(ref))
    assert err < 1e-2, err
    with pytest.raises(ValueError, match="partials_only"):
        zk.paged_decode_attention(*args, **{**kw, "use_kernel": False}, partials_only=True)


def test_ring_launch_settings():
    """Ring sizes hold at least one raw page; the split count fills whole waves of CTAs."""
    assert zk.ring_bytes(256, 8) == 2 * 8 * 1024  # a raw page of head dim 256 is 16 KiB
    assert zk.ring_max_queued(128, 16) == 3  # 16 KiB / 6 KiB compressed pages, + 1
    cta = zk.ring_ctas_per_sm(128, 4, 16)
    assert cta >= 2 and cta * zk.ring_shared_bytes(128, 4, 16) <= zk.SM_SHARED_BYTES
    for batch in (8, 16, 32, 64):
        s = zk.ring_splits(batch, 8, 512, 128, 4, 16)
        assert batch * 8 * s <= zk.SM_COUNT * cta < batch * 8 * (s + 1) or s == 1
