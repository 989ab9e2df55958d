"""Quantization the kernels see: int8/int4 weights (fp8 on GPU) read packed by the matmul, and a
quantized KV cache read by the attention kernels.

    support            the formats, and which device runs which (pure; the control plane uses it)
    weights            quantize a weight on load (compressed-tensors' arithmetic), the reference dequantize
    compressed_tensors checkpoints whose config.json has a compressed-tensors quantization_config
    linear             the Linear variants each device runs (C kernels on CPU, Triton on CUDA)
    loader             chooses, per projection, a dense, quantized-on-load or checkpoint-quantized Linear
    kv_cache           the int8 (CPU) and fp8 (GPU) KV caches and the attention that reads them
"""
