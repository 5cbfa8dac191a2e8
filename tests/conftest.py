"""Settings every test process shares.

Tiny models on one thread: the suite's tensors are a few dozen rows wide, so intra-op
threads only add synchronisation, and under ``pytest -n 2`` on a 2-core machine (or
with other jobs on it) a second OpenMP thread per worker spins against the other
worker. Measured on the 2-core machine under load: stage 4 of qwen2_moe took 3.2 s on
2 threads and 0.5-1.1 s on 1. ``OMP_NUM_THREADS`` carries the setting into the child
processes the tests start (the AReaL checker, a stage run by ``archon-port add``).
``ARCHON_TEST_THREADS`` overrides it.

The cyclic garbage collector, once collection has imported the suite's modules: those are
frozen (``gc.freeze``: never traversed again, never collected) and a young generation is
collected after 20000 net allocations instead of 700. The engine's libcst edits allocate
millions of short-lived nodes, and every full collection walked the millions of objects of
torch, transformers and the suite's modules: measured on the 2-core machine, the collector's
time over the 88 QK-norm edit tests went from 5.9 s to 1.6 s (of 55 s), over stage tests
from 2.9 s to 1.9 s. Nothing a test checks depends on when garbage is collected.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

THREADS_ENV = "ARCHON_TEST_THREADS"


def configured_threads() -> int:
    value = os.environ.get(THREADS_ENV, "1")
    try:
        threads = int(value)
    except ValueError:
        raise pytest.UsageError(f"{THREADS_ENV}={value!r}: give a positive integer number of threads") from None
    if threads < 1:
        raise pytest.UsageError(f"{THREADS_ENV}={value!r}: give a positive integer number of threads")
    return threads


ONE_PROCESS_OPTION = "--areal-one-process"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        ONE_PROCESS_OPTION,
        action="store_true",
        help="the AReaL tier without its TP=2 and FSDP=2 checks on 2 gloo processes (AReaL's load path, "
        "parity, bias, tie and training step still run): .ci/run's run on torch 2.10, whose DTensor the "
        "packages' TP plans do not all run on",
    )


def pytest_configure(config: pytest.Config) -> None:
    threads = configured_threads()
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


# The young generation's threshold (CPython's default is 700); the older ones keep theirs.
GC_YOUNG_THRESHOLD = 20000


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
