"""Expert record files: write, read back bit-exactly with one positioned read, verify."""

import os

import mlx.core as mx
import numpy as np
import pytest

from app.engine.offload.records import (
    ALIGNMENT,
    ExpertRecordError,
    ExpertStore,
    LayerLayout,
    LayerWriter,
    experts_section,
)


def _layout(layer=3, E=5, bits=2, H=128, inter=64, dtype="bfloat16"):
    g = 64
    t = []
    for proj, (o, i) in (
        ("gate_proj", (inter, H)),
        ("up_proj", (inter, H)),
        ("down_proj", (H, inter)),
    ):
        t += [
            (f"{proj}.weight", "uint32", (o, i * bits // 32)),
            (f"{proj}.scales", dtype, (o, i // g)),
            (f"{proj}.biases", dtype, (o, i // g)),
        ]
    t.append(("down_proj.bias", "float32", (H,)))  # an odd-sized float tail (gpt_oss-like)
    q = {
        p: {"bits": bits, "group_size": g, "mode": "affine"}
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    return LayerLayout.plan(layer, f"model.layers.{layer}.mlp.switch_mlp", E, t, q)


def _expert(lay, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for t in lay.tensors:
        if t.dtype == "uint32":
            out[t.name] = mx.array(rng.integers(0, 2**32, t.shape, dtype=np.uint32))
        else:
            out[t.name] = mx.array(rng.standard_normal(t.shape).astype(np.float32)).astype(
                getattr(mx, t.dtype)
            )
    return out


def _write(folder, lay, order=None):
    w = LayerWriter(folder, lay)
    experts = {e: _expert(lay, 100 + e) for e in range(lay.num_experts)}
    for e in order or range(lay.num_experts):
        w.write(e, experts[e])
    lay = w.close()
    return lay, experts


def test_layout_is_aligned():
    lay = _layout()
    assert lay.stride % ALIGNMENT == 0 and lay.stride >= lay.record_size
    assert all(t.offset % 64 == 0 for t in lay.tensors)
    ends = sorted((t.offset, t.offset + t.nbytes) for t in lay.tensors)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))  # no overlaps
    assert LayerLayout.from_dict(lay.to_dict()) == lay


def test_roundtrip_bit_exact_any_write_order(tmp_path):
    lay, experts = _write(tmp_path, _layout(), order=[4, 0, 2, 1, 3])
    assert os.path.getsize(tmp_path / lay.file) == lay.file_size
    with ExpertStore(tmp_path, experts_section([lay])) as store:
        assert store.layers == [3]
        for e, want in experts.items():
            got = store.read(3, e, verify=True)
            assert set(got) == set(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
                assert mx.array_equal(got[k], want[k]).item(), (e, k)
        stacked = store.read_layer(3)
        for k in experts[0]:
            assert mx.array_equal(stacked[k], mx.stack([experts[e][k] for e in experts])).item()


def test_read_into_preallocated_buffer(tmp_path):
    lay, experts = _write(tmp_path, _layout(E=2, dtype="float16"))
    store = ExpertStore(tmp_path, experts_section([lay]))
    buf = np.zeros(lay.stride, dtype=np.uint8)
    raw = store.read_raw(3, 1, out=buf)
    assert raw.ctypes.data == buf.ctypes.data and raw.size == lay.record_size
    arrays = store.arrays(3, raw)
    assert np.array_equal(arrays["up_proj.weight"], np.asarray(experts[1]["up_proj.weight"]))
    store.close()


def test_corrupt_record_names_layer_and_expert(tmp_path):
    lay, _ = _write(tmp_path, _layout(E=3))
    path = tmp_path / lay.file
    with open(path, "r+b") as f:  # flip one byte inside expert 2's record
        f.seek(lay.record_offset(2) + 17)
        b = f.read(1)
        f.seek(lay.record_offset(2) + 17)
        f.write(bytes([b[0] ^ 0xFF]))
    store = ExpertStore(tmp_path, experts_section([lay]))
    store.verify(3, 1)
    with pytest.raises(ExpertRecordError, match="layer 3, expert 2: checksum mismatch"):
        store.verify(3, 2)
    with pytest.raises(ExpertRecordError, match="out of range"):
        store.read(3, 7)
    with pytest.raises(ExpertRecordError, match="layer 9"):
        store.read(9, 0)
    store.close()


def test_truncated_and_missing_files(tmp_path):
    lay, _ = _write(tmp_path, _layout(E=3))
    section = experts_section([lay])
    path = tmp_path / lay.file
    os.truncate(path, lay.file_size - 100)
    with pytest.raises(ExpertRecordError, match="layer 3.*truncated"):
        ExpertStore(tmp_path, section).read(3, 0)
    path.unlink()
    with pytest.raises(ExpertRecordError, match="missing"):
        ExpertStore(tmp_path, section).read(3, 0)


def test_writer_checks_completeness_and_shapes(tmp_path):
    lay = _layout(E=2)
    w = LayerWriter(tmp_path, lay)
    bad = _expert(lay, 0)
    bad["gate_proj.weight"] = bad["gate_proj.weight"][:, :1]
    with pytest.raises(ValueError, match="gate_proj.weight: shape"):
        w.write(0, bad)
    w.write(0, _expert(lay, 0))
    with pytest.raises(ValueError, match=r"experts \[1\] never written"):
        w.close()


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda s: s.update(layers=[]), "must map layer indices"),
        (lambda s: s.update(layers={}), "must map layer indices"),
        (lambda s: s["layers"]["3"].update(stride="abc"), r"layers\.3` is malformed: ValueError"),
        (lambda s: s["layers"]["3"].pop("tensors"), r"layers\.3` is malformed: KeyError"),
        (lambda s: s["layers"]["3"].update(num_experts=-1), "num_experts must be >= 1"),
        (lambda s: s["layers"]["3"].update(record_size=0), "empty record"),
        (lambda s: s["layers"].update({"4": s["layers"]["3"]}), "key '4' holds layer 3"),
        (lambda s: s["layers"]["3"].update(file="/etc/passwd"), "outside the model folder"),
        (lambda s: s["layers"]["3"].update(file="../../etc/passwd"), "outside the model folder"),
        (lambda s: s["layers"]["3"].update(file="experts/../../x.bin"), "outside the model folder"),
    ],
)
def test_malformed_manifest_section_is_refused(tmp_path, change, match):
    import copy

    lay, _ = _write(tmp_path, _layout(E=3))
    section = copy.deepcopy(experts_section([lay]))
    change(section)
    with pytest.raises(ExpertRecordError, match=match):
        ExpertStore(tmp_path, section)
    ExpertStore(tmp_path, experts_section([lay])).verify(3, 0)  # the real one still reads
