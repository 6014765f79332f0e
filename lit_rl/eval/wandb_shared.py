"""One W&B run for the trainer and its evaluator process.

W&B lets several processes write one run in "shared" mode: one primary writer (it owns
the run's finish state) and labelled secondaries. The trainer's Lightning `WandbLogger`
is made the primary before its run starts (`make_trainer_primary`, called by OnlineEval's
`setup`), and the evaluator joins as a secondary (`join_as_evaluator`) with the run
description the trainer hands it (`describe_run`). Offline runs cannot be shared: the
evaluator then writes its own offline directory with the trainer's run id, next to the
trainer's, and both are uploaded with `wandb sync`.
"""

from __future__ import annotations

import os

from lightning.pytorch.utilities import rank_zero_info

LOCAL_MODES = ("offline", "disabled", "dryrun")


def make_trainer_primary(logger) -> bool:
    """Before the trainer's W&B run starts: ask for shared mode with the trainer as primary.
    False when nothing was changed (the run already started, or it is offline)."""
    if getattr(logger, "_experiment", None) is not None:
        return False  # created already (e.g. by the user): evals then join it as best W&B can
    init = logger._wandb_init  # Lightning keeps the wandb.init arguments until the run starts
    settings = init.get("settings") or {}
    if not isinstance(settings, dict):
        settings = settings.model_dump(exclude_unset=True)
    modes = {init.get("mode"), settings.get("mode"), os.environ.get("WANDB_MODE")}
    if getattr(logger, "_offline", False) or modes & set(LOCAL_MODES):
        return False
    init["settings"] = {**settings, "mode": "shared", "x_primary": True, "x_label": settings.get("x_label", "trainer")}
    rank_zero_info("OnlineEval: the W&B run is shared with the evaluator (W&B shared mode, trainer primary)")
    return True


def describe_run(run) -> dict:
    """What the evaluator needs to write into the trainer's run."""
    return {"id": run.id, "project": run.project, "entity": run.entity, "dir": run.settings.root_dir,
            "mode": run.settings.mode}


def join_as_evaluator(description: dict):
    import wandb

    description = dict(description)
    mode = description.pop("mode", "online")
    if mode in LOCAL_MODES:
        settings = wandb.Settings(mode=mode, x_label="evaluator")
    else:
        settings = wandb.Settings(mode="shared", x_primary=False, x_label="evaluator", x_update_finish_state=False)
    run = wandb.init(settings=settings, **description)
    run.define_metric("eval/policy_version")
    run.define_metric("eval/*", step_metric="eval/policy_version")
    return run
