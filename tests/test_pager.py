"""Expert pager: paged generations equal the fully resident model bit for bit.

Tiny models (random weights at scale 0.5, so greedy decoding wanders and routing keeps
changing) are converted at the default role widths (2-bit experts); the reference is
`loader.load` (every expert resident). Budgets of 100%, 50% and 25% of the experts, 200
generated tokens after an 80-token prompt; every step's log-probabilities must be equal.
"""

import json
import os
import zlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from app.engine.errors import ModelLoadError
from app.engine.loader import load
from app.engine.offload import load_paged
from app.engine.offload.layers import PagedSwitchGLU, PagedSwitchMLP
from app.engine.offload.pager import BudgetError
from app.engine.offload.records import ExpertRecordError, ExpertStore
from app.engine.quant.convert import convert
from app.engine.testing.random_models import make_random_model

ARCHS = ["qwen3_moe", "qwen2_moe", "nemotron_h"]
PROMPT = mx.array(np.random.default_rng(7).integers(3, 1000, 80).tolist())
GEN = 200


def _generate(model, n=GEN, prompt=PROMPT):
    toks, lps = [], []
    for tok, lp in generate_step(prompt, model, max_tokens=n):
        toks.append(int(tok))
        lps.append(lp)
    return toks, lps


def expert_bytes(folder) -> int:
    with ExpertStore(folder) as st:
        return st.expert_bytes()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """arch -> (converted folder, reference tokens, reference log-probs), built once."""
    root = tmp_path_factory.mktemp("pager")
    cache = {}

    def get(arch):
        if arch not in cache:
            src = make_random_model(arch, root / f"{arch}-src", seed=11, scale=0.5)
            out = root / f"{arch}-rq"
            convert(src, out)
            ref = load(out)
            toks, lps = _generate(ref.model)
            mx.eval(lps)
            cache[arch] = (out, toks, lps)
        return cache[arch]

    return get


def _assert_same(paged_model, toks, lps, n=GEN, prompt=PROMPT):
    got_toks, got_lps = _generate(paged_model, n, prompt)
    assert got_toks == toks[:n]
    for i, (a, b) in enumerate(zip(got_lps, lps[:n], strict=True)):
        assert mx.array_equal(a, b).item(), f"log-probs differ at step {i}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("frac", [1.0, 0.5, 0.25])
def test_paged_generation_is_bit_identical(converted, arch, frac):
    folder, toks, lps = converted(arch)
    budget = int(expert_bytes(folder) * frac)
    lm = load_paged(folder, budget)
    pager = lm.model.rq_pager
    assert any(isinstance(m, (PagedSwitchGLU, PagedSwitchMLP)) for _, m in lm.model.named_modules())
    _assert_same(lm.model, toks, lps)
    s = pager.stats()
    json.dumps(s)  # plain numbers for the worker's Stats message
    assert s["resident_bytes"] <= budget and s["pool_bytes"] <= budget
    assert s["hits"] + s["misses"] > GEN * len(s["layers"])
    if frac == 1.0:
        # every expert resident: no index is read back, nothing is read from disk
        assert s["mode"] == "resident" and s["readbacks"] == 0
        assert s["misses"] == 0 and s["reads"] == 0 and s["hit_rate"] == 1.0
    else:
        assert s["mode"] == "paged" and s["readbacks"] > 0
        assert s["misses"] > 0 and s["evictions"] > 0 and 0 < s["hit_rate"] < 1
        assert s["bytes_read"] == s["reads"] * pager.pools[0].record_size
        for layer in s["layers"].values():
            assert layer["hits"] + layer["misses"] > 0


