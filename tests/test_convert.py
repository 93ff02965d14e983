"""Converter: HF / mlx checkpoints -> role-quantized folder + expert records.

Every tiny architecture goes mlx folder -> Hugging Face layout (per-expert or fused tensors,
2+ shards) -> convert -> load; the logits must equal those of the same model quantized in
memory by `nn.quantize` with the same role predicate, bit for bit, and every expert record
must equal the in-memory quantized expert.
"""

import json
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import load_model

from app.engine.errors import ModelLoadError, UnsupportedArchitectureError
from app.engine.loader import load
from app.engine.manifest import Manifest
from app.engine.offload.records import ExpertRecordError, ExpertStore
from app.engine.quant.convert import ConvertError, ConvertProgress, convert
from app.engine.quant.converted import is_converted
from app.engine.quant.hf_layout import to_hf_layout
from app.engine.quant.roles import expert_container, module_role, role_predicate, rules_for
from app.engine.quant.widths import RoleWidths
from app.engine.testing.random_models import TINY_CONFIGS, make_random_model
from app.engine.testing.tiny import EXTRA_TINY_CONFIGS

ARCHS = [
    "qwen3_moe",
    "qwen2_moe",
    "nemotron_h",
    "gemma4_text",
    "gpt_oss",
    "llama",
    "mixtral",
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5_moe",
    "nemotron_h_latent",
]
TOKENS = mx.array([[1, 17, 300, 42, 999, 5, 64, 128, 7, 250, 3]])


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path / "home"))


def _config(arch):
    return EXTRA_TINY_CONFIGS.get(arch) or dict(TINY_CONFIGS[arch])


def _hf(tmp_path, arch, dtype="float32", seed=3, **kw):
    mlx_dir = make_random_model(_config(arch), tmp_path / f"{arch}-mlx", seed=seed, dtype=dtype)
    return mlx_dir, to_hf_layout(mlx_dir, tmp_path / f"{arch}-hf", shards=3, **kw)


def _dequantize_switch(model):
    """mlx-lm loads gpt_oss's MXFP4 experts quantized; the converter dequantizes them (to the
    bias dtype) before role quantization, and so does the reference."""
    new = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedSwitchLinear):
            w = mx.dequantize(
                m.weight, m.scales, m.biases, m.group_size, m.bits, m.mode, dtype=m.bias.dtype
            )
            s = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias=True)
            s.weight, s.bias = w, m.bias
            new.append((name, s))
    if new:
        model.update_modules(tree_unflatten(new))


def _reference(folder, arch, widths=None):
    """The model of `folder` loaded by mlx-lm and quantized in memory with the role predicate."""
    ref, _ = load_model(folder)
    _dequantize_switch(ref)
    nn.quantize(ref, class_predicate=role_predicate(arch, widths))
    return ref


def _assert_records_match(out, ref):
    params = dict(tree_flatten(ref.parameters()))
    man = Manifest.load(out)
    with ExpertStore(out) as store:
        assert store.layers, "a MoE model must have expert records"
        for layer in store.layers:
            lay = store.layout(layer)
            for e in range(lay.num_experts):
                store.verify(layer, e)
                rec = store.read(layer, e)
                for name, arr in rec.items():
                    want = params[f"{lay.module}.{name}"][e]
                    assert arr.dtype == want.dtype and mx.array_equal(arr, want).item(), (
                        layer,
                        e,
                        name,
                    )
    assert man.experts["layers"]


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_checkpoint_converts_bit_exact(tmp_path, arch):
    model_type = _config(arch)["model_type"]
    _, hf = _hf(tmp_path, arch)
    assert len(list(hf.glob("model-*.safetensors"))) >= 2
    out = tmp_path / f"{arch}-rq"
    man = convert(hf, out, chunk_bytes=8192)  # several row blocks per dense tensor
    ref = _reference(hf, model_type)
    lm = load(out, verify=True)
    assert mx.array_equal(lm.model(TOKENS), ref(TOKENS)).item()

    rules = rules_for(model_type)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    # routed experts live only in the records
    assert not any(expert_container(rules, k.rpartition(".")[0]) for k in index)
    n_params = sum(
        v.size for _, v in tree_flatten(load_model(hf)[0].parameters()) if v.dtype != mx.uint32
    )
    if arch != "gpt_oss":  # gpt_oss's reference holds MXFP4-packed experts here
        assert sum(r["params"] for r in man.roles.values()) == n_params
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and "quantization_config" in cfg
    if rules.has_experts:
        assert is_converted(out)
        _assert_records_match(out, ref)
        assert man.roles["routed"]["bits"] == 2 and man.roles["routed"]["params"] > 0
        assert man.roles["routed"]["kurtosis"] is not None
    else:
        assert man.experts is None and not (out / "experts").exists()
    for r in ("dense", "keep_float"):
        assert man.roles[r]["params"] > 0 and man.roles[r]["bytes"] > 0


