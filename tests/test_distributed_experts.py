"""Expert parallelism over mx.distributed: 2 local ranks (mlx.launch, ring backend over loopback),
every rank running every layer with half of each MoE layer's routed experts, give the single
process's greedy tokens and its log-probabilities within float rounding (the all_sum adds the
two ranks' partial outputs, a different summation order than one process's).

Tiny qwen3_moe, gpt_oss, nemotron_h (Mamba layers, a shared expert), qwen3_next (Gated DeltaNet
layers, a gated shared expert) and deepseek_v3 (MLA attention, a dense first layer, a shared
expert, group-limited sigmoid routing) — random weights at scale 0.5, converted: 2-bit experts —
fp16 and isoquant3 caches (an 8-token float window, so that the prompt's KV is compressed where
IsoQuant runs; deepseek_v3's MLA layers keep a float cache), experts resident and paged (each
rank pages its own half within its own budget), and a plain mlx-lm folder (the stacked experts
sliced at load): twenty-one runs in one launch.
"""

import json
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_distributed import PROMPT, _env, kill_mid_generation

from app.engine import kvcache as kv
from app.engine.distributed.experts import ExpertStage, LocalExperts, expert_ranges
from app.engine.distributed.launch import launch_argv
from app.engine.distributed.rank import run_greedy
from app.engine.distributed.stage import layer_list, load_stage
from app.engine.errors import EngineError
from app.engine.loader import load as load_converted
from app.engine.offload import load_paged
from app.engine.offload.records import ExpertStore
from app.engine.quant.convert import convert
from app.engine.testing.random_models import TINY_CONFIGS, make_random_model
from app.engine.testing.tiny import EXTRA_TINY_CONFIGS

ARCHS = ["qwen3_moe", "gpt_oss", "nemotron_h", "qwen3_next", "deepseek_v3"]
CONFIGS = {
    **TINY_CONFIGS,
    "qwen3_next": EXTRA_TINY_CONFIGS["qwen3_next"],
    # DeepSeek-V3 routes within the best 4 of 8 groups of experts: here 2 of 4 groups of 2
    "deepseek_v3": {**EXTRA_TINY_CONFIGS["deepseek_v3"], "n_group": 4, "topk_group": 2},
}
# (layers, MoE layers) of each tiny model: nemotron_h is "ME*EME", with a shared expert;
# qwen3_next is 3 Gated DeltaNet layers and 1 attention layer, each with a MoE block;
# deepseek_v3's first layer has a dense MLP
SHAPE = {
    "qwen3_moe": (4, 4),
    "gpt_oss": (4, 4),
    "nemotron_h": (6, 3),
    "qwen3_next": (4, 4),
    "deepseek_v3": (3, 2),
}
KV_MODES = ["fp16", "isoquant3"]
KV_WINDOW = {"fp16": None, "isoquant3": 8}  # IsoQuant's float tail: 8 of the 32 tokens
GEN = 8
HIDDEN = 128
RANKS = 2
# The same weights, the partial sums added in another order: float32 rounding, which the random
# weights at scale 0.5 amplify over the layers; measured: at most 1.5e-4 (2.2e-5 relative to
# 1 + |log-prob|), on the plain float32 folder. A missing or doubled expert moves them by units.
LOGPROB_ATOL, LOGPROB_RTOL = 1e-4, 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist-experts")
    out = {}
    for arch in ARCHS:
        src = make_random_model(CONFIGS[arch], root / f"{arch}-src", seed=11, scale=0.5)
        convert(src, root / f"{arch}-rq")
        with ExpertStore(root / f"{arch}-rq") as st:
            out[arch] = (root / f"{arch}-rq", st.expert_bytes(), src)
    return out


def _runs(models) -> list[dict]:
    runs = []
    for arch in ARCHS:
        folder, expert_bytes, _ = models[arch]
        for mode in KV_MODES:
            for paged in (False, True):
                # each rank's budget: half of its half of the experts, so that it pages
                budget = expert_bytes // (2 * RANKS) if paged else None
                runs.append(
                    {
                        "model": str(folder),
                        "split": "experts",
                        "kv_mode": mode,
                        "kv_window": KV_WINDOW[mode],
                        "expert_budget": budget,
                        "arch": arch,
                        "ref": (arch, mode, paged),
                    }
                )
    plain = models["qwen3_moe"][2]
    runs.append(
        {
            "model": str(plain),
            "split": "experts",
            "kv_mode": "fp16",
            "arch": "qwen3_moe",
            "ref": ("plain", "fp16", False),
        }
    )
    return runs


