"""Shared fixtures: the built-in tiny model, its tokenizer, a seeded random-init model."""

from __future__ import annotations

import os
import sys

import pytest
from helpers import REPO, TINY_MODEL

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


@pytest.fixture
def lit_rl_main(monkeypatch, capsys):
    """`lit-rl ARGS` in this process, returning (exit code, stdout, stderr) like `run`: the same working
    directory and HF_HUB_OFFLINE, sys.argv without pytest's arguments. Set other environment
    variables with monkeypatch.setenv (`default_env` reads them at parse time)."""
    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def call(args):
        from lit_rl import cli  # here: collecting the test files stays light

        try:
            cli.main(args)
            code = 0
        except SystemExit as e:
            code = e.code or 0
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


from vllm_fixtures import *  # noqa: E402,F401,F403
