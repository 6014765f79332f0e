"""Shared fixtures: the built-in tiny model, its tokenizer, a seeded random-init model."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import pytest
from helpers import REPO, TINY_MODEL
from xdist.scheduler import LoadScopeScheduling

# The suite runs in two pytest-xdist workers (pyproject.toml). vLLM's CPU build binds its worker's
# threads to core 0 unless told otherwise, so both workers' session servers (vLLM's own layout)
# would share one core while the other waits: each worker's session server gets a core of its own
# (the servers its tests start, in lit-rl's one-process layout, take one thread from it, unbound:
# lit_rl/inference/cpu_engine.py).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(_WORKER[2:]) % (os.cpu_count() or 1))
# Likewise torch: by default every process (a worker, the trainers and evaluators its tests start)
# runs one thread per core, so two workers' trainers run four spinning threads on two cores and
# both crawl. One thread per process while workers share the machine: on five end-to-end test
# files, 6 min 54 s -> 5 min 27 s wall and 27% less CPU (measured 2026-12-04). Numbers the tests
# compare (resume == uninterrupted, two ranks == one) come from runs under the same setting.
if _WORKER.startswith("gw") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

# Files whose tests share a costly module fixture (a trained run, a sharded checkpoint) or run in
# order, each using what the one before wrote: all of a file's tests go to one worker.
ONE_WORKER_FILES = frozenset({"tests/test_docs_commands.py", "tests/test_fsdp.py", "tests/test_resume.py"})


class OneWorkerFiles(LoadScopeScheduling):
    """Each test is its own unit of work, except that a file in ONE_WORKER_FILES is one unit.

    Why not pytest-xdist's own `--dist loadgroup` with `xdist_group` marks: on pytest 9.2 it groups
    nothing, silently (it renames `item._nodeid`, which pytest 9.2 no longer reads: pytest-xdist
    issue 1386), and the docs commands then ran on two workers, each missing what the other wrote.
    Scheduling by file path does not depend on renaming tests. The largest units are handed out
    first (xdist's `--loadscope-reorder`, on by default), so a one-worker file does not start last.
    """

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return path if path in ONE_WORKER_FILES else nodeid


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` (over a minute each) first: the two workers then end together, instead of
    one running a long test alone at the end while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_xdist_make_scheduler(config, log):
    return OneWorkerFiles(config, log)


def pytest_sessionfinish(session, exitstatus):
    """Tests clean up after themselves, failed ones too: the output files of `lit-rl` runs that a
    failing test left unread (tests/forked_cli.py) go with the session (each xdist worker's own), and
    so does the worker's vLLM launcher (tests/vllm_launcher.py)."""
    forked = sys.modules.get("forked_cli")
    if forked is not None:
        forked.remove_leftover_outputs()
    launcher = sys.modules.get("vllm_launcher")
    if launcher is not None:
        launcher.stop_launcher()


@contextlib.contextmanager
def log_handlers_writing_to(stream):
    """Lightning's, torch's and transformers' log handlers keep the stream that was sys.stderr when
    the library was first imported: in a test, a capture that pytest closes when the test ends, so
    every later log line prints "--- Logging error ---" and a traceback. Inside this block they
    write to `stream`; afterwards to what they had."""
    moved = []
    for logger in [logging.root, *logging.root.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if type(handler) is logging.StreamHandler and handler.stream is not sys.stdout:
                moved.append((handler, handler.stream))
                handler.stream = stream  # not setStream: it flushes the old stream, maybe closed
    try:
        yield
    finally:
        for handler, old in moved:
            handler.stream = old


@pytest.fixture(autouse=True)
def _log_handlers_follow_the_capture():
    with log_handlers_writing_to(sys.stderr):
        yield


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
            with log_handlers_writing_to(sys.stderr):  # this test's capture: their lines land in `stderr`
                cli.main(args)
            code = 0
        except SystemExit as e:
            code = e.code or 0
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


from vllm_fixtures import *  # noqa: E402,F401,F403
