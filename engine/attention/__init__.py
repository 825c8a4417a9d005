"""Paged attention: the seam between transformers' modeling code and the backends, and the backends
(torch, the C++ CPU kernel, Triton).
"""
