"""Triton kernels of sparsekv (installed as `sparsekv.kernels`); `reference.py` holds their torch specs."""
