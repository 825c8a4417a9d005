"""PrefixGate's kernels: the C++ CPU kernels and their build (`cpu/`: attention, KV writes,
linear layers, fused element-wise steps, logits rows) and the Triton kernels for CUDA
(`triton/`: paged decode and prefill attention, KV writes, block zeroing)."""


class KernelUnavailable(RuntimeError):
    """A backend's kernels cannot serve here: no build (no compiler, ...), the wrong device, or
    a head size they do not handle."""
