"""Random models written straight into the converted format (the pager benchmarks' models):
they load resident and paged through the engine's paths, and an interrupted write leaves
nothing behind."""

import pytest

from app.engine.loader import load
from app.engine.manifest import Manifest
from app.engine.offload import load_paged
from app.engine.testing.random_models import TINY_CONFIGS
from app.engine.testing.synth import write_random_converted


@pytest.mark.parametrize("arch", ["qwen3_moe", "nemotron_h"])
def test_synthesized_model_loads_resident_and_paged(tmp_path, arch):
    import mlx.core as mx

    man = write_random_converted(TINY_CONFIGS[arch], tmp_path / arch, seed=3, dtype="float32")
    assert man.experts and Manifest.load(tmp_path / arch).experts == man.experts
    ids = mx.array([[1, 5, 9, 42, 7, 3]])
    full = load(tmp_path / arch).model(ids)
    expert_bytes = man.roles["routed"]["bytes"]
    paged = load_paged(tmp_path / arch, expert_bytes // 2).model(ids)
    assert mx.array_equal(full, paged).item()
    assert not mx.isnan(full).any().item()


def test_interrupted_write_leaves_no_folder(tmp_path):
    def boom(item, done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_random_converted(TINY_CONFIGS["qwen3_moe"], tmp_path / "m", progress=boom)
    assert list(tmp_path.iterdir()) == []
