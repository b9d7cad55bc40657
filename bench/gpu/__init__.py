"""Drivers of the GPU checks (``benchmarks/gpu_check.sh``): ``bench.gpu.check``."""
