"""Paged attention: the seam between transformers' modeling code and the backends (`paged`), the
backends (torch, the C++ CPU kernel, Triton) and the choice between them (`selection`).
"""
