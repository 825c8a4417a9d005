"""The engine: paged KV blocks, the prefix cache, the scheduler and the model runner."""

from engine.model import openmp

openmp.defaults()  # before anything imports torch: see engine/model/openmp.py