def test_mlx_layout_and_widths_override(tmp_path):
    mlx_dir = make_random_model("qwen2_moe", tmp_path / "mlx", seed=5, dtype="bfloat16")
    widths = RoleWidths.parse("routed=3,shared=float,dense=8/32")
    man = convert(mlx_dir, tmp_path / "out", widths="routed=3,shared=float,dense=8/32")
    assert man.roles["routed"]["bits"] == 3 and man.roles["shared"]["bits"] is None
    ref = _reference(mlx_dir, "qwen2_moe", widths)
    lm = load(tmp_path / "out")
    assert mx.array_equal(lm.model(TOKENS), ref(TOKENS)).item()
    _assert_records_match(tmp_path / "out", ref)
    assert lm.model.model.layers[0].mlp.shared_expert.up_proj.weight.dtype == mx.bfloat16


def test_gpt_oss_bf16_export(tmp_path):
    """transformers' BF16 gpt-oss export: fused gate_up [E, H, 2I] in x @ W orientation."""
    mlx_dir, hf = _hf(tmp_path, "gpt_oss", gpt_oss_format="bf16")
    convert(hf, tmp_path / "out")
    ref = _reference(mlx_dir, "gpt_oss")
    assert mx.array_equal(load(tmp_path / "out").model(TOKENS), ref(TOKENS)).item()


