"""Attention kernels behind the backend seam in `engine/attention.py`."""