@pytest.mark.slow
def test_prompt_routed_to_more_experts_than_slots_runs_in_groups(converted):
    """Two slots for 32 experts: the prompt's calls split into groups of experts."""
    folder, toks, lps = converted("qwen3_moe")
    with ExpertStore(folder) as st:
        slot = st.layout(st.layers[0]).expert_bytes
    lm = load_paged(folder, 2 * slot + slot // 2)
    assert lm.model.rq_pager.stats()["slots"] == 2
    _assert_same(lm.model, toks, lps, n=12)
    s = lm.model.rq_pager.stats()
    assert s["split_calls"] >= 4  # every layer's prompt call
    assert s["resident_bytes"] == 2 * slot


@pytest.mark.slow
def test_scatter_writes_equal_zero_copy_writes(converted):
    """The CUDA-style path (host staging + functional scatter) gives the same output."""
    folder, toks, lps = converted("nemotron_h")
    lm = load_paged(folder, expert_bytes(folder) // 3, zero_copy=False, read_threads=1)
    assert not lm.model.rq_pager.zero_copy
    _assert_same(lm.model, toks, lps, n=60)
    assert lm.model.rq_pager.stats()["evictions"] > 0


def test_all_resident_with_readback_is_identical_and_counts_syncs(converted):
    folder, toks, lps = converted("qwen2_moe")
    lm = load_paged(folder, expert_bytes(folder), always_resolve=True)
    _assert_same(lm.model, toks, lps, n=20)
    s = lm.model.rq_pager.stats()
    assert s["mode"] == "paged" and s["misses"] == 0 and s["reads"] == 0
    # one per MoE layer and forward pass (generate_step runs a pass or two beyond n)
    assert s["readbacks"] % len(s["layers"]) == 0 and s["readbacks"] >= 20 * len(s["layers"])


def test_budget_below_one_expert_is_refused(converted):
    folder, _, _ = converted("qwen3_moe")
    with pytest.raises(BudgetError, match="holds no expert"):
        load_paged(folder, 100)


def test_unconverted_folder_is_refused(tmp_path):
    src = make_random_model("qwen3_moe", tmp_path / "plain", seed=1)
    with pytest.raises(ModelLoadError, match="not a converted model"):
        load_paged(src, 1 << 30)


def _record_pos(folder, layer, expert):
    with ExpertStore(folder) as st:
        lay = st.layout(layer)
        return folder / lay.file, lay.record_offset(expert)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_record_names_layer_and_expert(converted, tmp_path):
    folder, _, _ = converted("qwen3_moe")
    bad = _copy(folder, tmp_path / "bad")
    with ExpertStore(bad) as st:
        layer = st.layers[2]
    path, off = _record_pos(bad, layer, 5)
    with open(path, "r+b") as f:
        f.seek(off + 10)
        b = f.read(1)
        f.seek(off + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ExpertRecordError, match=rf"layer {layer}, expert 5: checksum mismatch"):
        load_paged(bad, expert_bytes(bad))  # all resident: every record is read at load


def _flip_byte(folder, layer, expert, at=10):
    path, off = _record_pos(folder, layer, expert)
    with open(path, "r+b") as f:
        f.seek(off + at)
        b = f.read(1)
        f.seek(off + at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_record_refused_by_the_resident_load(converted, tmp_path):
    """The default path (every expert resident, no pager) checks each record's CRC as it
    reads it: a flipped byte is an error naming the record, never silent garbage."""
    folder, _, _ = converted("qwen3_moe")
    bad = _copy(folder, tmp_path / "bad")
    with ExpertStore(bad) as st:
        layer = st.layers[-1]
    _flip_byte(bad, layer, 3)
    with pytest.raises(ExpertRecordError, match=rf"layer {layer}, expert 3: checksum mismatch"):
        load(bad)
    with pytest.raises(ExpertRecordError, match=rf"layer {layer}, expert 3: checksum mismatch"):
        load(bad, lazy=True)
    load(bad, verify=False)  # only an explicit opt-out skips the check


def test_failed_read_leaves_the_slot_free(converted, tmp_path):
    """After a checksum error the expert is not resident: the next generation in the same
    process (Regenerate) reads it again and fails the same way, instead of computing on the
    corrupt slot."""
    folder, _, _ = converted("qwen3_moe")
    bad = _copy(folder, tmp_path / "bad")
    with ExpertStore(bad) as st:
        layer, lay = st.layers[0], st.layout(st.layers[0])
    for e in range(lay.num_experts):
        _flip_byte(bad, layer, e, at=0)
    lm = load_paged(bad, expert_bytes(bad) // 2)
    pager = lm.model.rq_pager
    pool = pager.pool_of[layer]
    for _ in range(2):
        with pytest.raises(ExpertRecordError, match=rf"layer {layer}, expert \d+: checksum"):
            _generate(lm.model, n=2)
        assert not [k for k in pool.lru.slot_of if k[0] == layer]
        pool.lru.check()
        assert pager.layer_stats[layer].resident == 0


def test_corrupt_record_found_while_paging(converted, tmp_path):
    folder, _, _ = converted("qwen3_moe")
    bad = _copy(folder, tmp_path / "bad")
    with ExpertStore(bad) as st:
        layer, lay = st.layers[0], st.layout(st.layers[0])
    for e in range(lay.num_experts):  # every expert of the first MoE layer
        path, off = _record_pos(bad, layer, e)
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(b"\xde\xad")
    lm = load_paged(bad, expert_bytes(bad) // 2)
    with pytest.raises(ExpertRecordError, match=rf"layer {layer}, expert \d+: checksum"):
        _generate(lm.model, n=2)


def test_verify_records_checks_each_record_once_and_names_a_corrupt_one(converted, tmp_path):
    """The up-front check (benchmarks' steady state, or an idle pass) covers every record not
    checked yet, skips the decode path's first-read CRC afterwards, and names a bad record."""
    folder, _, _ = converted("qwen3_moe")
    first, _ = _generate(load_paged(folder, expert_bytes(folder) // 2).model, n=2)
    lm = load_paged(folder, expert_bytes(folder) // 2)
    pager = lm.model.rq_pager
    total = sum(len(v) for v in pager._verified.values())
    some = next(iter(pager._verified))
    pager._verified[some][:2] = True  # as if the decode path had read two of them
    assert pager.verify_records(threads=3) == total - 2
    assert all(v.all() for v in pager._verified.values())
    assert pager.verify_records() == 0
    assert _generate(lm.model, n=2)[0] == first  # the flags change no computation

    bad = _copy(folder, tmp_path / "bad")
    with ExpertStore(bad) as st:
        layer = st.layers[1]
    _flip_byte(bad, layer, 6, at=3)
    lm = load_paged(bad, expert_bytes(bad) // 2)
    with pytest.raises(ExpertRecordError, match=rf"layer {layer}, expert 6: checksum mismatch"):
        lm.model.rq_pager.verify_records(threads=2)
    assert not lm.model.rq_pager._verified[layer][6]


def test_truncated_expert_file_is_refused_at_load(converted, tmp_path):
    folder, _, _ = converted("nemotron_h")
    bad = _copy(folder, tmp_path / "bad")
    with ExpertStore(bad) as st:
        layer = st.layers[-1]
        path = bad / st.layout(layer).file
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(ExpertRecordError, match=rf"layer {layer}: expert file truncated"):
        load_paged(bad, expert_bytes(bad) // 2)


def test_verify_off_skips_the_checksum_but_not_the_size(converted, tmp_path):
    folder, _, _ = converted("qwen3_moe")
    bad = _copy(folder, tmp_path / "bad")
    with ExpertStore(bad) as st:
        layer = st.layers[0]
        lay = st.layout(layer)
        path, off = bad / lay.file, lay.record_offset(1)
        crc = st.layout(layer).checksums[1]
    data = bytearray(path.read_bytes())
    data[off + lay.tensors[0].offset] ^= 1
    path.write_bytes(bytes(data))
    assert zlib.crc32(bytes(data[off : off + lay.record_size])) != crc
    lm = load_paged(bad, expert_bytes(bad), verify=False)  # loads: no CRC check asked
    assert lm.model.rq_pager.stats()["slots"] == expert_bytes(bad) // lay.expert_bytes


def test_paged_model_holds_no_expert_parameters(converted):
    from mlx.utils import tree_flatten

    folder, _, _ = converted("nemotron_h")
    lm = load_paged(folder, expert_bytes(folder) // 4)
    names = [k for k, _ in tree_flatten(lm.model.parameters())]
    assert names and not any("switch_mlp" in k for k in names)
    per_layer = lm.model.rq_pager.stats()["layers"]
    with ExpertStore(folder) as st:
        assert sorted(per_layer) == sorted(str(x) for x in st.layers)


def test_async_eval_option_is_identical(converted):
    """Starting each layer's experts at once must not let a later read overwrite their slots."""
    folder, toks, lps = converted("qwen2_moe")
    lm = load_paged(folder, expert_bytes(folder) // 3, async_eval=True)
    _assert_same(lm.model, toks, lps, n=40)
    assert lm.model.rq_pager.stats()["evictions"] > 0


def _window_limit(folder, slots: int) -> int:
    """An index limit that lets one call span `slots` slots of the first layer's pool."""
    with ExpertStore(folder) as st:
        return slots * st.layout(st.layers[0]).slot_elements + 1


@pytest.mark.slow
@pytest.mark.parametrize("frac", [1.0, 0.5])
def test_slot_windows_are_bit_identical(converted, monkeypatch, frac):
    """CUDA's slot windows (32-bit weight offsets) and 8-row padding, forced on any backend:
    windows of 3 slots, parts padded up to 64 rows."""
    from app.engine.offload import layers

    folder, toks, lps = converted("qwen3_moe")
    monkeypatch.setattr(layers, "_index_limit", lambda: _window_limit(folder, 3))
    monkeypatch.setattr(layers, "QMV_ROWS", 64)
    calls = []
    real = layers._PagedSwitch._call_windows
    monkeypatch.setattr(
        layers._PagedSwitch, "_call_windows", lambda self, *a: calls.append(1) or real(self, *a)
    )
    lm = load_paged(folder, int(expert_bytes(folder) * frac))
    mods = [m for _, m in lm.model.named_modules() if isinstance(m, PagedSwitchGLU)]
    assert mods and all(m._window == 3 for m in mods)
    _assert_same(lm.model, toks, lps, n=40)
    assert (len(calls) > 0) == (frac < 1.0)  # all resident: each layer's own 8 slots, no split


@pytest.mark.parametrize("frac", [1.0, 0.4])
def test_pools_split_into_banks_under_the_index_limit_are_bit_identical(converted, frac):
    """A pool wider than the index limit (CUDA: 32-bit weight offsets) is split into banks of
    contiguous layers, each within the limit: every call gathers from its bank in one call
    (no slot windows), with the budget shared out, and the tokens stay the resident ones."""
    from app.engine.offload import layers

    folder, toks, lps = converted("qwen3_moe")
    with ExpertStore(folder) as st:
        per, n_layers = st.layout(st.layers[0]).slot_elements, len(st.layers)
    budget = int(expert_bytes(folder) * frac)
    one = load_paged(folder, budget).model.rq_pager
    assert len(one.pools) == 1
    limit = (one.pools[0].num_slots // 3) * per + 1  # three banks or more
    lm = load_paged(folder, budget, bank_elements=limit)
    pager = lm.model.rq_pager
    assert 3 <= len(pager.pools) <= n_layers
    assert all(p.num_slots <= (limit - 1) // per for p in pager.pools)
    assert sum(p.num_slots for p in pager.pools) <= one.pools[0].num_slots
    assert sorted(x for p in pager.pools for x in p.layers) == sorted(one.pools[0].layers)
    mods = [m for _, m in lm.model.named_modules() if isinstance(m, PagedSwitchGLU)]
    assert mods and all(m._window is None for m in mods)
    orig = layers._index_limit
    try:  # the layers see the same limit the banks were cut for
        layers._index_limit = lambda: limit
        assert all(m._window_slots(pager, m._layer) is None for m in mods)
    finally:
        layers._index_limit = orig
    _assert_same(lm.model, toks, lps, n=24)


@pytest.mark.slow
def test_groups_with_slot_windows_are_bit_identical(converted, monkeypatch):
    from app.engine.offload import layers

    folder, toks, lps = converted("nemotron_h")
    monkeypatch.setattr(layers, "_index_limit", lambda: _window_limit(folder, 3))
    monkeypatch.setattr(layers, "QMV_ROWS", 64)
    with ExpertStore(folder) as st:
        slot = st.layout(st.layers[0]).expert_bytes
    lm = load_paged(folder, 5 * slot + slot // 2)
    _assert_same(lm.model, toks, lps, n=12)
    assert lm.model.rq_pager.stats()["split_calls"] > 0


def test_paged_model_survives_deepcopy_and_follows_dtype_casts(converted):
    """A deep copy is refused cleanly (nothing copied, so the live pager's files stay open), and
    a dtype cast of the model reaches the paged layers' outputs."""
    import copy
    import gc

    folder, toks, lps = converted("qwen3_moe")
    lm = load_paged(folder, expert_bytes(folder) // 2)
    with pytest.raises(TypeError, match="paged experts cannot be deep-copied"):
        copy.deepcopy(lm.model)
    gc.collect()
    _assert_same(lm.model, toks, lps, n=20)  # its files are still open: no EBADF
    lm.model.set_dtype(mx.float16)
    out = lm.model(PROMPT[None, :8])
    assert out.dtype == mx.float16 and bool(mx.isfinite(out).all())