@pytest.fixture(scope="module")
def reference(models):
    """(tokens, log-probs, weight bytes) of each run in this process, no distribution."""
    ref = {}
    for run in _runs(models):
        arch, mode, paged = run["ref"]
        if arch == "plain":
            from mlx_lm.utils import load_model

            model, _ = load_model(Path(run["model"]))
        elif paged:
            model = load_paged(run["model"], models[arch][1] // 2).model
        else:
            model = load_converted(run["model"]).model
        window = run.get("kv_window")
        opts = {} if window is None else {"window": window}
        toks, lps = run_greedy(model, PROMPT, kv.make_cache(model, mode, **opts), GEN)
        ref[run["ref"]] = (
            toks,
            np.array([np.array(lp.astype(mx.float32)) for lp in lps]),
            sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        )
    return ref


@pytest.mark.slow
def test_expert_split_gives_the_single_process_tokens_and_logits(models, reference, tmp_path):
    spec = {"runs": _runs(models), "prompt": PROMPT, "max_tokens": GEN}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    argv = launch_argv(
        [
            "x",
            "--check",
            str(tmp_path / "spec.json"),
            "--out",
            str(tmp_path),
            "--step-timeout",
            "120",
        ],
        ranks=RANKS,
        backend="ring",
    )
    p = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    worst = 0.0
    for i, run in enumerate(spec["runs"]):
        toks, lps, weights = reference[tuple(run["ref"])]
        what = " ".join(map(str, run["ref"]))
        shares = [res["runs"][i]["stage"]["experts"] for res in results]
        assert shares == [[0, 4], [4, 8]], f"{what}: {shares}"  # 8 experts, half each
        n_layers, n_moe = SHAPE[run["arch"]]
        for res in results:
            got = res["runs"][i]
            assert got["stage"]["split"] == "experts" and got["stage"]["layers"] == [0, n_layers]
            assert got["tokens"] == toks, f"{what}: rank {res['rank']} tokens differ"
            got_lps = np.array(got["logprobs"])
            worst = max(worst, float((np.abs(got_lps - lps) / (1 + np.abs(lps))).max()))
            np.testing.assert_allclose(
                got_lps, lps, rtol=LOGPROB_RTOL, atol=LOGPROB_ATOL, err_msg=f"{what}: {res['rank']}"
            )
            # one all_sum of the hidden state per MoE layer per token: a 2-rank ring sends
            # the whole block once (float32 or float16 activations)
            moe = got["stage"]["moe_layers"]
            per = got["bytes_sent"] / ((len(PROMPT) + GEN) * HIDDEN * moe)
            assert moe == n_moe and per in (2, 4), f"{what}: rank {res['rank']} sent {per}"
            if run.get("expert_budget"):  # its own half of the records, its own budget
                pager = got["pager"]
                assert pager["budget_bytes"] == run["expert_budget"]
                assert pager["mode"] == "paged", f"{what}: rank {res['rank']} holds its half"
                assert pager["experts"] == 4 * n_moe, f"{what}: pages {pager['experts']}"
            else:  # dense weights replicated, half the experts: less than the whole model
                assert got["weight_bytes"] < weights, f"{what}: rank {res['rank']} holds all"
    print(f"largest log-probability difference, relative to 1 + |log-prob|: {worst:.2e}")


class _Group:
    """Rank and size only: loading touches no transfer."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_a_rank_loads_only_its_share_of_the_experts(tiny_model_path):
    folder = tiny_model_path("qwen3_moe")
    full = load_converted(folder).model
    lm = load_stage(folder, _Group(1, 2), split="experts")
    stage = lm.model.rq_stage
    assert isinstance(stage, ExpertStage) and stage.to_dict()["experts"] == [4, 8]
    for i, layer in enumerate(layer_list(lm.model)):
        sw = layer.mlp.switch_mlp
        assert isinstance(sw, LocalExperts) and (sw._lo, sw._hi) == (4, 8)
        assert layer.mlp.sharding_group is not None  # mlx-lm's hook all_sums the block
        mine = sw.inner.gate_proj.weight
        whole = layer_list(full)[i].mlp.switch_mlp.gate_proj.weight
        assert mine.shape[0] == 4 and mx.array_equal(mine, whole[4:8]).item()
        # the attention is replicated, whole
        assert mx.array_equal(
            layer.self_attn.q_proj.weight, layer_list(full)[i].self_attn.q_proj.weight
        ).item()


def test_expert_ranges_and_the_refused_models(tiny_model_path):
    assert expert_ranges(8, 2) == [(0, 4), (4, 8)]
    assert expert_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError):
        expert_ranges(2, 3)
    # nemotron_h's MoE block has a shared expert and no sharding hook: rank 0 adds the
    # shared expert, the other ranks' shared expert is zeros, every rank sums the block
    for rank in (0, 1):
        model = load_stage(tiny_model_path("nemotron_h"), _Group(rank, 2), split="experts").model
        blocks = [x.mixer for x in layer_list(model) if hasattr(x.mixer, "switch_mlp")]
        assert len(blocks) == 3
        for block in blocks:
            assert isinstance(block.switch_mlp, LocalExperts) and block.rq_group is not None
            x = mx.ones((1, 2, HIDDEN))
            shared = block.shared_experts(x)
            assert shared.shape == x.shape and (mx.abs(shared).sum().item() == 0) == (rank == 1)
    with pytest.raises(EngineError, match="unknown split"):
        load_stage(tiny_model_path("qwen3_moe"), _Group(0, 2), split="tensors")


def _moe_blocks(model) -> list:
    return [x.mlp for x in layer_list(model) if hasattr(x.mlp, "switch_mlp")]


@pytest.mark.parametrize(
    ("arch", "shared"), [("qwen3_next", "shared_expert"), ("deepseek_v3", "shared_experts")]
)
def test_the_ranks_moe_blocks_add_up_to_the_whole_block(models, arch, shared):
    """Each rank's block (its half of the routed experts, the shared expert on rank 0 only) in
    one process: the two outputs sum to the whole block's. Neither alone is the whole (routing
    reaches both halves), nor is the sum with rank 1's shared expert left on."""
    folder = models[arch][0]
    whole = _moe_blocks(load_converted(folder).model)
    assert len(whole) == SHAPE[arch][1]
    alone = mx.distributed.init()  # this process only: its all_sum returns its input
    ranks = []
    for rank in (0, 1):
        blocks = _moe_blocks(load_stage(folder, _Group(rank, 2), split="experts").model)
        for b in blocks:
            sw = b.switch_mlp
            assert isinstance(sw, LocalExperts) and (sw._lo, sw._hi) == (4 * rank, 4 * rank + 4)
            # mlx-lm's hook sums the block: no subclass around it
            assert b.sharding_group is not None and "rq_group" not in vars(b)
            b.sharding_group = alone
        ranks.append(blocks)
    x = 2.0 * mx.random.normal((1, 16, HIDDEN), key=mx.random.key(5))
    for i, block in enumerate(whole):
        want = np.array(block(x))
        parts = [np.array(blocks[i](x)) for blocks in ranks]
        tol = LOGPROB_ATOL * np.abs(want).max()
        np.testing.assert_allclose(parts[0] + parts[1], want, rtol=0, atol=tol)
        for part in parts:
            assert np.abs(part - want).max() > 100 * tol, f"layer {i}: one rank gave it all"
        # rank 1's shared expert answers zeros; left on, it would be added twice
        b1 = ranks[1][i]
        assert not np.abs(np.array(getattr(b1, shared)(x))).any()
        getattr(b1, shared).__class__ = type(getattr(b1, shared)).__mro__[1]
        doubled = parts[0] + np.array(b1(x))
        assert np.abs(doubled - want).max() > 100 * tol, f"layer {i}: shared expert twice"


