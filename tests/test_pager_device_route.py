"""Device-resolved paging (offload/device_route.py): the step is an LRU over each layer's share
of the slots, its CUDA kernel does what the step's host reference does (tables, slot indices
and the copied bytes, run on the CPU through tests/cuda_emu), and a model paged this way
generates exactly what the resident model does."""

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from app.engine.kvcache.isoquant import cuda_prologue as cp
from app.engine.loader import load
from app.engine.offload import device_route as dr
from app.engine.offload import load_paged
from app.engine.offload.pager import ExpertPager, PagerOptions
from app.engine.offload.records import ExpertStore
from app.engine.quant.convert import convert
from app.engine.testing.random_models import make_random_model

EMU_DIR = Path(__file__).parent / "cuda_emu"


def _fresh(experts, share):
    return (
        np.full(experts, -1, np.int32),
        np.full(share, -1, np.int32),
        np.zeros(share, np.uint32),
        np.zeros(dr.META, np.uint32),
    )


def test_reference_step_is_an_lru_over_the_layer_share():
    """An LRU at the granularity of calls: after every call the resident experts are the
    share's worth of most recently used ones (no evicted expert used later than a kept one),
    each id sits on a slot its expert owns, a pair is a miss exactly when its expert was read
    in that call, and the counters add up."""
    rng = np.random.default_rng(3)
    experts, share, k = 40, 9, 4
    tables = _fresh(experts, share)
    last: dict[int, int] = {}  # expert -> the last call that used it
    hits = misses = reads = 0
    for call in range(300):
        ids = rng.choice(experts, size=k, replace=False)
        if rng.random() < 0.3:  # a repeated expert in one call (batched decode)
            ids[-1] = ids[0]
        if rng.random() < 0.2:
            ids[1] = dr.SKIP
        before = set(np.flatnonzero(tables[0] >= 0).tolist())
        out, *tables, missed = dr.route_reference(ids.astype(np.uint32), *tables)
        slot_of, owner, _, meta = tables
        used = [e for e in ids.tolist() if e != dr.SKIP]
        read_now = set(used) - before
        assert sorted(e for e, _ in missed) == sorted(read_now)
        hits += sum(e not in read_now for e in used)
        misses += sum(e in read_now for e in used)
        reads += len(read_now)
        for e in used:
            last[e] = call
        resident = set(np.flatnonzero(slot_of >= 0).tolist())
        assert set(used) <= resident and len(resident) == min(share, len(last))
        gone = set(last) - resident
        if gone:
            assert max(last[e] for e in gone) <= min(last[e] for e in resident)
        for j, e in enumerate(ids.tolist()):
            if e != dr.SKIP:
                assert owner[out[j]] == e and slot_of[e] == out[j]
        assert meta.tolist()[1:] == [hits, misses, reads]


def _gxx():
    import shutil

    return shutil.which("g++")


