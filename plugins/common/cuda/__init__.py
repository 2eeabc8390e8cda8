"""Fused CUDA tree-verification kernels; the torch code in sampling.py is their reference."""
