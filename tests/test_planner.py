"""The auto-planner (app/engine/planner.py): invariants over machines and real configs, the
paper's reference outcomes, overrides, and the attention-share profile."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from app.engine import planner, profile, sizes
from app.engine.planner import GiB, Machine, ModelTooLarge, PlanRefused, make_plan, plan_model
from app.engine.profile import ShareSource
from app.engine.testing.random_models import TINY_CONFIGS, make_random_model

CONFIGS = Path(__file__).parent / "data" / "configs"
CONFIG_FILES = sorted(CONFIGS.glob("*.json"))
RAMS = (16, 32, 64, 128)
BACKENDS = ("metal", "cuda", "cpu")


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ROTARYQUANT_CONFIGS", str(CONFIGS))


def _plan_or_refusal(path, ram_gib, backend, **kw):
    try:
        return plan_model(path, Machine.simulate(ram_gib * GiB, backend), **kw)
    except ModelTooLarge as e:
        return e


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_plans_fit_and_more_ram_is_never_worse(path, backend):
    plans = [_plan_or_refusal(path, g, backend) for g in RAMS]
    for p in plans:
        if isinstance(p, ModelTooLarge):
            continue
        m = p.machine
        assert p.process_peak <= m.usable <= m.ram - m.reserve
        assert p.total_peak <= m.ram
        assert p.peak["kv_cache"] == p.sizes.kv_bytes(p.context_limit, p.kv_modes, p.prefill_chunk)
        assert p.peak["activations"] == planner.activation_bytes(
            p.sizes, p.context_limit, m, p.prefill_chunk
        )
        assert p.expert_budget <= p.expert_bytes
        assert ("zipfusion" in p.kv_modes.values()) <= (backend == "cuda")
        assert p.reasons and all(isinstance(r, str) and r for r in p.reasons)
        json.dumps(p.to_dict())  # serialisable for plans.json and the UI
    for i in range(len(RAMS) - 1):
        (ga, a), (gb_, b) = (RAMS[i], plans[i]), (RAMS[i + 1], plans[i + 1])
        if isinstance(a, ModelTooLarge):
            continue
        assert not isinstance(b, ModelTooLarge), f"fits {ga} GB but refused at {gb_} GB"
        assert b.at_least_as_good_as(a), (ga, a.quality(), gb_, b.quality())
        assert b.expert_budget >= a.expert_budget or b.kv_modes != a.kv_modes


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_refusal_names_the_smallest_machine(path):
    with pytest.raises(ModelTooLarge) as e:
        plan_model(path, Machine.simulate(2 * GiB, "metal"))
    small = e.value.smallest_ram
    assert small is not None and f"{small // GiB} GB" in str(e.value)
    assert e.value.needed > e.value.available
    plan_model(path, Machine.simulate(small, "metal"))  # that machine runs it...
    smaller = [g for g in planner.STANDARD_RAM_GIB if 2 < g < small // GiB]
    for g in smaller:  # ...and no smaller standard one does
        with pytest.raises(ModelTooLarge):
            plan_model(path, Machine.simulate(g * GiB, "metal"))


def test_paper_outcomes():
    m16, m32 = Machine.simulate("16GB", "metal"), Machine.simulate("32GB", "metal")
    for name in ("gemma-4-26b-a4b-it", "qwen3-30b-a3b"):
        p = plan_model(CONFIGS / f"{name}.json", m16)
        assert p.total_peak <= 16 * GiB and not p.paging, p.summary()
    nemo = plan_model(CONFIGS / "nemotron-3-super-120b-a12b.json", m32)
    assert nemo.paging and nemo.expert_budget >= nemo.min_expert_budget
    assert nemo.kv_modes == {"full": "fp16"}
    assert nemo.attention_share.share < planner.SHARE_THRESHOLD
    assert any("8 " in r or "fp16" in r for r in nemo.reasons)
    qwen_long = plan_model(CONFIGS / "qwen3-30b-a3b.json", m32, 32768)
    assert qwen_long.kv_modes == {"full": "isoquant3"}
    assert qwen_long.attention_share.share > planner.SHARE_THRESHOLD
    assert any("isoquant3" in r and "decode time" in r for r in qwen_long.reasons)


def test_share_rule_and_backends():
    s = sizes.sizes_for(CONFIGS / "qwen3-30b-a3b.json")
    hi, lo = ShareSource(0.5, 4096, True, "test"), ShareSource(0.1, 4096, True, "test")
    metal, cuda, cpu = (Machine.simulate("64GB", b) for b in BACKENDS)
    assert make_plan(s, metal, 4096, share=hi).kv_modes["full"] == "isoquant3"
    assert make_plan(s, metal, 4096, share=lo).kv_modes["full"] == "fp16"
    assert make_plan(s, cuda, 4096, share=hi).kv_modes["full"] == "zipfusion"  # lossless first
    # CPU: no fused kernels, so a high share alone does not justify compression
    p = make_plan(s, cpu, 4096, share=hi)
    assert p.kv_modes["full"] == "fp16" and any("no fused" in r for r in p.reasons)
    assert "measured" in make_plan(s, metal, 4096, share=hi).reasons[1]
    assert "estimated" in make_plan(s, metal, 4096).attention_share.label


def test_kv_compressed_when_it_would_not_fit_otherwise():
    s = sizes.sizes_for(CONFIGS / "llama-3.1-8b.json")
    low = ShareSource(0.0, 1, True, "test")
    p = make_plan(s, Machine.simulate("16GB", "cpu"), 65536, share=low)
    assert p.kv_modes["full"] == "isoquant3" and any("would not fit" in r for r in p.reasons)
    assert (
        make_plan(s, Machine.simulate("64GB", "cpu"), 65536, share=low).kv_modes["full"] == "fp16"
    )
    # with the default context the planner shortens the context before refusing; sweep RAM
    # finely (64 MB steps) through the region where that happens
    s8 = sizes.compute(
        json.loads((CONFIGS / "llama-3.1-8b.json").read_text()), planner.RoleWidths.parse("dense=8")
    )
    seen, last = [], None
    for step in range(0, 64):
        m = Machine.simulate(11 * GiB + step * (64 << 20), "cpu")
        try:
            p = make_plan(s8, m, share=low)
        except ModelTooLarge:
            assert last is None, "refused after a smaller machine was planned"
            continue
        if last is not None:
            assert p.at_least_as_good_as(last)
        seen.append((p.context_limit, p.kv_modes["full"]))
        last = p
    assert any(
        planner.MIN_CONTEXT <= c < planner.DEFAULT_CONTEXT and k == "isoquant3" for c, k in seen
    ), seen
    assert seen[-1] == (planner.DEFAULT_CONTEXT, "fp16"), seen


def test_overrides_refused_with_numbers():
    qwen = CONFIGS / "qwen3-30b-a3b.json"
    m16 = Machine.simulate("16GB", "metal")
    with pytest.raises(PlanRefused, match="kv-mode: ZipFusion needs an NVIDIA GPU"):
        plan_model(qwen, m16, kv_mode="zipfusion")
    assert (
        plan_model(qwen, Machine.simulate("16GB", "cuda"), kv_mode="zipfusion").kv_mode
        == "zipfusion"
    )
    with pytest.raises(PlanRefused, match=r"expert-budget: .*needs 40.0 GiB, .* available") as e:
        plan_model(qwen, m16, expert_budget="40GB")
    assert e.value.needed == 40 * GiB and e.value.available < 40 * GiB
    with pytest.raises(PlanRefused, match="below the pager's minimum"):
        plan_model(qwen, m16, expert_budget="100MB")
    p = plan_model(qwen, m16, expert_budget="3GB")
    assert p.paging and p.expert_budget == 3 * GiB
    with pytest.raises(PlanRefused, match="context: KV for 40960 tokens"):
        plan_model(qwen, Machine.simulate("8GB", "cpu"), 40960, kv_mode="fp16")
    with pytest.raises(PlanRefused, match="no routed experts"):
        plan_model(CONFIGS / "qwen3-8b.json", m16, expert_budget="1GB")
    with pytest.raises(PlanRefused, match="at most 40960 tokens"):
        plan_model(qwen, m16, 100_000)
    w3 = plan_model(qwen, Machine.simulate("32GB", "metal"), widths="routed=3")
    assert w3.widths.routed.bits == 3 and w3.expert_bytes > plan_model(qwen, m16).expert_bytes


def test_converted_model_widths_are_fixed(tmp_path):
    folder = make_random_model("qwen3_moe", tmp_path / "tiny", seed=1)
    from app.engine.manifest import Manifest

    man = Manifest.load(folder)
    man.roles = {
        r: {"bits": b, "group_size": 64}
        for r, b in (("dense", 4), ("routed", 2), ("shared", 8), ("keep_float", None))
    }
    man.save(folder)
    p = plan_model(folder, Machine.detect())
    assert p.widths_fixed and p.sizes.weights_on_disk > 0
    assert p.peak["dense_weights"] + p.expert_bytes == p.sizes.weights_on_disk
    with pytest.raises(PlanRefused, match="widths: .*new conversion"):
        plan_model(folder, Machine.detect(), widths="routed=3")


def test_plan_checks_itself():
    p = plan_model(CONFIGS / "qwen3-30b-a3b.json", Machine.simulate("16GB", "metal"))
    with pytest.raises(ValueError, match="exceeds usable"):
        dataclasses.replace(p, peak={**p.peak, "kv_cache": 20 * GiB})
    with pytest.raises(ValueError, match="paging"):
        dataclasses.replace(p, paging=True)
    with pytest.raises(ValueError, match="not available on metal"):
        dataclasses.replace(p, kv_modes={"full": "zipfusion"})
    worse = dataclasses.replace(
        p, kv_modes={"full": "isoquant3"}, context_limit=4096, peak={**p.peak}
    )
    assert not worse.at_least_as_good_as(dataclasses.replace(p, kv_modes={"full": "fp16"}))


def test_parse_size_and_machine():
    assert planner.parse_size("32GB") == planner.parse_size("32g") == 32 * GiB
    assert planner.parse_size("512MB") == 512 << 20 and planner.parse_size("16") == 16 * GiB
    with pytest.raises(ValueError, match="bad size"):
        planner.parse_size("lots")
    m = Machine.simulate("32GB", "metal")
    assert m.working_set < m.ram - m.reserve and m.usable == m.working_set
    here = Machine.detect()
    assert here.ram > 0 and here.available is not None and not here.simulated


def test_profile_fit_and_cache(tmp_path):
    key = {"model": "x", "backend": "cpu"}
    # t(T) = 10 ms + 1 us/token: at T = 10,000 attention is half of a step
    prof = profile.Profile(
        key=key, times={str(t): 0.010 + 1e-6 * t for t in (1000, 4000)}, base=0.010 + 1e-6
    )
    assert prof.share(10_000).share == pytest.approx(0.5, rel=1e-3)
    assert prof.share(10_000).measured
    profile.save_profile(prof)
    assert profile.load_profile(key) == prof
    assert profile.load_profile({**key, "backend": "metal"}) is None


@pytest.mark.slow
def test_measured_share_on_a_tiny_model(tmp_path, monkeypatch):
    from app.engine import loader

    folder = make_random_model(TINY_CONFIGS["qwen3_moe"], tmp_path / "m", seed=0)
    lm = loader.load(folder)
    key = profile.profile_key(folder, "cpu", "test")
    prof = profile.measure_share(lm.model, key, contexts=(1024, 8192), steps=5, warmup=2)
    a, b = prof.fit()
    assert prof.base > 0 and b > 0
    assert prof.times["8192"] > prof.base  # attending 8192 cached tokens costs something
    s = prof.share(8192)
    assert 0 < s.share < 1 and s.measured

    def boom(*a, **k):
        raise AssertionError("re-measured instead of using the cache")

    monkeypatch.setattr(profile, "_step", boom)
    assert profile.measure_share(lm.model, key, contexts=(1024, 8192)) == prof
    # the planner picks up the cached profile for this folder on this machine
    from app.engine.backend import detect

    b_ = detect()
    profile.save_profile(
        dataclasses.replace(prof, key=profile.profile_key(folder, b_.name, b_.device))
    )
    p = plan_model(folder, Machine.detect(), 2048)
    assert p.attention_share.measured


def test_cli_plan(capsys):
    from app.engine import planner_commands

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    planner_commands.add_commands(sub)
    args = parser.parse_args(
        ["plan", "nemotron-3-super-120b-a12b", "--ram", "32GB", "--backend", "metal", "--json"]
    )
    assert args.func(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["paging"] and d["kv_modes"] == {"full": "fp16"} and d["machine"]["ram"] == 32 * GiB
    args = parser.parse_args(["plan", "qwen3-30b-a3b", "--ram", "16GB", "--backend", "metal"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "expected peak" in out and "reasons" in out
    args = parser.parse_args(["plan", "gpt-oss-120b", "--ram", "4GB", "--backend", "metal"])
    with pytest.raises(ModelTooLarge, match="smallest machine"):
        args.func(args)
    args = parser.parse_args(["sizes", "gpt-oss-20b", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "gpt_oss"
    args = parser.parse_args(["sizes", "gpt-oss-20b"])  # a table by default
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpt-oss-20b (gpt_oss)") and "routed" in out and "GiB" in out
    assert "{" not in out


def test_reasons_name_only_the_roles_a_model_has_and_no_spec():
    """Qwen3-30B-A3B has no shared experts; Llama-4-style shared experts are named; no reason
    cites a document the user does not have."""
    m = Machine.simulate("64GB", "metal")
    qwen = make_plan(sizes.sizes_for(CONFIGS / "qwen3-30b-a3b.json"), m)
    assert qwen.sizes.params["shared"] == 0
    assert not any("shared" in r for r in qwen.reasons), qwen.reasons
    assert "routed experts 2-bit" in qwen.reasons[0]
    shared = next(
        (
            s
            for f in sorted(CONFIGS.glob("*.json"))
            if (s := _sizes_or_none(f)) is not None and s.params["shared"] > 0
        ),
        None,
    )
    assert shared is not None, "a config with shared experts"
    assert (
        "shared experts 8-bit" in make_plan(shared, Machine.simulate("512GB", "metal")).reasons[0]
    )
    for p in (qwen,):
        assert not any("SPEC" in r or "§" in r for r in p.reasons), p.reasons


def _sizes_or_none(f):
    try:
        return sizes.sizes_for(f)
    except Exception:  # a config the sizer does not know
        return None


@pytest.mark.parametrize(
    "argv,match",
    [
        (["plan", "qwen3-30b-a3b", "--ram", "32GB", "--context", "0"], "at least 1 token, got 0"),
        (["plan", "qwen3-30b-a3b", "--ram", "32GB", "--context", "-5"], "at least 1 token, got -5"),
        (["plan", "qwen3-30b-a3b", "--ram", "32GB", "--widths", "foo=4"], "unknown role 'foo'"),
        (["plan", "qwen3-30b-a3b", "--ram", "32GB", "--widths", "routed=x"], "expected role=bits"),
        (["sizes", "qwen3-30b-a3b", "--widths", "foo=4"], "unknown role 'foo'"),
    ],
)
def test_cli_refuses_bad_context_and_widths_with_a_message(argv, match):
    from app.engine import planner_commands
    from app.engine.errors import EngineError

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    planner_commands.add_commands(sub)
    args = parser.parse_args(argv)
    with pytest.raises(EngineError, match=match):
        args.func(args)


def test_prefill_chunk_grows_only_into_memory_the_plan_leaves():
    s = sizes.compute(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()), name="qwen3")
    m = Machine.simulate(32 * GiB, "metal")
    ctx = 8192

    def extra(chunk):
        return (
            planner.activation_bytes(s, ctx, m, chunk)
            + s.kv_bytes(ctx, "fp16", chunk)
            - planner.activation_bytes(s, ctx, m, 512)
            - s.kv_bytes(ctx, "fp16", 512)
        )

    assert 0 < extra(1024) < extra(2048)
    assert planner.prefill_chunk(s, m, ctx, 0)[0] == 512
    assert planner.prefill_chunk(s, m, ctx, extra(1024))[0] == 1024
    assert planner.prefill_chunk(s, m, ctx, extra(2048) - 1)[0] == 1024
    chunk, why = planner.prefill_chunk(s, m, ctx, extra(2048))
    assert chunk == 2048 and "2048-token steps" in why


def test_prefill_peak_counts_one_layer_of_widened_experts_on_cuda():
    """CUDA's prefill calls widen a layer's routed codes to 8 bits (expert_widen.py): one
    layer's routed weights at one byte each, beside the step's activations; not elsewhere."""
    s = sizes.compute(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()), name="qwen3")
    cuda, metal = Machine.simulate(80 * GiB, "cuda"), Machine.simulate(80 * GiB, "metal")
    one_layer = s.experts_per_layer * s.params_per_expert  # 128 x 3 x 768 x 2048
    assert one_layer == 128 * 3 * 768 * 2048
    assert planner.widened_expert_bytes(s, metal) == 0
    assert planner.widened_expert_bytes(s, cuda) == one_layer
    base = planner.activation_bytes(s, 8192, metal, 2048)
    assert planner.activation_bytes(s, 8192, cuda, 2048) - base == one_layer
    wide = dataclasses.replace(s, widths=s.widths.with_bits(routed=8))
    assert planner.widened_expert_bytes(wide, cuda) == 0  # 8-bit experts are not widened


def test_plan_sizes_prefill_chunk_and_counts_it():
    roomy = plan_model(CONFIGS / "qwen3-30b-a3b.json", Machine.simulate(32 * GiB, "metal"))
    assert roomy.prefill_chunk == 2048 and not roomy.paging
    assert roomy.peak["activations"] == planner.activation_bytes(
        roomy.sizes, roomy.context_limit, roomy.machine, 2048
    )
    assert roomy.process_peak <= roomy.machine.usable
    assert roomy.prefill_reason in roomy.reasons and roomy.to_dict()["prefill_chunk"] == 2048
    # paged: the step takes only what the expert budget (chosen for speed) leaves over
    paged = plan_model(
        CONFIGS / "nemotron-3-super-120b-a12b.json", Machine.simulate(32 * GiB, "metal")
    )
    assert paged.paging and f"{paged.prefill_chunk}-token steps" in paged.prefill_reason
    assert paged.peak["activations"] == planner.activation_bytes(
        paged.sizes, paged.context_limit, paged.machine, paged.prefill_chunk
    )
    assert paged.process_peak <= paged.machine.usable
    with pytest.raises(ValueError, match="prefill chunk"):
        dataclasses.replace(roomy, prefill_chunk=777)


def test_prefill_chunk_for_a_config_and_where_nothing_fits():
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    chunk, why = planner.prefill_chunk_for(cfg, Machine.simulate(32 * GiB, "metal"))
    assert chunk == 2048 and why
    chunk, why = planner.prefill_chunk_for(cfg, Machine.simulate(4 * GiB, "metal"))
    assert chunk == 512 and "no plan fits" in why
