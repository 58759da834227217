"""Shared test settings."""

import os
import sys

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker():
    """Under pytest-xdist (2 workers on 2 cores) one torch thread per worker avoids oversubscription; the
    tests' matrices are tiny, so threads only add synchronization."""
    saved = torch.get_num_threads()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def _close_figures():
    """Close the pyplot figures a test opened: ``extrapolation_figure`` and the like hand theirs to the caller,
    and tests that inspect them left them open (pyplot's 'More than 20 figures' warning)."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture(autouse=True)
def _denormals_as_torch_starts():
    """Float32 denormals kept after each test, as torch starts: a benchmark worker called in-process flushes them,
    as the lengthgen command does (`flush_denormals`), and hypothesis then refuses to draw subnormal floats."""
    yield
    torch.set_flush_denormal(False)