@pytest.mark.slow
def test_killed_rank_is_named_within_10s_under_the_expert_split(models, tmp_path):
    folder, _, _ = models["gpt_oss"]
    kill_mid_generation(tmp_path, folder, ["mac-a", "mac-b"], split="experts")


# --- planning and choosing the split ---------------------------------------------------------

GPT_OSS = str(Path(__file__).parent / "data" / "configs" / "gpt-oss-120b.json")
SUPER = str(Path(__file__).parent / "data" / "configs" / "nemotron-3-super-120b-a12b.json")
NEXT = str(Path(__file__).parent / "data" / "configs" / "qwen3-next-80b-a3b.json")
GEMMA = str(Path(__file__).parent / "data" / "configs" / "gemma-4-26b-a4b-it.json")


def _hosts(n=2, ram="32GB", link="thunderbolt5", **extra):
    from app.engine.distributed.hosts import parse_hosts

    hosts = [{"ssh": f"mac-{i}.local", "ram": ram, "name": f"mac-{i}"} for i in range(n)]
    return parse_hosts({"backend": "ring", "link": link, "hosts": hosts, **extra})


def test_planner_keeps_the_pipeline_over_tcp_and_says_why():
    from app.engine.distributed.plan import plan_hosts

    auto = plan_hosts(GPT_OSS, _hosts())  # 2 x 32 GB over TCP on Thunderbolt (300 us)
    exp = plan_hosts(GPT_OSS, _hosts(), split="experts")
    assert auto.kind == "pipeline" and exp.kind == "experts" and exp.split == "experts"
    assert exp.tok_s < auto.tok_s
    assert any("pipeline chosen over the expert split" in r for r in auto.reasons)
    # one all_sum per MoE layer (all 36), a 2-rank ring's 2 messages each
    assert exp.extra["all_sums_per_token"] == 36 and exp.extra["messages_per_token"] == 72
    assert exp.link_seconds_per_token > 36 * 2 * 300e-6
    # every rank holds every layer and half of each layer's 128 experts
    assert [s.experts for s in exp.stages] == [(0, 64), (64, 128)]
    assert all(s.layers == (0, 36) for s in exp.stages)
    assert sum(s.expert_bytes for s in exp.stages) == pytest.approx(
        exp.extra["expert_bytes"], rel=1e-6
    )
    assert exp.to_dict()["split"] == "experts" and exp.to_dict()["stages"][1]["experts"] == [
        64,
        128,
    ]


