"""Exact resume through the real CLI: resume == uninterrupted, graceful SIGTERM / Ctrl-C,
resume at max_steps, and bad checkpoints refused before anything is overwritten."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lit_rl.run_dir import stable_steps, unfinished
from helpers import REPO, TINY_MODEL, reverse_rows, write_jsonl
from test_cli import CONFIG, run

# One worker for the file: its module fixture's runs are shared by its tests.
pytestmark = pytest.mark.slow  # one worker runs the file: conftest.ONE_WORKER_FILES


def fit(root, data, steps, *extra, **popen):
    return [
        "fit", "--config", CONFIG,
        "--data.init_args.path", data, "--data.init_args.num_workers", "0", "--data.init_args.batch_size", "8",
        "--data.init_args.val_path", "",
        "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", "1",
        *extra,
    ]


def losses(root: Path, name: str = "train/loss") -> dict[int, float]:
    out = {}
    for path in sorted(root.glob("logs/version_*/metrics.csv")):
        for row in __import__("csv").DictReader(open(path)):
            if row.get(name):
                out[int(row["step"])] = float(row[name])
    return out


def snapshot(root: Path) -> dict[str, float]:
    """Every file under weights/ and checkpoints/ with its modification time."""
    return {str(p): p.stat().st_mtime_ns for d in ("weights", "checkpoints") for p in (root / d).rglob("*") if p.is_file()}


def validation(tmp: Path) -> list[str]:
    return ["--data.init_args.val_path", str(tmp / "val.jsonl"), "--trainer.val_check_interval", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    data = write_jsonl(tmp / "train.jsonl", reverse_rows(20))  # 2 steps of 8 rows per epoch: resume crosses epochs
    # validation every 3 steps: the first launch of `split` ends with one, after its last step
    write_jsonl(tmp / "val.jsonl", reverse_rows(12, offset=20))  # two batches
    val = validation(tmp)
    straight, split = tmp / "straight", tmp / "split"
    for args in (fit(straight, data, 6, "--seed_everything", "7", *val), fit(split, data, 3, "--seed_everything", "7", *val)):
        out = run(args)
        assert out.returncode == 0, out.stderr[-3000:]
    # the row order follows the run's seed, and a resume launched with another seed keeps the first one's;
    # it runs to the end of the straight run's 3 epochs (the first launch's max_steps ended mid-epoch)
    out = run(fit(split, data, -1, "--trainer.max_epochs", "3", "--ckpt_path", "last", "--seed_everything", "8", *val))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "data.seed: resuming the order of seed 7, the one the run started with" in out.stdout + out.stderr
    return tmp, data, straight, split


def test_resume_equals_uninterrupted(runs):
    _, _, straight, split = runs
    a, b = losses(straight), losses(split)
    assert sorted(a) == sorted(b) == list(range(6))
    assert [b[s] for s in range(6)] == [a[s] for s in range(6)]  # bitwise on CPU
    # resumed from the checkpoint written after step 3 and its validation, the steps are logged under the
    # uninterrupted run's numbers (they were one higher: 4-6), the validations too
    assert losses(split, "val/loss") == losses(straight, "val/loss") and sorted(losses(straight, "val/loss")) == [2, 5]
    wa = load_file(straight / "weights" / "step_6" / "model.safetensors")
    wb = load_file(split / "weights" / "step_6" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_stop_during_validation_runs_that_validation_when_resumed(runs, lit_rl_main):
    """SIGTERM after the first of the two batches of step 3's validation: Lightning stops the
    validation there and the run saves and exits 143. Resumed, the run validates the weights of
    step 3 again, over every batch, before training on: its `val/` metrics and losses are those
    of the uninterrupted run (that validation was skipped, and never logged)."""
    tmp, data, straight, _ = runs
    stopped = tmp / "stopped_in_validation"
    code, _, stderr = lit_rl_main(fit(stopped, data, 6, "--seed_everything", "7", *validation(tmp),
                                      "--trainer.callbacks+=online_eval_helpers.TermDuringValidation",
                                      "--trainer.callbacks.step=3"))
    assert code == 143 and "stopped by SIGTERM after step 3" in stderr, stderr[-3000:]
    assert losses(stopped, "val/loss") == {}  # the stop came before the validation's end
    code, _, stderr = lit_rl_main(fit(stopped, data, 6, "--ckpt_path", "last", *validation(tmp)))
    assert code == 0, stderr[-3000:]
    assert losses(stopped, "val/loss") == losses(straight, "val/loss") and sorted(losses(stopped, "val/loss")) == [2, 5]
    assert losses(stopped) == losses(straight)


def test_resume_logs_the_epochs_of_the_uninterrupted_run(runs):
    """The first launch of `split` ends at max_steps in the middle of an epoch (step 3 of 2-step
    epochs); the checkpoint written after it counted that epoch as completed, and the resumed run
    logged every step one epoch higher (2, 3, 3 for 1, 2, 2)."""
    _, _, straight, split = runs
    assert losses(straight, "epoch") == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    assert losses(split, "epoch") == losses(straight, "epoch")


def test_resume_at_max_steps_ends_at_once(runs, lit_rl_main):
    _, data, _, split = runs
    before = snapshot(split)
    trained = losses(split)
    versions = sorted(p.name for p in (split / "logs").iterdir())
    code, _, stderr = lit_rl_main(fit(split, data, 6, "--ckpt_path", "last"))
    assert code == 0, stderr[-3000:]
    assert losses(split) == trained  # no step was trained
    assert sorted(p.name for p in (split / "logs").iterdir()) == versions  # nor a logs/version_N with a config only
    assert {k: v for k, v in snapshot(split).items() if "weights" in k} == {k: v for k, v in before.items() if "weights" in k}


def test_missing_checkpoint_is_refused_before_anything_changes(runs, lit_rl_main):
    _, data, _, split = runs
    before = snapshot(split)
    missing = str(split / "checkpoints" / "nope.ckpt")
    versions = sorted(p.name for p in (split / "logs").iterdir())
    code, _, stderr = lit_rl_main(fit(split, data, 8, "--ckpt_path", missing))
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert f"Checkpoint file not found: {missing}" in stderr and "fix: --ckpt_path last" in stderr
    assert snapshot(split) == before
    assert sorted(p.name for p in (split / "logs").iterdir()) == versions  # no logs/version_N of the failed launch


def test_resume_last_without_a_checkpoint_never_replaces_the_run(runs, tmp_path, lit_rl_main):
    """`--ckpt_path last` that finds no checkpoint started from step 0 with a warning, and the fresh
    start removed the run's exported weights: refused, before anything changes, when the run directory
    holds a run (a config with checkpointing disabled, or a checkpoint deleted). Into an empty
    directory it starts fresh: tests/test_resume.py::test_a_non_finite_gradient_stops_the_run..."""
    import shutil

    _, data, _, split = runs
    copy = tmp_path / "copy"
    shutil.copytree(split, copy)
    before, versions = snapshot(copy), sorted(p.name for p in (copy / "logs").iterdir())
    code, _, stderr = lit_rl_main(fit(copy, data, 8, "--ckpt_path", "last", "--trainer.enable_checkpointing", "false"))
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert (f"--ckpt_path last found no checkpoint to resume (this config writes none: trainer.enable_checkpointing "
            f"is false), but the run directory {copy} holds an earlier run (2 exported step(s): step_3, step_6; "
            f"checkpoints/: last.ckpt; the logs of 2 launch(es) in logs/)") in stderr, stderr[-3000:]
    (copy / "checkpoints" / "last.ckpt").unlink()
    before.pop(str(copy / "checkpoints" / "last.ckpt"))
    code, _, stderr = lit_rl_main(fit(copy, data, 8, "--ckpt_path", "last"))
    assert code == 1 and f"found no checkpoint to resume (none in {copy / 'checkpoints'})" in stderr, stderr[-3000:]
    assert snapshot(copy) == before and sorted(p.name for p in (copy / "logs").iterdir()) == versions


def test_another_data_seed_on_resume_is_one_message(runs, tmp_path, lit_rl_main):
    import shutil

    _, data, _, split = runs
    copy = tmp_path / "copy"
    shutil.copytree(split, copy)
    versions = sorted(p.name for p in (copy / "logs").iterdir())
    code, _, stderr = lit_rl_main(fit(copy, data, 8, "--ckpt_path", "last", "--data.init_args.seed", "5"))
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "data.seed is 5, but the checkpoint's run drew its order with seed 7" in stderr, stderr[-3000:]
    # refused after the checkpoint was restored (its step is the trainer's): no logs/version_N of the launch
    assert sorted(p.name for p in (copy / "logs").iterdir()) == versions


def test_a_failed_launch_keeps_its_log_version_only_if_it_trained(runs, tmp_path, lit_rl_main):
    """A resumed launch that fails at its first step trained nothing: its logs/version_N (the config
    alone) goes. One that fails a step later trained one, unlogged (log_every_n_steps): its config
    stays, the record of that launch."""
    import shutil

    _, data, _, split = runs
    for failing_step, kept in ((6, False), (7, True)):
        copy = tmp_path / f"copy{failing_step}"
        shutil.copytree(split, copy)
        versions = sorted(p.name for p in (copy / "logs").iterdir())
        code, _, stderr = lit_rl_main(fit(copy, data, 9, "--ckpt_path", "last", "--trainer.log_every_n_steps", "50",
                                          "--trainer.callbacks+=online_eval_helpers.NaNLossAtStep",
                                          f"--trainer.callbacks.step={failing_step}"))
        assert code == 1 and f"training step {failing_step}: the gradient norm is nan" in stderr, stderr[-3000:]
        new = sorted({p.name for p in (copy / "logs").iterdir()} - set(versions))
        assert len(new) == kept, (failing_step, new)
        if kept:
            assert [p.name for p in (copy / "logs" / new[0]).iterdir()] == ["config.yaml"]


def test_python_fit_last_without_a_checkpoint_never_replaces_the_run(tmp_path):
    """`trainer.fit(..., ckpt_path="last")` from Python, with no checkpoint where RunCheckpoint
    writes them but an earlier run's exports in the run directory: Lightning only warns and starts
    from step 0, and HFExport removed the earlier run's weights. Refused before anything is written;
    into an empty directory it starts fresh."""
    import lightning as L

    from lit_rl.callbacks import HFExport
    from lit_rl.callbacks.checkpoint import RunCheckpoint
    from lit_rl.data.datamodules import StaticDataModule
    from lit_rl.errors import ConfigError
    from lit_rl.modules.sft import SFT

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    root = tmp_path / "run"

    def python_fit(steps, ckpt_path):
        module = SFT(model=TINY_MODEL, random_init=True, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
        dm = StaticDataModule(data, batch_size=4, num_workers=0, max_length=64, micro_batch_tokens=256)
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, default_root_dir=str(root),
                            callbacks=[HFExport(every_n_steps=1), RunCheckpoint()])
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)

    python_fit(2, "last")  # a first launch of a requeued job: nothing to resume, nothing to replace
    assert sorted(stable_steps(root)) == [1, 2]
    (root / "checkpoints" / "last.ckpt").unlink()
    before = snapshot(root)
    with pytest.raises(ConfigError, match=r'ckpt_path="last" found no checkpoint to resume .* holds an earlier run '
                                          r"\(2 exported step\(s\): step_1, step_2\)"):
        python_fit(3, "last")
    assert snapshot(root) == before


def test_a_fresh_run_in_an_earlier_runs_directory_replaces_its_checkpoint_and_curves(runs, tmp_path, lit_rl_main):
    """A fresh fit where a run was (resumed once): it overwrites last.ckpt at its first save (no
    last-v1.ckpt beside the old run's, which `--ckpt_path last` might pick), and `lit-rl report`
    shows its curves alone; a `lit-rl validate` of its checkpoint there after it keeps them, and is drawn
    at the checkpoint's step."""
    import shutil

    from lit_rl.commands.report import collect

    _, data, _, split = runs
    again = tmp_path / "again"
    shutil.copytree(split, again)
    assert sorted(collect(again)["train/loss"]) == list(range(6))
    code, _, stderr = lit_rl_main(fit(again, data, 2))
    assert code == 0, stderr[-3000:]
    assert sorted(p.name for p in (again / "checkpoints").iterdir()) == ["last.ckpt"]
    assert torch.load(again / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    assert sorted(collect(again)["train/loss"]) == [0, 1] and collect(again)["train/loss"] == losses_of_last(again)
    code, _, stderr = lit_rl_main(["validate", "--config", CONFIG, "--data.init_args.path", data, "--data.init_args.val_path",
                                   data, "--data.init_args.num_workers", "0", "--trainer.default_root_dir", str(again),
                                   "--ckpt_path", "last"])
    assert code == 0, stderr[-3000:]
    # drawn where the fit logged the step that made the validated weights (step 2's: 1), not at 0 where Lightning logs it
    assert sorted(collect(again)["train/loss"]) == [0, 1] and list(collect(again)["val/loss"]) == [1]


def losses_of_last(root: Path) -> dict[int, float]:
    """train/loss of the newest launch's metrics.csv alone."""
    newest = max(root.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    return {int(r["step"]): float(r["train/loss"]) for r in __import__("csv").DictReader(open(newest)) if r.get("train/loss")}


def test_a_truncated_checkpoint_is_one_message(runs, tmp_path, lit_rl_main):
    """A checkpoint cut short (a full disk, a copy that stopped): one message naming it, not
    torch's traceback from inside Lightning's parsing of the path."""
    _, data, _, split = runs
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes((split / "checkpoints" / "last.ckpt").read_bytes()[:100_000])
    before = snapshot(split)
    code, _, stderr = lit_rl_main(fit(split, data, 8, "--ckpt_path", str(cut)))
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert f"cannot read the checkpoint (--ckpt_path {cut}): it is truncated or corrupt" in stderr, stderr[-3000:]
    assert snapshot(split) == before
    # `--ckpt_path last` is read later, when the trainer restores it
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(split, copy)
    (copy / "checkpoints" / "last.ckpt").write_bytes(cut.read_bytes())
    code, _, stderr = lit_rl_main(fit(copy, data, 8, "--ckpt_path", "last"))
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "cannot read the checkpoint (--ckpt_path last): it is truncated or corrupt" in stderr, stderr[-3000:]


def test_a_resume_reads_its_checkpoint_once(runs, tmp_path, monkeypatch):
    """LightningCLI read a given checkpoint whole at start-up, for saved `__init__` arguments that
    lit-rl's modules do not save, and the trainer read it again to restore it: twice a large
    model's weights and optimizer state in CPU memory. Counted with torch.load itself, in process."""
    import shutil

    from lit_rl import cli

    _, data, _, split = runs
    copy = tmp_path / "copy"
    shutil.copytree(split, copy)
    ckpt = copy / "checkpoints" / "last.ckpt"
    reads, load = [], torch.load

    def counted(f, *args, **kwargs):
        reads.append(str(getattr(f, "path", f)))  # the restore opens it through fsspec
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    cli.main(fit(copy, data, 7, "--ckpt_path", str(ckpt)))
    assert reads.count(str(ckpt)) == 1, reads
    assert 7 in stable_steps(copy)


def test_checkpoint_of_another_model_is_refused(runs, tmp_path, lit_rl_main):
    _, data, _, split = runs
    other = tmp_path / "other_model"
    other.mkdir()
    for f in Path(TINY_MODEL).iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config = json.loads((other / "config.json").read_text())
    config["hidden_size"] = 128
    (other / "config.json").write_text(json.dumps(config))
    before = snapshot(split)
    code, _, stderr = lit_rl_main(fit(split, data, 8, "--ckpt_path", "last", "--model.init_args.model", str(other)))
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "another model" in stderr and "hidden_size: checkpoint 256 vs model 128" in stderr
    assert snapshot(split) == before


def test_a_second_ctrl_c_mid_step_aborts_at_once(tmp_path, lit_rl_main):
    """Two Ctrl-C as step 3 starts: the run ends inside that step (the first alone would finish it
    and save), exit 130, the last line names the checkpoint of step 2, which stays as it was."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(64))
    root = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)
    try:
        code, _, stderr = lit_rl_main(fit(root, data, 10, "--trainer.callbacks+=online_eval_helpers.CtrlCTwice",
                                          "--trainer.callbacks.step=3", "--trainer.callbacks+=lit_rl.callbacks.RunCheckpoint",
                                          "--trainer.callbacks.every_n_train_steps=1"))
    finally:
        signal.signal(signal.SIGINT, before)
    assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    ckpt = root / "checkpoints" / "last.ckpt"
    assert f"aborted by a second Ctrl-C before the stop's checkpoint was written; the last checkpoint is {ckpt} (step 3)" in last, last
    assert torch.load(ckpt, weights_only=False, map_location="cpu")["global_step"] == 3
    assert max(losses(root)) == 2  # step 3 (the fourth) was never finished


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_a_resumable_checkpoint(tmp_path, sig, code):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(64))
    root = tmp_path / "run"
    args = fit(root, data, 10_000, "--trainer.callbacks.every_n_steps=1", "--trainer.callbacks.keep_last=null")  # the config's HFExport
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lit_rl.cli", *args], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while 3 not in stable_steps(root):
            assert proc.poll() is None and time.time() < deadline, "training did not reach step 3"
            time.sleep(0.2)
        os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C or a scheduler's SIGTERM: the whole group
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, output[-3000:]
    ckpt = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] >= 3
    assert not unfinished(root)  # no half-written step directory
    out = run(fit(root, data, ckpt["global_step"] + 1, "--ckpt_path", "last"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert max(losses(root)) == ckpt["global_step"]  # exactly one more step, numbered after the saved ones


def test_a_non_finite_gradient_stops_the_run_with_its_checkpoint_written(tmp_path, lit_rl_main):
    """A NaN loss at step 2 is a fatal error: the step is not applied, last.ckpt of step 2 is
    written first (its weights finite, equal to the step-2 export), and the run exits 1 with one
    message (cause, checkpoint, resume command; the traceback in error.log). Resumed, it goes on
    from step 2."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(64))
    root = tmp_path / "run"
    callbacks = [{"class_path": "lit_rl.callbacks.HFExport", "init_args": {"every_n_steps": 1}},
                 {"class_path": "online_eval_helpers.NaNLossAtStep", "init_args": {"step": 2}}]
    # launched as a requeued job is, with --ckpt_path last from its first launch: the empty directory starts fresh
    code, _, stderr = lit_rl_main(fit(root, data, 6, "--trainer.callbacks", json.dumps(callbacks), "--ckpt_path", "last"))
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert f"--ckpt_path last: no checkpoint yet in the run directory {root}: starting from step 0" in stderr
    ckpt_path = root / "checkpoints" / "last.ckpt"
    lines = stderr.strip().splitlines()
    assert "training step 2: the gradient norm is nan" in stderr, stderr[-3000:]
    assert f"resumable checkpoint written after the error: {ckpt_path} (step 2)" in stderr, stderr[-3000:]
    assert "error.log" in lines[-1] and "Traceback" in (root / "error.log").read_text()
    ckpt = torch.load(ckpt_path, weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 2 and max(losses(root)) == 1
    exported = load_file(root / "weights" / "step_2" / "model.safetensors")
    saved = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    assert exported and all(torch.equal(saved[k], v) for k, v in exported.items())  # the step was not applied
    code, _, stderr = lit_rl_main(fit(root, data, 4, "--ckpt_path", "last"))
    assert code == 0, stderr[-3000:]
    assert sorted(losses(root)) == [0, 1, 2, 3]  # the failed step was trained again, under its own number


def test_a_checkpoint_write_that_fails_names_the_file_and_keeps_the_one_before(tmp_path):
    """A real write failure (the file-size limit, as a full disk): the error names last.ckpt (it
    was a bare `OSError: [Errno 27] File too large`), the checkpoint before stays whole, no
    `.part` is left."""
    import resource

    import lightning as L

    from lit_rl.callbacks.checkpoint import RunCheckpoint
    from lit_rl.data.datamodules import StaticDataModule
    from lit_rl.modules.sft import SFT

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    module = SFT(model=TINY_MODEL, random_init=True, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = StaticDataModule(data, batch_size=4, num_workers=0, max_length=64, micro_batch_tokens=256)
    checkpoint = RunCheckpoint(every_n_train_steps=1)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, default_root_dir=str(tmp_path / "run"), callbacks=[checkpoint])
    trainer.fit(module, datamodule=dm)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, hard))
    try:
        with pytest.raises(OSError, match=rf"RunCheckpoint: could not write {last}: OSError: .*File too large"):
            checkpoint._save_checkpoint(trainer, str(last))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert last.read_bytes() == before and sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


def test_last_ckpt_reaches_the_disk_before_it_replaces_the_one_before(tmp_path, monkeypatch):
    """The rename of last.ckpt.part is atomic, but without an fsync before it a machine that loses
    power can be left with a last.ckpt whose data never reached the disk. The real os.fsync runs,
    watched: the part is flushed while last.ckpt is not there yet."""
    import lightning as L

    from lit_rl.callbacks.checkpoint import RunCheckpoint
    from lit_rl.data.datamodules import StaticDataModule
    from lit_rl.modules.sft import SFT

    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    flushed, fsync = [], os.fsync

    def watched(fd):
        flushed.append((os.readlink(f"/proc/self/fd/{fd}"), last.exists()))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    module = SFT(model=TINY_MODEL, random_init=True, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = StaticDataModule(data, batch_size=4, num_workers=0, max_length=64, micro_batch_tokens=256)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, default_root_dir=str(tmp_path / "run"), callbacks=[RunCheckpoint()])
    trainer.fit(module, datamodule=dm)
    assert last.is_file() and (f"{last}.part", False) in flushed, flushed