def _emu_binary(tensors: int, pairs: int, experts: int, share: int, nt: int, align16: bool):
    """The kernel's body compiled for the CPU emulator with a main() that hands it real
    addresses: a record file and slot tensors allocated in the emulator's own process."""
    in_dt = ["uint32", "int32", "int32", "uint32", "uint32", "uint64", "int64"]
    ins = list(zip(dr.INPUTS, in_dt, strict=True))
    outs = list(zip(dr.OUTPUTS, ["uint32", "int32", "int32", "uint32", "uint32"], strict=True))
    tmpl = dr.template(pairs, experts, share, tensors, align16)
    tmpl = [(n, nt if n == "NT" else v) for n, v in tmpl]
    tu = cp.translation_unit(
        "rq_pager_route", ins, outs, tmpl, dr.body(), "", standin='#include "emu.h"\n', prologue=""
    )
    main = r"""
#include <fstream>
#include <iterator>
#include <string>
static std::vector<char> rd(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}
static void wr(const std::string& p, const std::vector<char>& v) {
  std::ofstream f(p, std::ios::binary);
  f.write(v.data(), v.size());
}
int main(int argc, char** argv) {
  std::string d = argv[1];
  int blocks = std::stoi(argv[2]);
  std::vector<std::vector<char>> in;
  for (int i = 0; i < 7; ++i) in.push_back(rd(d + "/in" + std::to_string(i) + ".bin"));
  auto rec = rd(d + "/records.bin");
  std::vector<std::vector<char>> slots;
  for (int t = 0; t < @T@; ++t) slots.push_back(rd(d + "/slot" + std::to_string(t) + ".bin"));
  std::vector<uint64_t> ptrs(1 + @T@);
  ptrs[0] = (uint64_t)(uintptr_t)rec.data();
  for (int t = 0; t < @T@; ++t) ptrs[1 + t] = (uint64_t)(uintptr_t)slots[t].data();
  std::vector<char> o0(@P@ * 4), o1(@E@ * 4), o2(@N@ * 4), o3(@N@ * 4), o4(16);
  emu_launch(blocks, 1, 1, @NT@, [&] {
    mlx::core::cu::custom_kernel_rq_pager_route(
        (const uint32_t*)in[0].data(), (const int32_t*)in[1].data(), (const int32_t*)in[2].data(),
        (const uint32_t*)in[3].data(), (const uint32_t*)in[4].data(), ptrs.data(),
        (const int64_t*)in[6].data(), (uint32_t*)o0.data(), (int32_t*)o1.data(),
        (int32_t*)o2.data(), (uint32_t*)o3.data(), (uint32_t*)o4.data());
  });
  wr(d + "/out0.bin", o0); wr(d + "/out1.bin", o1); wr(d + "/out2.bin", o2);
  wr(d + "/out3.bin", o3); wr(d + "/out4.bin", o4);
  for (int t = 0; t < @T@; ++t) wr(d + "/slot" + std::to_string(t) + ".bin", slots[t]);
  return 0;
}
"""
    for name, v in (("T", tensors), ("P", pairs), ("E", experts), ("N", share), ("NT", nt)):
        main = main.replace(f"@{name}@", str(v))
    src = tu + main
    key = hashlib.sha256(src.encode() + (EMU_DIR / "emu.h").read_bytes()).hexdigest()[:20]
    cache = Path(tempfile.gettempdir()) / f"rq_route_emu_{os.getuid()}"
    exe = cache / f"route_{key}"
    if not exe.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cpp = exe.with_suffix(".cpp")
        cpp.write_text(src)
        cmd = [_gxx(), "-std=c++20", "-O1", "-pthread", "-w", f"-I{EMU_DIR}", "-o", f"{exe}.tmp"]
        subprocess.run([*cmd, str(cpp)], check=True, capture_output=True, text=True)
        os.replace(f"{exe}.tmp", exe)
    return exe


