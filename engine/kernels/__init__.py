"""Attention kernels behind the backend seam in `engine/attention/paged.py`: the C++ CPU kernel
(`cpu_*`) and the Triton kernels for CUDA (`triton_*`)."""


class KernelUnavailable(RuntimeError):
    """A backend's kernels cannot serve here: no build (no compiler, ...), the wrong device, or
    a head size they do not handle."""