def test_already_quantized_mlx_folder(tmp_path):
    """An mlx-community-style 4-bit folder: roles at 4 bits are copied as they are, routers go
    back to float, routed experts at 2 bits are re-quantized from the dequantized weights."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    mlx_dir = make_random_model("qwen3_moe", tmp_path / "mlx", seed=7, dtype="bfloat16")
    model, config = load_model(mlx_dir)
    model, config = quantize_model(model, config, 64, 4)
    q_dir = tmp_path / "q4"
    shutil.copytree(mlx_dir, q_dir)
    for f in q_dir.glob("model*.safetensors"):
        f.unlink()
    save_model(q_dir, model)
    save_config(config, q_dir / "config.json")

    # same bits as the source (any group): kept; other bits: re-quantized from the dequantized
    for spec in ("routed=4,shared=4,dense=4/32", "routed=2,dense=8/32"):
        widths = RoleWidths.parse(spec)
        out = tmp_path / f"out-{spec}"
        man = convert(q_dir, out, widths=widths, chunk_bytes=4096)  # many row blocks
        ref, _ = load_model(q_dir)  # same per-role rule, applied to the quantized source
        new = []
        rules = rules_for("qwen3_moe")
        for name, m in ref.named_modules():
            if not hasattr(m, "scales"):
                continue
            w = widths[module_role(rules, name)]
            if w.bits == m.bits:
                continue
            dq = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
            if isinstance(m, QuantizedSwitchLinear):
                f = SwitchLinear(dq.shape[2], dq.shape[1], dq.shape[0], bias=False)
            elif isinstance(m, nn.QuantizedEmbedding):
                f = nn.Embedding(*dq.shape)
            else:
                f = nn.Linear(dq.shape[1], dq.shape[0], bias=False)
            f.weight = dq
            new.append((name, f.to_quantized(w.group_size, w.bits) if w.bits else f))
        ref.update_modules(tree_unflatten(new))
        lm = load(out)
        assert mx.array_equal(lm.model(TOKENS), ref(TOKENS)).item(), spec
        assert isinstance(lm.model.model.layers[0].mlp.gate, nn.Linear)  # router back to float
        assert ("model.embed_tokens.weight" in man.extra["requantized"]) == ("dense=8" in spec)


def test_progress_and_interrupt_leave_no_output(tmp_path):
    _, hf = _hf(tmp_path, "qwen3_moe")
    out = tmp_path / "out"
    seen = []

    def stop_midway(p: ConvertProgress):
        seen.append(p)
        if p.stage == "experts" and len(seen) > 40:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(hf, out, progress=stop_midway)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.rq-partial-*"))
    # a killed run's leftovers (pid that no longer exists) are cleared by the next run
    stale = tmp_path / ".out.rq-partial-999999999"
    stale.mkdir()
    seen.clear()
    convert(hf, out, progress=seen.append)
    assert not stale.exists() and out.exists()
    dones = [p.done for p in seen]
    assert dones == sorted(dones) and dones[-1] == seen[-1].total and seen[-1].stage == "finish"
    with pytest.raises(ConvertError, match="destination exists"):
        convert(hf, out)
    convert(hf, out, overwrite=True)
    assert load(out).model is not None


def test_not_enough_disk(tmp_path, monkeypatch):
    _, hf = _hf(tmp_path, "qwen3_moe")
    import app.engine.quant.convert as conv

    monkeypatch.setattr(
        conv.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)
    )
    with pytest.raises(ConvertError, match="not enough free disk"):
        convert(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_shard(tmp_path):
    _, hf = _hf(tmp_path, "qwen3_moe")
    (hf / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weight shard model-00002-of-00003"):
        convert(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_tensor(tmp_path):
    _, hf = _hf(tmp_path, "qwen3_moe")
    shard = hf / "model-00003-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 7)
    with pytest.raises(ModelLoadError, match="truncated") as e:
        convert(hf, tmp_path / "out")
    assert "model-00003-of-00003" in str(e.value)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"moe_intermediate_size": 32}, "does not match the weights"),
        ({"num_experts": 16}, "16 experts but the checkpoint lacks expert 8"),
        ({"num_experts": 4}, "4 experts but the checkpoint has expert 4"),
        ({"hidden_size": 256}, "does not match the weights"),
        ({"num_hidden_layers": 3}, "no MoE layer in config.json|unexpected tensor"),
    ],
)
def test_config_mismatch(tmp_path, change, match):
    _, hf = _hf(tmp_path, "qwen3_moe")
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(change)
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        convert(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_folders(tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder"):
        convert(tmp_path / "nope", tmp_path / "out")
    _, hf = _hf(tmp_path, "qwen3_moe")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon_mamba"}))
    with pytest.raises(UnsupportedArchitectureError, match="no role rules for architecture"):
        convert(hf, tmp_path / "out")
    (hf / "config.json").write_text(json.dumps(cfg))
    convert(hf, tmp_path / "out")
    with pytest.raises(ModelLoadError, match="already converted"):
        convert(tmp_path / "out", tmp_path / "again")
    (hf / "tokenizer.json").unlink()
    (hf / "tokenizer_config.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        convert(hf, tmp_path / "out")


def test_corrupt_record_is_reported_on_load(tmp_path):
    _, hf = _hf(tmp_path, "qwen3_moe")
    out = tmp_path / "out"
    man = convert(hf, out)
    lay = man.experts["layers"]["2"]
    with open(out / lay["file"], "r+b") as f:
        f.seek(lay["data_offset"] + 5 * lay["stride"] + 3)
        f.write(b"\xaa\x55")
    with pytest.raises(ExpertRecordError, match="layer 2, expert 5: checksum mismatch"):
        load(out, verify=True)


def test_destination_holding_the_source_is_refused(tmp_path):
    _, hf = _hf(tmp_path, "qwen3_moe")
    before = sorted(p.name for p in hf.iterdir())
    for dst in (hf.parent, hf, hf / "inner"):
        with pytest.raises(ConvertError, match="must not contain one another"):
            convert(hf, dst, overwrite=True)
    assert sorted(p.name for p in hf.iterdir()) == before


def test_one_conversion_per_destination(tmp_path):
    from app.engine.fsutil import exclusive

    _, hf = _hf(tmp_path, "qwen3_moe")
    out = tmp_path / "out"
    with exclusive(out):  # as a conversion running in another process holds it
        with pytest.raises(ConvertError, match="another conversion to it is running"):
            convert(hf, out)
    assert not out.exists()
    convert(hf, out)
    assert is_converted(out) and not list(tmp_path.glob(".out.*"))


def test_kill_between_the_overwrite_renames_is_mended(tmp_path):
    """kill -9 after the old model was moved aside and before the new one took its place:
    the next run puts the old model back (then refuses, or replaces it with overwrite)."""
    import subprocess
    import sys

    _, hf = _hf(tmp_path, "qwen3_moe")
    out = tmp_path / "out"
    convert(hf, out, widths="routed=4")
    kill_at_second_rename = (
        "import os, signal, sys\n"
        "real = os.replace\n"
        "def replace(a, b):\n"
        "    if os.path.basename(a).startswith('.out.rq-partial-'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    real(a, b)\n"
        "os.replace = replace\n"
        "from app.engine.quant.convert import convert\n"
        "convert(sys.argv[1], sys.argv[2], overwrite=True)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", kill_at_second_rename, str(hf), str(out)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert r.returncode == -9
    assert not out.exists() and list(tmp_path.glob(".out.rq-old-*"))
    with pytest.raises(ConvertError, match="destination exists"):
        convert(hf, out)
    assert Manifest.load(out).roles["routed"]["bits"] == 4  # the old model, back in place
    assert not list(tmp_path.glob(".out.*"))
    convert(hf, out, overwrite=True)
    assert Manifest.load(out).roles["routed"]["bits"] == 2
