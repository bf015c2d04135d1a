"""The model and what runs it: the runner, paged attention, fused layers, the KV pool's
memory, the sampler, device streams, CUDA graphs, and the execution backends that pick
the kernels for the hardware."""
