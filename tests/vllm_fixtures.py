"""ONE real vLLM server per test session, on the built-in tiny Qwen3, for every test that needs one.

    def test_x(vllm_server):                       # function scope: the shared server, at step 0
        async def run():
            async with vllm_server.client() as client:
                out = await client.generate(ids, max_tokens=8)
        asyncio.run(run())

`vllm_server` has `base_url` (…/v1), `root` (the run directory reloads are allowed from),
`model_dir` (`root/weights/step_0`, what is served at start), `export(step, seed)` (writes a
STABLE `weights/step_<step>` with other random weights) and `client(**kw)`. A test may reload
other steps; afterwards the fixture reloads step 0 so the next test finds the original weights.
The server is served as float32 (vLLM on CPU would make it bfloat16) and eager (starts in about
25 s instead of 50 s on 2 cores); its log is `root/vllm.log`. It is stopped, with its whole
process group, at the end of the session, whatever the tests did.

It runs with vLLM's own default, `--generation-config auto` (what a plain `vllm serve` does, and
what a user's server for `inference.base_url` may do), on a checkpoint whose
generation_config.json asks for top_k 1 (`GREEDY_DEFAULTS`): a request that left any sampling
parameter to the server would sample greedily, so every test that draws samples from it checks
that lit-rl's requests say all of their sampling (`InferenceClient.generate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import TINY_MODEL

from lit_rl.inference.server import VLLMServer
from lit_rl.run_dir import STABLE, step_dir

__all__ = ["GREEDY_DEFAULTS", "ServedTinyModel", "write_tiny_checkpoint", "vllm_session_server", "vllm_server"]

# The session checkpoint's generation defaults: Qwen3 ships top_k 20, top_p 0.95, temperature 0.6;
# these make any request that leaves sampling to the server greedy, and unmistakably so.
GREEDY_DEFAULTS = {"do_sample": True, "top_k": 1, "top_p": 0.5, "temperature": 0.6, "min_p": 0.5,
                   "repetition_penalty": 1.5}


def write_tiny_checkpoint(path: Path, seed: int, logit_scale: float = 1.0) -> Path:
    """A complete HF checkpoint of the tiny model (random weights from `seed`), marked STABLE.

    `logit_scale` multiplies the final norm's weight, hence every logit (the head is tied): a
    random init is nearly uniform over the vocabulary, so two of them barely disagree; a scaled
    one is sharp, which gives a test a teacher that clearly differs from the student."""
    from transformers import AutoTokenizer

    from lit_rl.modules.model_loading import load_causal_lm

    if not (path / STABLE).is_file():
        path.mkdir(parents=True, exist_ok=True)
        model = load_causal_lm(TINY_MODEL, random_init=True, seed=seed)
        with torch.no_grad():
            model.model.norm.weight.mul_(logit_scale)
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(path)
        (path / STABLE).touch()
    return path


@dataclass
class ServedTinyModel:
    server: VLLMServer
    root: Path  # run directory: reloads are allowed from root/weights/step_N
    model_dir: Path  # root/weights/step_0, served at start (random init, seed 0)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def export(self, step: int, seed: int) -> Path:
        return write_tiny_checkpoint(step_dir(self.root, step), seed)

    def client(self, **kwargs):
        return self.server.client(**kwargs)

    @contextlib.contextmanager
    def run_dir(self, steps: tuple[int, ...] = (0,)) -> Iterator[Path]:
        """A run directory of its own inside `root` (the server may reload from it) whose
        `weights/step_N` for each of `steps` is a copy of `model_dir`; removed afterwards."""
        run = self.root / f"run_{uuid.uuid4().hex[:8]}"
        try:
            for step in steps:
                shutil.copytree(self.model_dir, step_dir(run, step))
            yield run
        finally:
            shutil.rmtree(run, ignore_errors=True)

    def restore(self) -> None:
        """Serve step 0 again if a test left another version loaded (or never reloaded)."""

        async def run():
            async with self.client() as client:
                if await client.served_version() not in (None, 0):
                    await client.reload_weights(self.model_dir)

        if self.server.alive():
            asyncio.run(run())


@pytest.fixture(scope="session")
def vllm_session_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_run")
    model_dir = write_tiny_checkpoint(step_dir(root, 0), seed=0)
    defaults = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**defaults, **GREEDY_DEFAULTS}))
    # vLLM's multiprocessing executor (engine core and worker apart), not the one-process layout
    # lit-rl gives a CPU server by default (lit_rl/inference/cpu_engine.py), which the servers the
    # end-to-end tests start have: the suite runs both, and the worker's queue patch has its queue.
    server = VLLMServer(model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
                        log_path=root / "vllm.log", allowed_root=root, startup_timeout=300, generation_config="auto",
                        extra_args=["--distributed-executor-backend", "mp"])
    with server:  # stops the process group on exit, even when tests fail or are interrupted
        yield ServedTinyModel(server=server, root=root, model_dir=model_dir)


@pytest.fixture
def vllm_server(vllm_session_server):
    yield vllm_session_server
    vllm_session_server.restore()
