"""WeightSync: after every optimizer step, the policy's inference server serves the new weights.

RL draws its next rollouts from the server, so after optimizer step k the server must serve
the weights of step k before batch k's rollouts may start (with `max_staleness=0`) or be
stamped as version k. Per step:

1. export: `HFExport.sync_export` writes the weights to `sync/step_k` (no fsync; the two
   newest kept), or reuses the checkpoint `weights/step_k` if one was written this step;
   collective, rank 0 writes;
2. reload: the data module's server loads them (`InferenceClient.reload_weights`: vLLM's
   `/collective_rpc reload_weights` plus lit-rl's tied-head repair), within `timeout`;
3. advance: the rollout scheduler's policy version becomes k.

At the start of training (fresh or resumed) the current weights are exported the same way
and the server is started on them, so a resumed run serves exactly the weights it trains.
Every step is bounded: a reload that does not answer within `timeout` fails the run with the
server's state, never a silent hang; on any failure the rollouts and the server stop. On a
graceful stop (SIGTERM, Ctrl-C) the last step is not synced, an error of a server going down
with the job is the stop, and the resumable checkpoint is written before the server stops
(`lit_rl.stopping`).

The transport is the filesystem, which works everywhere the trainer and the server share a
disk (and is tested on CPU). vLLM's NCCL weight-transfer endpoints are the GPU fast path: a
subclass overrides `send(trainer, pl_module, step)` to push the tensors instead and keeps
the rest (timing, version, failure handling).
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lit_rl import stopping
from lit_rl.callbacks.export import HFExport
from lit_rl.inference.server import StartInterrupted


class WeightSync(L.Callback):
    def __init__(self, timeout: float = 300.0):
        """
        Args:
            timeout: seconds one reload of the server may take before the run fails.
        """
        if timeout <= 0:
            raise ValueError(f"WeightSync.timeout must be > 0, got {timeout}")
        self.timeout = timeout
        self.exporter: HFExport | None = None
        self.last_sync_s = 0.0

    def _data(self, trainer):
        dm = trainer.datamodule
        if dm is None or not callable(getattr(dm, "sync", None)) or not callable(getattr(dm, "start", None)):
            raise ValueError("WeightSync needs a data module with an inference server to sync, e.g. "
                             "lit_rl.data.RolloutDataModule")
        return dm

    def on_train_start(self, trainer, pl_module) -> None:
        dm = self._data(trainer)
        found = [c for c in trainer.callbacks if isinstance(c, HFExport)]
        self.exporter = found[0] if found else HFExport()  # the run's exporter owns every export
        step = trainer.global_step
        weights = self.exporter.sync_export(trainer, pl_module, step)
        if trainer.is_global_zero:
            started = time.perf_counter()
            try:
                with stopping.stops_on_request(trainer, "starting the inference server"):
                    dm.start(weights, step)
            except StartInterrupted:
                raise stopping.stop(trainer, "stopped while the inference server was starting") from None
            rank_zero_info(f"WeightSync: serving the weights of step {step} ({time.perf_counter() - started:.0f} s to start)")
        trainer.strategy.barrier("weight_sync_start")

    def send(self, trainer, pl_module, step: int) -> None:
        """Make the server serve the current weights of `step`. The filesystem path: export, then
        reload on rank 0. Collective (the export gathers shards)."""
        weights: Path = self.exporter.sync_export(trainer, pl_module, step)
        if trainer.is_global_zero:
            trainer.datamodule.sync(weights, step, self.timeout)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if last or stopping.requested(trainer):  # no rollout will be drawn from these weights
            self.last_sync_s = 0.0
            pl_module.log("train/weight_sync_s", 0.0, on_step=True, on_epoch=False, batch_size=1)
            return
        started = time.perf_counter()
        with stopping.stops_on_request(trainer, f"the weight sync of step {step}"):
            self.send(trainer, pl_module, step)
        trainer.strategy.barrier("weight_sync")
        self.last_sync_s = time.perf_counter() - started
        pl_module.log("train/weight_sync_s", self.last_sync_s, on_step=True, on_epoch=False, batch_size=1)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        stopping.save_before_stopping(trainer, exception)
        self.shutdown(trainer)

    def shutdown(self, trainer) -> None:
        dm = trainer.datamodule
        if dm is not None and callable(getattr(dm, "shutdown", None)):
            dm.shutdown()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.shutdown(trainer)
