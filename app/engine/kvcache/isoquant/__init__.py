"""IsoQuant: rotated 3/4-bit KV codes attended in compressed space (SPEC §4).

- `rotation`, `codebook`, `quantizer`, `packing`: the codec (format: packing.py)
- `cache`: the mlx-lm cache protocol over a compressed prefix and a float tail
- `attention`: the MLX-ops reference attention; `dispatch`: its hook into mlx-lm's modules
- `kernels` (+ `isoquant_body.h`, `isoquant_tc.cuh`, `metal_prologue`, `cuda_prologue`): the
  fused Metal/CUDA kernels; `kernel_path`: the switch between kernels and reference
- `factory`: `make_cache`, the modes table's factory for the isoquant* rows
"""

from .attention import IsoQuantTensor, isoquant_attention, isoquant_attention_reference
from .cache import IsoQuantKVCache
from .dispatch import install
from .factory import make_cache
from .packing import FORMAT_VERSION, pack_codes, unpack_codes
from .rotation import Rotation

__all__ = [
    "FORMAT_VERSION",
    "IsoQuantKVCache",
    "IsoQuantTensor",
    "Rotation",
    "install",
    "isoquant_attention",
    "isoquant_attention_reference",
    "make_cache",
    "pack_codes",
    "unpack_codes",
]
