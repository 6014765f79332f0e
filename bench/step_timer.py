"""A callback for benchmarks: appends `step wall_time` lines to a file after each optimizer step."""

from __future__ import annotations

import time

import lightning as L


class StepTimer(L.Callback):
    def __init__(self, path: str):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step} {time.perf_counter()}\n")
