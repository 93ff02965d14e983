"""KV-cache compression: IsoQuant (rotated 3/4-bit codes, `isoquant/`) and ZipFusion
(lossless BF16, `zipfusion/`). Format of the packed IsoQuant cache: isoquant/packing.py."""

from .isoquant.attention import (
    IsoQuantTensor,
    isoquant_attention,
    isoquant_attention_reference,
    register_kernel,
)
from .isoquant.cache import IsoQuantKVCache, register_encoder
from .isoquant.dispatch import install
from .isoquant.packing import FORMAT_VERSION, pack_codes, unpack_codes
from .isoquant.rotation import Rotation
from .modes import KV_MODES, MODES, cache_nbytes, finish_prefill, make_cache, mode_spec
from .persist import load_cache, save_cache

__all__ = [
    "FORMAT_VERSION",
    "KV_MODES",
    "MODES",
    "IsoQuantKVCache",
    "IsoQuantTensor",
    "Rotation",
    "cache_nbytes",
    "finish_prefill",
    "install",
    "isoquant_attention",
    "isoquant_attention_reference",
    "load_cache",
    "make_cache",
    "mode_spec",
    "pack_codes",
    "register_encoder",
    "register_kernel",
    "save_cache",
    "unpack_codes",
]
