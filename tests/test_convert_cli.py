"""`rotaryquant convert` / `inspect` through the app's CLI."""

import json

import pytest

from app.cli import main
from app.engine.testing.random_models import make_random_model


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path / "home"))


def test_convert_and_inspect(tmp_path, capsys):
    src = make_random_model("qwen2_moe", tmp_path / "src", seed=1, dtype="bfloat16")
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--bits", "routed=3,shared=8", "-q"]) == 0
    out = capsys.readouterr().out
    assert "routed" in out and "experts: 4 MoE layers x 8 records" in out
    assert main(["inspect", str(dst), "--json", "--verify"]) == 0
    roles = json.loads(capsys.readouterr().out)["roles"]
    assert roles["routed"]["bits"] == 3 and roles["shared"]["bits"] == 8
    assert roles["keep_float"]["bits"] is None

    assert main(["convert", str(src), str(dst), "-q"]) == 1  # exists
    assert "destination exists" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "x"), "--bits", "experts=2"]) == 2
    assert "unknown role" in capsys.readouterr().err

    layer = json.loads((dst / "rotaryquant.json").read_text())["experts"]["layers"]["1"]
    with open(dst / layer["file"], "r+b") as f:
        f.seek(layer["data_offset"] + 2 * layer["stride"])
        f.write(b"\x00\x01\x02\x03")
    assert main(["inspect", str(dst), "--verify"]) == 1
    assert "layer 1, expert 2: checksum mismatch" in capsys.readouterr().err
    assert main(["inspect", str(src.parent / "nope")]) == 1
