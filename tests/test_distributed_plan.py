"""Planning over several machines: Nemotron 3 Super on 2 x 32 GB is resident, on 1 x 32 GB paged;
hosts.json is mlx.launch's hostfile with keys it ignores."""

import gc
import json
import warnings
from pathlib import Path

import pytest

from app.cli import main
from app.engine.distributed.hosts import load_hosts, parse_hosts
from app.engine.distributed.launch import launch_argv
from app.engine.distributed.plan import LINKS, host_specs, plan_hosts, single_host_tok_s
from app.engine.errors import EngineError
from app.engine.planner import GiB, Machine, PlanRefused, make_plan
from app.engine.sizes import sizes_for

SUPER = str(Path(__file__).parent / "data" / "configs" / "nemotron-3-super-120b-a12b.json")


def _hosts(tmp_path, n, ram="32GB", backend="ring", link="thunderbolt5"):
    path = tmp_path / "hosts.json"
    path.write_text(
        json.dumps(
            {
                "backend": backend,
                "link": link,
                "hosts": [
                    {
                        "ssh": f"mac-{i}.local",
                        "ips": [f"10.0.0.{i + 1}"],
                        "ram": ram,
                        "name": f"mac-{i}",
                    }
                    for i in range(n)
                ],
            }
        )
    )
    return path


def test_super_on_two_32gb_macs_is_resident(tmp_path):
    plan = plan_hosts(SUPER, load_hosts(_hosts(tmp_path, 2)))
    s = sizes_for(SUPER)
    assert sum(plan.split) == s.layers == 88
    assert not plan.paging
    for st in plan.stages:
        assert st.expert_budget == st.expert_bytes > 10 * GiB
        assert st.peak <= st.usable <= 32 * GiB
        assert st.miss_per_token == 0
    assert sum(st.expert_bytes for st in plan.stages) == s.expert_bytes
    # the hidden state crosses once per rank per step: 2 (N-1) messages of one token's state
    assert plan.link_bytes_per_token == 2 * s.hidden_size * s.float_bytes
    assert any("all its experts resident" in r for r in plan.reasons)
    assert 5 < plan.tok_s < 200


def test_super_on_one_32gb_mac_pages(tmp_path):
    plan = plan_hosts(SUPER, load_hosts(_hosts(tmp_path, 1)))
    assert plan.paging and plan.split == [88]
    st = plan.stages[0]
    ref = make_plan(sizes_for(SUPER), Machine.simulate(32 * GiB, "metal"))
    assert ref.paging
    # all the memory left for experts: at least what the single-machine planner keeps (it stops
    # where more resident experts no longer buy 1% of speed), within its rounding of the parts
    assert st.expert_budget >= 0.95 * ref.expert_budget
    assert 0.40 < st.expert_budget / st.expert_bytes < 0.55  # README: 46% of experts resident
    assert st.miss_per_token > 0
    two = plan_hosts(SUPER, load_hosts(_hosts(tmp_path, 2)))
    assert two.tok_s > 2 * plan.tok_s
    tps, detail = single_host_tok_s(SUPER, host_specs(load_hosts(_hosts(tmp_path, 1)))[0])
    assert tps == pytest.approx(plan.tok_s, rel=0.05) and detail["plan"]["paging"]


def test_rdma_link_is_faster_than_tcp(tmp_path):
    ring = plan_hosts(SUPER, load_hosts(_hosts(tmp_path, 2, backend="ring")))
    rdma = plan_hosts(SUPER, load_hosts(_hosts(tmp_path, 2, backend="jaccl")))
    assert rdma.link.name == "thunderbolt5-rdma" and ring.link.name == "thunderbolt5"
    assert rdma.link_seconds_per_token < ring.link_seconds_per_token
    assert rdma.tok_s > ring.tok_s
    assert LINKS["thunderbolt5"].latency_us > LINKS["thunderbolt5-rdma"].latency_us


def test_too_small_machines_are_refused_with_numbers(tmp_path):
    with pytest.raises(PlanRefused, match="does not fit on these 2 machines"):
        plan_hosts(SUPER, load_hosts(_hosts(tmp_path, 2, ram="8GB")))


def test_host_without_ram_needs_ram(tmp_path):
    p = tmp_path / "hosts.json"
    p.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]))
    with pytest.raises(PlanRefused, match="no `ram`"):
        plan_hosts(SUPER, load_hosts(p))
    assert not plan_hosts(SUPER, load_hosts(p), ram="32GB").paging


def test_bad_hosts_files_say_what_is_wrong(tmp_path):
    p = tmp_path / "hosts.json"
    p.write_text("{not json")
    with pytest.raises(EngineError, match="not a valid hosts file"):
        load_hosts(p)
    with pytest.raises(EngineError, match="cannot read"):
        load_hosts(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="ssh"):
        parse_hosts({"hosts": [{"ips": ["1.2.3.4"]}]})


def test_hosts_file_is_mlx_launch_hostfile(tmp_path):
    from mlx._distributed_utils.common import Hostfile

    path = _hosts(tmp_path, 2, backend="jaccl")
    with warnings.catch_warnings():  # mlx's parser leaves the file to the garbage collector
        warnings.simplefilter("ignore", ResourceWarning)
        hf = Hostfile.from_file(str(path))
        gc.collect()
    assert [h.ssh_hostname for h in hf.hosts] == ["mac-0.local", "mac-1.local"]
    assert [h.ips for h in hf.hosts] == [["10.0.0.1"], ["10.0.0.2"]]
    assert hf.backend == "jaccl"
    argv = launch_argv(["m", "--chat"], hostfile=str(path), backend="jaccl")
    assert argv[argv.index("--hostfile") + 1] == str(path)
    assert argv[-4:] == ["-m", "app.engine.distributed.rank", "m", "--chat"]
    assert argv[argv.index("--backend") + 1] == "jaccl"


def test_plan_command_with_hosts(tmp_path, capsys):
    assert main(["plan", SUPER, "--hosts", str(_hosts(tmp_path, 2))]) == 0
    out = capsys.readouterr().out
    assert "over 2 machines" in out and "resident" in out and "tok/s" in out
    assert main(["plan", SUPER, "--hosts", str(_hosts(tmp_path, 1)), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["paging"] and d["ranks"] == 1 and d["stages"][0]["paging"]
