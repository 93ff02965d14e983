"""Expert parallelism over mx.distributed: 2 local ranks (mlx.launch, ring backend over loopback),
every rank running every layer with half of each MoE layer's routed experts, give the single
process's greedy tokens and its log-probabilities within float rounding (the all_sum adds the
two ranks' partial outputs, a different summation order than one process's).

Tiny qwen3_moe, gpt_oss and nemotron_h (random weights at scale 0.5, converted: 2-bit experts), fp16 and
isoquant3 caches, experts resident and paged (each rank pages its own half within its own
budget), and a plain mlx-lm folder (the stacked experts sliced at load): thirteen runs in one launch.
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

ARCHS = ["qwen3_moe", "gpt_oss", "nemotron_h"]
# (layers, MoE layers) of each tiny model: nemotron_h is "ME*EME", with a shared expert
SHAPE = {"qwen3_moe": (4, 4), "gpt_oss": (4, 4), "nemotron_h": (6, 3)}
KV_MODES = ["fp16", "isoquant3"]
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
        src = make_random_model(TINY_CONFIGS[arch], root / f"{arch}-src", seed=11, scale=0.5)
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
        toks, lps = run_greedy(model, PROMPT, kv.make_cache(model, mode), GEN)
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


@pytest.mark.slow
def test_killed_rank_is_named_within_10s_under_the_expert_split(models, tmp_path):
    folder, _, _ = models["gpt_oss"]
    kill_mid_generation(tmp_path, folder, ["mac-a", "mac-b"], split="experts")


# --- planning and choosing the split ---------------------------------------------------------

GPT_OSS = str(Path(__file__).parent / "data" / "configs" / "gpt-oss-120b.json")
SUPER = str(Path(__file__).parent / "data" / "configs" / "nemotron-3-super-120b-a12b.json")


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
    with pytest.raises(PlanRefused, match="qwen3_next: the expert split is built for"):
        plan_hosts(
            str(Path(__file__).parent / "data" / "configs" / "qwen3-next-80b-a3b.json"),
            _hosts(),
            split="experts",
        )
    with pytest.raises(ValueError, match="split"):
        _hosts(split="tensor")


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