def test_planner_picks_experts_on_a_fast_link_or_where_the_ranks_page():
    from app.engine.distributed.plan import plan_hosts

    fast = plan_hosts(GPT_OSS, _hosts(link={"gbps": 80, "latency_us": 3}))
    assert fast.kind == "experts" and not fast.paging
    assert any("expert split chosen" in r for r in fast.reasons)
    # 2 x 16 GB: both splits page; an expert split's ranks read their SSDs side by side
    small = plan_hosts(GPT_OSS, _hosts(ram="16GB"))
    pipe = plan_hosts(GPT_OSS, _hosts(ram="16GB"), split="pipeline")
    assert small.kind == "experts" and small.paging and pipe.paging
    assert small.tok_s > pipe.tok_s
    assert max(s.miss_per_token for s in small.stages) < sum(s.miss_per_token for s in pipe.stages)
    # hosts.json's `split` chooses as --split does
    assert plan_hosts(GPT_OSS, _hosts(split="experts")).kind == "experts"
    assert plan_hosts(GPT_OSS, _hosts(ram="16GB", split="pipeline")).kind == "pipeline"


def test_planner_plans_super_by_experts_on_request_and_refuses_unbuilt_models():
    from app.engine.distributed.plan import plan_hosts
    from app.engine.planner import PlanRefused

    assert plan_hosts(SUPER, _hosts(), split="experts").kind == "experts"
    auto = plan_hosts(SUPER, _hosts())  # 40 all_sums a token over TB5: the pipeline wins
    assert auto.kind == "pipeline" and any(
        "pipeline chosen over the expert" in r for r in auto.reasons
    )
    with pytest.raises(PlanRefused, match="gemma4: the expert split is built for"):
        plan_hosts(GEMMA, _hosts(), split="experts")
    auto = plan_hosts(GEMMA, _hosts())
    assert auto.kind == "pipeline" and any(
        "expert split not chosen: gemma4" in r for r in auto.reasons
    )
    with pytest.raises(ValueError, match="split"):
        _hosts(split="tensor")


