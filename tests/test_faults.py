"""A run that survives its inference servers (faults injected at seeded moments, real CLI, real
vLLM on the tiny model).

GRPO with the policy's server started by lit-rl and one restart allowed:
- the server's engine process (the worker) is SIGKILLed inside the reload window: a seeded
  fraction of a second after the weight sync of step 1 or 2 began reloading it (a trainer-side
  helper times the kill); the runtime finds the server broken, starts it again on the same
  port serving the newest synced weights, the sync reloads the new server, the rollouts in
  flight are made again, and the run goes on;
- later the API process alone is SIGKILLed at a seeded moment (its engine is left behind,
  orphaned): no restart is left, so the run fails, with `last.ckpt` written first and one
  message (cause, checkpoint, resume), and what is left of the server stopped. (The whole
  server's process group killed at once, and a hung server, are in bench/faults.py.)
- resumed with `--ckpt_path last` (on the session's server), the trainer is SIGKILLed a step
  later (nothing saved), and resumed again from the same checkpoint, it finishes: every step
  trained once, each task's group once,
  versions within the staleness bound and continued from the checkpoint, no process left,
  every exported `weights/step_N` loads.

OPD with the student's server started by lit-rl: its engine is SIGKILLed as a seeded rollout
request goes out; the rollouts in flight are made again and the run finishes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest
from helpers import REPO, reverse_rows, write_jsonl
from safetensors.torch import load_file
from test_cli import metrics_rows, run
from test_graceful_stop import EXAMPLES, assert_resumed_exactly, processes_of, start, trained, wait_for

from lit_rl.run_dir import stable_steps

pytestmark = pytest.mark.slow
SEED = 24  # picks the moments of the kills
STEPS = 9


def server_processes(root) -> dict[int, list[int]]:
    """The policy server's processes (its API process first, then the engine's), by group."""
    pids = [int(p) for p in subprocess.run(["pgrep", "-f", f"vllm_main --model {root}"], capture_output=True,
                                           text=True).stdout.split()]
    assert pids, "no policy server found"
    api = pids[0]
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(api)], capture_output=True, text=True).stdout.split()]
    return {"api": [api], "engine": children}


def new_server(root, old_api: list[int]) -> bool:
    """Whether a server other than the one whose API process was `old_api` runs (maybe starting)."""
    try:
        found = server_processes(root)
    except AssertionError:
        return False
    return found["api"] != old_api and bool(found["engine"])


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def steps_trained(root) -> int:
    path = root / "rollouts" / "trained.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.long
def test_a_killed_policy_server_restarts_then_a_run_out_of_restarts_saves_and_resumes(vllm_server, tmp_path):

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(40))
    rng = random.Random(SEED)
    sync_step, in_sync = rng.choice([1, 2]), rng.uniform(0.0, 0.3)
    delay = rng.uniform(0.0, 1.0)
    root = tmp_path / "run"

    def args(*extra):
        return ["fit", "--config", str(EXAMPLES / "grpo.yaml"), "--model.init_args.model", str(vllm_server.model_dir),
                "--data.init_args.env.init_args.path", data, "--data.init_args.batch_size", "8",
                "--data.init_args.group_size", "4", "--data.init_args.max_tokens", "12",
                "--data.init_args.max_staleness", "1",  # rollouts in flight while the trainer trains and syncs
                "--inference.max_server_restarts", "1", "--inference.health_check_interval", "2",
                "--trainer.callbacks.init_args.every_n_steps", "2",
                "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(STEPS), *extra]

    def restarted(old_api: list[int], what: str) -> None:
        killed = time.monotonic()
        wait_for(proc, lambda: new_server(root, old_api), f"the server restarted after {what}", timeout=300, poll=0.5)
        restarted_at = steps_trained(root)
        # the batch after next is drawn after a weight sync that began once the restart had: served
        wait_for(proc, lambda: steps_trained(root) >= restarted_at + 2, "a step on the restarted server", timeout=300)
        print(f"{what}: a step on the restarted server {time.monotonic() - killed:.0f} s after the kill")

    began = time.monotonic()
    proc = start(args("--trainer.callbacks+=online_eval_helpers.KillPolicyEngineInSync",
                      f"--trainer.callbacks.step={sync_step}", f"--trainer.callbacks.delay={in_sync}"))
    try:
        wait_for(proc, lambda: new_server(root, []), "the policy server", poll=0.5)  # up before step 1
        first = server_processes(root)
        wait_for(proc, lambda: (root / "killed_in_sync").is_file(), f"the kill in the sync of step {sync_step}")
        print(f"the engine killed in the sync of step {sync_step} after {time.monotonic() - began:.0f} s")
        restarted(first["api"], "the engine killed in the reload")
        time.sleep(delay)
        last = server_processes(root)
        os.kill(last["api"][0], signal.SIGKILL)  # the API process alone
        killed = time.monotonic()
        _, err = proc.communicate(timeout=180)
        print(f"exit {time.monotonic() - killed:.0f} s after the last kill")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-4000:]
    assert "restarting it (restart 1 of at most 1)" in err and "vLLM server is back, serving the weights of step" in err, \
        err[-4000:]
    assert f'File "{REPO / "lit_rl"}' not in err, err[-4000:]  # no traceback of the trainer (the logs quoted may have some)
    assert "no restart is left (inference.max_server_restarts=1, 1 used)" in err, err[-4000:]
    ckpt = root / "checkpoints" / "last.ckpt"
    assert f"resumable checkpoint written after the error: {ckpt}" in err, err[-4000:]
    assert "--ckpt_path last" in err and (root / "error.log").is_file(), err[-3000:]
    step = len(trained(root))
    assert 0 < step < STEPS and f"(step {step})" in err, err[-3000:]  # every trained step is in the checkpoint
    restarts = [float(r["train/server_restarts"]) for r in metrics_rows(root) if r.get("train/server_restarts")]
    assert restarts and restarts[0] == 0.0 and restarts[-1] == 1.0 and restarts == sorted(restarts), restarts
    assert not processes_of(root), "processes left behind"
    assert last["engine"] and not [pid for pid in last["engine"] if alive(pid)], "the API process's engine was left"
    print(f"the server killed for good after step {step}")

    # Resumed on the session's server (the runtime makes it serve the checkpoint's weights: no
    # start), the trainer is SIGKILLed a step later: nothing is saved, so the last resume goes on
    # from the failure's checkpoint again, and trains the lost step again.
    began = time.monotonic()
    resumed = args("--ckpt_path", "last", "--inference.base_url", vllm_server.base_url, "--inference.server", "{}")
    proc = start(resumed)
    try:
        wait_for(proc, lambda: steps_trained(root) > step, f"step {step + 1}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = run(resumed)
    print(f"resumed, killed, resumed: {time.monotonic() - began:.0f} s")
    assert out.returncode == 0, out.stderr[-4000:]
    assert_resumed_exactly(root, step, STEPS, group_size=4, max_staleness=1)
    rolled_back = [json.loads(line)["step"] for line in open(root / "rollouts" / "trained.rolled_back.jsonl")]
    assert rolled_back and rolled_back[0] == step, rolled_back  # the killed run's step, set aside
    assert not processes_of(root)
    exported = stable_steps(root)
    assert exported, "no weights/step_N exported"
    for n in exported:  # every export the runs finished loads
        assert load_file(root / "weights" / f"step_{n}" / "model.safetensors")


@pytest.mark.long
def test_an_opd_students_server_killed_under_its_rollouts_restarts_and_they_are_made_again(vllm_server, tmp_path):
    """OPD with the student's server started by lit-rl and the session's server as the teacher:
    the student's engine is SIGKILLed just as a seeded rollout request goes out (a trainer-side
    helper times it), so that rollouts in flight fail. The server is restarted on the newest synced weights, the
    rollouts that were in flight are made again from the start (counted in `rollout/reissued`,
    scored by the teacher again), and the run finishes: every step trained once, each task's
    group once (nothing of a failed attempt trained), versions within the staleness bound, no
    process left."""
    steps = 4
    rng = random.Random(SEED + 1)
    request = rng.randint(9, 16)
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(40))
    root = tmp_path / "run"
    out = run(["fit", "--config", str(EXAMPLES / "opd.yaml"), "--model.init_args.model", str(vllm_server.model_dir),
               "--data.init_args.env.init_args.path", data, "--data.init_args.batch_size", "8",
               "--data.init_args.group_size", "2", "--data.init_args.max_tokens", "12",
               "--data.init_args.max_staleness", "1", "--model.init_args.teacher_top_k", "8",
               "--inference.teacher_model", "null", "--inference.teacher_server", "{}",
               "--inference.teacher_base_url", vllm_server.base_url, "--inference.max_server_restarts", "1",
               "--inference.health_check_interval", "2",
               "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps),
               "--trainer.callbacks+=online_eval_helpers.KillPolicyEngineInRollout",
               f"--trainer.callbacks.request={request}"],
              env={"PYTHONPATH": str(REPO / "tests")})
    assert out.returncode == 0, out.stderr[-4000:]
    assert (root / "killed_in_rollout").read_text().startswith(f"{request} ")
    err = out.stderr
    assert "the policy's vLLM server" in err and "restarting it (restart 1 of at most 1)" in err, err[-4000:]
    assert "the policy's vLLM server is back, serving the weights of step" in err, err[-4000:]
    assert_resumed_exactly(root, 0, steps, group_size=2, max_staleness=1)
    rows = [r for r in metrics_rows(root) if r.get("train/divergence")]
    assert len(rows) == steps and all(float(r["rollout/teacher_s_per_group"]) > 0 for r in rows)
    restarts = [float(r["train/server_restarts"]) for r in metrics_rows(root) if r.get("train/server_restarts")]
    assert restarts and restarts[-1] == 1.0, restarts
    reissued = [float(r["rollout/reissued"]) for r in metrics_rows(root) if r.get("rollout/reissued")]
    assert reissued and reissued[-1] >= 1, reissued  # the killed request, at least, made again
    assert not processes_of(root), "processes left behind"
