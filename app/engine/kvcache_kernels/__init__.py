"""Fused IsoQuant attention kernels (Metal and CUDA) and the switch between them and the
MLX-ops reference. Kernel module: isoquant.py."""
