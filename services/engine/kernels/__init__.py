"""Kernels, per backend: `native` (C, built for the CPU it runs on) and `gpu_kernels`
(Triton, CUDA). They import nothing of pdserve's above them."""
