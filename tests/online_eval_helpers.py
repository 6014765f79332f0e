"""Test-only pieces the trainer or evaluator process imports by class path."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import lightning as L

from lit_rl.eval.plan import read_final_step
from lit_rl.rollouts.envs import EvalRun, ReverseTextEnv
from lit_rl.run_dir import STABLE


class DeleteFinalStepAtBase(ReverseTextEnv):
    """At step 0, waits until training has finished and announced its final step, then
    deletes that step's checkpoint before the evaluator gets to it."""

    default_name = "reverse_text"

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        metrics = await super().evaluate(run)
        if run.step == 0:
            root = run.step_dir.parent.parent
            while read_final_step(root) is None:
                await asyncio.sleep(0.2)
            final = root / "weights" / f"step_{read_final_step(root)}"
            assert (final / STABLE).is_file()
            shutil.rmtree(final)
        return metrics


class CrashAtStep(L.Callback):
    """Makes the trainer fail mid-run."""

    def __init__(self, step: int = 3):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise RuntimeError(f"deliberate crash at step {trainer.global_step}")


def evaluator_processes(root: Path) -> list[int]:
    """pids of evaluator processes working on `root`, and of vLLM servers serving from it."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(root) in cmd and ("lit_rl.cli evaluate" in cmd or "vllm.entrypoints" in cmd):
            found.append(p.info["pid"])
    return found
