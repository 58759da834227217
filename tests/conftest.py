"""Shared test settings."""

import os

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