@pytest.mark.skipif(_gxx() is None, reason="the CUDA emulator needs g++")
@pytest.mark.parametrize(
    "sizes,align16,share",
    [
        ((48, 160, 32), True, 7),  # tensor bytes per expert (multiples of 16)
        ((48, 160, 24), True, 7),  # the 16-byte path with a tail
        ((37, 5, 130), False, 7),  # awkward sizes: the byte path
        ((37, 5, 130), False, 4),  # fewer slots than a call's experts: some stay unplaced
    ],
)
def test_kernel_matches_the_reference_step_in_the_emulator(sizes, align16, share):
    """Calls of the kernel body (3 blocks, so blocks share the copies) against the reference:
    the same slot indices and tables after every call, and each slot holding exactly the
    bytes of the record its owner names; SKIP padding and repeated ids included."""
    rng = np.random.default_rng(5)
    experts, pairs, nt, blocks = 23, 6, 32, 3
    offsets, pos = [], 8  # a record's tensors with gaps, as the record format lays them out
    for n in sizes:
        offsets.append(pos)
        pos += n + (16 - n % 16) % 16 + (16 if align16 else 3)
    stride = pos + (16 - pos % 16) % 16 if align16 else pos + 5
    records = rng.integers(0, 256, stride * experts, dtype=np.uint8)
    slots = [np.zeros(share * n, np.uint8) for n in sizes]
    geom = np.array(
        [stride] + [v for o, n in zip(offsets, sizes, strict=True) for v in (o, n)], np.int64
    )
    exe = _emu_binary(len(sizes), pairs, experts, share, nt, align16)
    tables = _fresh(experts, share)
    for call in range(25):
        ids = rng.choice(experts, size=pairs, replace=False).astype(np.uint32)
        if call % 4 == 1:
            ids[2] = ids[0]
        if call % 5 == 2:
            ids[-2:] = dr.SKIP
        want = dr.route_reference(ids, *tables)
        with tempfile.TemporaryDirectory() as d:
            ins = [ids, *tables, np.zeros(1 + len(sizes), np.uint64), geom]
            for i, a in enumerate(ins):
                Path(d, f"in{i}.bin").write_bytes(np.ascontiguousarray(a).tobytes())
            Path(d, "records.bin").write_bytes(records.tobytes())
            for t, s in enumerate(slots):
                Path(d, f"slot{t}.bin").write_bytes(s.tobytes())
            subprocess.run([str(exe), d, str(blocks)], check=True, capture_output=True)
            dts = [np.uint32, np.int32, np.int32, np.uint32, np.uint32]
            got = [np.fromfile(Path(d, f"out{i}.bin"), dtype=dt) for i, dt in enumerate(dts)]
            slots = [np.fromfile(Path(d, f"slot{t}.bin"), np.uint8) for t in range(len(sizes))]
        live = ids != dr.SKIP
        assert np.array_equal(got[0][live], want[0][live]), call
        for g, w in zip(got[1:], want[1:5], strict=True):
            assert np.array_equal(g, w), call
        tables = tuple(want[1:5])
        owner = tables[1]
        for v in range(share):
            if owner[v] < 0:
                continue
            rec = records[owner[v] * stride :][:stride]
            for t, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
                assert np.array_equal(slots[t][v * n : (v + 1) * n], rec[o : o + n]), (call, v, t)


PROMPT = mx.array(np.random.default_rng(7).integers(3, 1000, 80).tolist())


def _generate(model, n):
    toks, lps = [], []
    for tok, lp in generate_step(PROMPT, model, max_tokens=n):
        toks.append(int(tok))
        lps.append(lp)
    return toks, lps


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "nemotron_h"])
def test_device_route_generation_is_bit_identical(tmp_path, arch):
    """Through the reference backend (the kernel's step on the host): at half the experts the
    decode calls run in one pass each; at a fifth a layer's share is under its pairs and
    every call goes through the groups. Both equal the resident model at every step, and the
    statistics come from the step's counters."""
    src = make_random_model(arch, tmp_path / "src", seed=11, scale=0.5)
    out = tmp_path / "rq"
    convert(src, out)
    toks, lps = _generate(load(out).model, 40)
    mx.eval(lps)
    with ExpertStore(out) as st:
        total = st.expert_bytes()
    for frac, groups in ((0.5, False), (0.2, True)):
        lm = load_paged(out, int(total * frac), device_route="reference")
        got_toks, got_lps = _generate(lm.model, 40)
        assert got_toks == toks
        for i, (a, b) in enumerate(zip(got_lps, lps, strict=True)):
            assert mx.array_equal(a, b).item(), f"{arch} {frac}: log-probs differ at step {i}"
        s = lm.model.rq_pager.stats()
        assert s["read_path"] == "device_route_reference" and s["device_route"] == "reference"
        assert s["misses"] > 0 and s["hits"] + s["misses"] > 0
        assert s["reads"] > 0 and s["evictions"] > 0
        assert (s["split_calls"] > 40) == groups
        pager = lm.model.rq_pager
        for layer, state in pager.device.items():
            owner = np.asarray(state.owner)
            assert s["layers"][str(layer)]["resident"] == int((owner >= 0).sum())
        pager.reset_stats()
        assert pager.stats()["hits"] == 0 and pager.stats()["reads"] == 0


