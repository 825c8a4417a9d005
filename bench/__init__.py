"""Benchmarks, each run as `python -m bench.NAME` (see the README's "Benchmarks").

`engine` is imported first so that its OpenMP defaults (idle threads spin briefly, then
sleep; engine/model/openmp.py) are set before any benchmark imports torch. In November 2026, when
the default was sleeping threads and bench.peers imported torch first, its in-process engine
decoded one stream at 25 tok/s while the API server of the same run did 41.5, and 39 once
the defaults were set.
"""

import engine  # noqa: F401
