"""The engine: paged KV blocks, the prefix cache, the scheduler and the model runner."""

import os

# OpenMP threads that busy-wait between parallel regions (libgomp's default) starve everything
# else on the machine: the gateway's event loop, tokenization, another process. Measured on a
# 2-core machine with a second busy process, a bf16 decode step took 0.1-1.2 s with spinning
# threads and 38 ms with sleeping ones. It must be set before torch is first imported; an
# explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
