"""Fused Triton kernels and their pure-torch twins (installed as `mrl_kernels`)."""