def test_device_route_refused_where_it_cannot_run(tmp_path):
    """ "cuda" without a CUDA backend and "reference" without slots the host can write fail
    with the reason; "auto" falls back to the host path and says why."""
    from app.engine.testing.synth import write_random_experts

    section = write_random_experts(tmp_path, 2, 16, {"fc1": (64, 128), "fc2": (128, 64)}, seed=2)
    store = ExpertStore(tmp_path, section)
    budget = store.expert_bytes() // 2
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        with pytest.raises(ValueError, match="no CUDA backend"):
            ExpertPager(store, budget, PagerOptions(device_route="cuda"))
        p = ExpertPager(store, budget, PagerOptions(device_route="auto"))
        assert p.device is None and p.stats()["device_route"] == "off (no CUDA backend)"
    with pytest.raises(ValueError, match="unified memory"):
        ExpertPager(store, budget, PagerOptions(device_route="reference", zero_copy=False))
    with pytest.raises(ValueError, match="device_route must be one of"):
        PagerOptions(device_route="gpu")
    p = ExpertPager(store, store.expert_bytes(), PagerOptions(device_route="reference"))
    assert p.device is None  # every expert resident: nothing to resolve


@pytest.mark.skipif(
    not (getattr(mx, "cuda", None) and mx.cuda.is_available()), reason="needs MLX's CUDA backend"
)
def test_cuda_kernel_lands_the_resident_bytes(tmp_path):
    """On a GPU: the kernel's steps through the pager give, every call, the reference step's
    slots and tables, and the slots hold the bytes the resident pager holds for those
    experts."""
    from app.engine.offload.trace import model_traces
    from app.engine.testing.synth import write_random_experts

    experts, k, steps = 32, 4, 40
    section = write_random_experts(
        tmp_path, 3, experts, {"fc1": (64, 128), "fc2": (128, 64)}, seed=2
    )
    store = ExpertStore(tmp_path, section)
    full = ExpertPager(store, store.expert_bytes())
    opts = PagerOptions(zero_copy=False, pin_records=True, device_route="cuda")
    paged = ExpertPager(store, store.expert_bytes() // 4, opts)
    assert paged.read_path == "device_route"
    traces = model_traces(store.layers, experts, k, steps, seed=4)
    host = {layer: [np.asarray(a) for a in s.tables()] for layer, s in paged.device.items()}
    for t in range(steps):
        for layer in store.layers:
            ids = traces[layer][t].astype(np.uint32)
            state = paged.device[layer]
            local = paged.device_step(layer, mx.array(ids))
            want, *host[layer], _ = dr.route_reference(ids, *host[layer])
            assert np.array_equal(np.asarray(local), want), (t, layer)
            for got, ref in zip(state.tables(), host[layer], strict=True):
                assert np.array_equal(np.asarray(got), ref), (t, layer)
            slots = mx.array(want.astype(np.int64) + state.lo)
            base = full.base[layer]
            for name, a in paged.arrays(layer).items():
                ref = full.arrays(layer)[name][mx.array(ids.astype(np.int64) + base)]
                assert mx.array_equal(a[slots], ref).item(), (t, layer, name)
    s = paged.stats()
    assert s["reads"] > 0 and s["hits"] > 0 and s["readbacks"] == 0
    paged.close()


def test_device_route_default_follows_the_environment(monkeypatch):
    from app.engine.offload.pager import DEVICE_ROUTE_ENV

    monkeypatch.delenv(DEVICE_ROUTE_ENV, raising=False)
    assert PagerOptions().device_route == "auto"
    monkeypatch.setenv(DEVICE_ROUTE_ENV, "off")
    assert PagerOptions().device_route == "off"
    monkeypatch.setenv(DEVICE_ROUTE_ENV, "fast")
    with pytest.raises(ValueError, match="device_route must be one of"):
        PagerOptions()
