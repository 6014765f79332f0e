"""Shared fixtures: the built-in tiny model, its tokenizer, a seeded random-init model."""

from __future__ import annotations

import os

import pytest
from helpers import TINY_MODEL

# The suite runs in two pytest-xdist workers (pyproject.toml). vLLM's CPU build binds its engine
# thread to core 0 unless told otherwise, so both workers' servers (the session server and those
# their tests start, which inherit this environment) would share one core while the other waits:
# each worker's servers get a core of their own.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(_WORKER[2:]) % (os.cpu_count() or 1))


@pytest.fixture
def tiny_model_path() -> str:
    return TINY_MODEL


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture
def tiny_model():
    from lit_rl.modules.model_loading import load_causal_lm

    return load_causal_lm(TINY_MODEL, random_init=True, seed=0)
from vllm_fixtures import *  # noqa: F401,F403
