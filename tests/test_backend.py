import mlx.core as mx

from app.engine.backend import detect


def test_detect_matches_mlx():
    b = detect()
    assert b.name in ("metal", "cuda", "cpu")
    assert b.metal_kernels == mx.metal.is_available()
    assert b.cuda_kernels == mx.cuda.is_available()
    assert "fp16" in b.kv_modes and "isoquant3" in b.kv_modes


def test_zipfusion_only_with_cuda():
    b = detect()
    if b.cuda_kernels:
        assert "zipfusion" in b.kv_modes and b.unavailable_reason("zipfusion") is None
    else:
        assert "zipfusion" not in b.kv_modes
        assert "NVIDIA" in b.unavailable_reason("zipfusion")
    assert "unknown" in b.unavailable_reason("nonsense")
