"""Triton kernels: paged decode and prefill attention, KV writes, block zeroing."""
