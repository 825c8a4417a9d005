"""The engine: paged KV blocks, the prefix cache, the scheduler and the model runner."""

from engine import openmp

openmp.defaults()  # before anything imports torch: see engine/openmp.py
