"""Stage 2: sparse dictionaries (TopK, BatchTopK, ReLU, crosscoders), training, evals, save/load.

Pure tensor code: torch, einops, safetensors (numba only under ``saes.kernels``).
"""
