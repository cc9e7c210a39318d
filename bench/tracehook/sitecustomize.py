"""Loaded at start-up by every process ``python -m bench.timeline`` starts (this folder is on
their PYTHONPATH): records when each gpumesh message is sent and received (bench/trace.py)."""

import os

if os.environ.get("GPUMESH_BENCH_TRACE"):
    from bench.trace import install

    install(os.environ["GPUMESH_BENCH_TRACE"])