def test_planner_splits_qwen3_next_and_deepseek_v3_by_experts(tmp_path):
    from test_sizes import DEEPSEEK_V3

    from app.engine.distributed.plan import plan_hosts

    # Qwen3-Next-80B: 48 MoE layers of 512 experts (the Gated DeltaNet state on every rank)
    nxt = plan_hosts(NEXT, _hosts(), split="experts")
    assert nxt.kind == "experts" and [s.experts for s in nxt.stages] == [(0, 256), (256, 512)]
    assert all(s.layers == (0, 48) for s in nxt.stages)
    assert nxt.extra["all_sums_per_token"] == 48 and nxt.extra["messages_per_token"] == 96
    auto = plan_hosts(NEXT, _hosts())  # 48 all_sums over TCP: the pipeline is faster
    assert auto.kind == "pipeline" and auto.tok_s > nxt.tok_s
    assert any("pipeline chosen over the expert split" in r for r in auto.reasons)
    fast = plan_hosts(NEXT, _hosts(link={"gbps": 80, "latency_us": 3}))
    assert fast.kind == "experts"
    # DeepSeek-V3 (671B) on two 512 GB machines: 61 layers, the first 3 dense, 58 all_sums
    path = tmp_path / "deepseek-v3.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    ds = plan_hosts(str(path), _hosts(ram="512GB"), split="experts")
    assert ds.kind == "experts" and [s.experts for s in ds.stages] == [(0, 128), (128, 256)]
    assert ds.extra["all_sums_per_token"] == 58 and ds.extra["messages_per_token"] == 116
    assert all(s.layers == (0, 61) for s in ds.stages)
    assert sum(s.expert_bytes for s in ds.stages) == pytest.approx(
        ds.extra["expert_bytes"], rel=1e-6
    )


def test_cli_passes_the_split_to_the_ranks(tmp_path, capsys):
    from types import SimpleNamespace

    from app.cli import main
    from app.engine.distributed.commands import _planned, rank_args, serve_rank_args

    path = tmp_path / "hosts.json"
    hosts = {"backend": "ring", "hosts": [{"ssh": f"m{i}", "ram": "32GB"} for i in range(2)]}
    path.write_text(json.dumps(hosts))
    assert main(["plan", GPT_OSS, "--hosts", str(path), "--split", "experts", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["split"] == "experts" and d["split_kind"] == "experts"
    from app.engine.plan_jobs import MachinesPlan  # the app's Start over these machines

    assert MachinesPlan("m", str(path), (), d).start_options()["split"] == "experts"
    assert main(["plan", GPT_OSS, "--hosts", str(path), "--split", "experts"]) == 0
    assert "experts 64-127 of each MoE layer" in capsys.readouterr().out
    assert main(["plan", NEXT, "--hosts", str(path), "--split", "experts"]) == 0
    assert "experts 256-511 of each MoE layer" in capsys.readouterr().out
    args = SimpleNamespace(model="m", hosts=str(path), max_tokens=4, temp=0.0, kv_mode="fp16")
    args.seed = None
    argv = rank_args(args, "experts", None)
    assert argv[argv.index("--split") + 1] == "experts"
    argv = serve_rank_args("m", str(path), host="127.0.0.1", port=1, split="experts")
    assert argv[argv.index("--split") + 1] == "experts"
    # without --plan: the chosen split, every expert resident
    from app.engine.distributed.hosts import load_hosts

    assert _planned("m", load_hosts(path), False, "experts") == ("experts", None, "fp16")
    assert _planned("m", load_hosts(path), False, None) == (None, None, "fp16")


def test_a_share_of_the_records_reads_the_same_experts(models):
    folder, _, _ = models["gpt_oss"]
    from app.engine.distributed.experts import share_section
    from app.engine.manifest import Manifest

    section = Manifest.load(folder).experts
    layers = [int(k) for k in section["layers"]]
    mine = share_section(section, dict.fromkeys(layers, (5, 8)))
    with ExpertStore(folder) as whole, ExpertStore(folder, mine) as part:
        for layer in layers:
            assert part.layout(layer).num_experts == 3
            got = part.read_layer(layer, verify=True)  # the share's checksums are its own
            want = whole.read_layer(layer)
            for name, arr in got.items():
                assert mx.array_equal(arr, want[name][5:8]).item()
        with pytest.raises(Exception, match="out of range"):
            part.read(layers[0], 3)
