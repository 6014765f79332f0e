"""A SIGTERM or Ctrl-C during an RL run saves a resumable checkpoint before any server stops,
exits 143 / 130 with one line saying how to resume, and leaves no process behind; the resumed
run continues the version count and trains no sample twice.

Through the real CLI with real vLLM servers, at seeded moments:
- GRPO with a server lit-rl starts and online evals: SIGTERM to the trainer alone, during a
  weight sync; the evaluator stops only after the checkpoint is written.
- OPD with a teacher lit-rl starts: SIGTERM to the whole job (the trainer's process group and
  the teacher's, as a cluster scheduler does), whatever the trainer is doing at that moment.
  Resumed, it is stopped by two Ctrl-C: the second aborts the first's save at once.
- SFT on a teacher's completions: Ctrl-C, then resume.
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from forked_cli import ForkedCLI
from helpers import REPO, TINY_MODEL, reverse_rows, write_jsonl
from test_cli import metrics_rows, run
from vllm_fixtures import write_tiny_checkpoint

from lit_rl.data.rollout_datamodule import ENDLESS

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples" / "reverse_text"
SEED = 26  # picks the step each test stops at
STEPS = 5  # of each run, stopped at step 2 or 3 and resumed to the end


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("stop_data") / "train.jsonl", reverse_rows(40))


def start(args: list[str]) -> ForkedCLI:
    """The CLI in its own session and process group (as a job under a scheduler), output captured;
    the test-only callbacks of tests/ importable by class path."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "tests")}
    return ForkedCLI(args, env, str(REPO), new_session=True)


def wait_for(proc: ForkedCLI, ready, what: str, timeout: float = 300, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.communicate()[1][-4000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(poll)


def stop_and_wait(proc: ForkedCLI, groups: list[int], sig: int) -> tuple[str, float]:
    """Send `sig` to each process group, wait for the trainer; its stderr and seconds to exit."""
    sent = time.monotonic()
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return err, time.monotonic() - sent


def processes_of(path: Path) -> list[str]:
    return subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True).stdout.split()


def groups_of(path: Path) -> set[int]:
    """The process groups of the processes with `path` in their command line (as servers are)."""
    groups = set()
    for pid in processes_of(path):
        try:
            groups.add(os.getpgid(int(pid)))
        except ProcessLookupError:  # gone since pgrep saw it
            pass
    return groups


def first_line(text: str, words: str) -> int:
    """Index of the first line of `text` with `words` (an AssertionError quoting the text if none)."""
    found = [i for i, line in enumerate(text.splitlines()) if words in line]
    assert found, f"no line with {words!r} in:\n{text[-4000:]}"
    return found[0]


def trained(root: Path) -> list[dict]:
    return [json.loads(line) for line in open(root / "rollouts" / "trained.jsonl")]


def saved_checkpoint(root: Path) -> dict:
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")  # our own file


def assert_stopped_cleanly(err: str, code: int, returncode: int, root: Path, took: float) -> int:
    """Exit code, the last line, no traceback, the checkpoint of a whole step; its step."""
    assert returncode == code, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert "resumable checkpoint" in last and "--ckpt_path last" in last, err[-3000:]
    assert "Traceback" not in err, err[-4000:]
    ckpt = saved_checkpoint(root)
    step = int(ckpt["global_step"])
    batches = trained(root)
    assert [s["step"] for s in batches] == list(range(step))  # every trained step is in the checkpoint
    buffer = ckpt["RolloutDataModule"].get("buffer")  # the rollouts' state as it was at the stop
    assert buffer is not None and buffer["cursor"] > max(x["draw"] for s in batches for x in s["samples"]), buffer
    print(f"exit {returncode} {took:.1f} s after the signal; saved at step {step}")
    assert took < 60, f"{took:.0f} s from the signal to the exit"
    return step


def assert_resumed_exactly(root: Path, stopped_at: int, steps: int, group_size: int, max_staleness: int) -> None:
    """The resumed run trained steps stopped_at..steps-1, each task's group exactly once, with
    policy versions that went on from the checkpoint's."""
    batches = trained(root)
    assert [s["step"] for s in batches] == list(range(steps))
    draws = [x["draw"] for s in batches for x in s["samples"]]
    assert all(draws.count(d) == group_size for d in draws), sorted(draws)  # no sample twice, no group split
    for s in batches:
        assert all(s["step"] - max_staleness <= x["policy_version"] <= s["step"] for x in s["samples"]), s
    assert min(x["policy_version"] for x in batches[-1]["samples"]) >= stopped_at  # not restarted at 0


def grpo_with_evals(tmp_path: Path, vllm_server, data: str) -> str:
    """grpo.yaml plus online evals every 2 steps, whose evaluator uses the session's server."""
    config = yaml.safe_load(open(EXAMPLES / "grpo.yaml"))
    config["trainer"]["callbacks"].append({
        "class_path": "lit_rl.callbacks.OnlineEval",
        "init_args": {"interval": 2, "base_url": vllm_server.base_url, "final_timeout": 300,
                      "envs": [{"class_path": "lit_rl.rollouts.ReverseTextEnv",
                                "init_args": {"path": data, "num_examples": 5}}]},
    })
    path = tmp_path / "grpo_evals.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.long
def test_sigterm_during_a_grpo_weight_sync_saves_before_servers_and_evaluator_stop(vllm_server, data, tmp_path):
    """The rollouts' server is one lit-rl starts (its SIGTERM used to stop it first, so the next
    reload failed and nothing was saved); the evaluator serves the session's server. Also shows
    that online evals score GRPO's own weights: base, interval and final steps, with the
    evaluator's policy_version equal to the step."""
    stop_at = random.Random(SEED).choice([1, 3])  # steps with no eval export: the sync writes sync/step_N
    config, root = grpo_with_evals(tmp_path, vllm_server, data), tmp_path / "run"

    def args(steps, *extra):
        return ["fit", "--config", config, "--model.init_args.model", str(vllm_server.model_dir),
                "--data.init_args.env.init_args.path", data, "--data.init_args.batch_size", "8",
                "--data.init_args.group_size", "4", "--data.init_args.max_tokens", "12",
                "--data.init_args.max_staleness", "1",  # rollouts in flight while the weights sync
                "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps), *extra]

    proc = start(args(STEPS))
    sync = [root / "sync" / f".step_{stop_at}.tmp", root / "sync" / f"step_{stop_at}"]
    wait_for(proc, lambda: any(p.exists() for p in sync), f"the weight sync of step {stop_at}")
    err, took = stop_and_wait(proc, [proc.pid], signal.SIGTERM)  # the trainer's group: not the servers'
    step = assert_stopped_cleanly(err, 143, proc.returncode, root, took)
    assert step == stop_at, err[-3000:]  # the step whose weights were being synced was kept, not lost
    saved = first_line(err, "checkpoint written")
    for later in ("InferenceRuntime: stopping the evaluator", "InferenceRuntime: stopping the inference servers"):
        assert saved < first_line(err, later), err[-4000:]  # saved first, then the evaluator and servers stopped
    assert not processes_of(root), "processes left behind"

    out = run(args(STEPS, "--ckpt_path", "last"))
    assert out.returncode == 0, out.stderr[-4000:]
    assert_resumed_exactly(root, step, STEPS, group_size=4, max_staleness=1)
    done = {d["step"]: d["status"] for d in map(json.loads, open(root / "evals" / "done.jsonl"))}
    assert done[0] == "ok" and done[STEPS] == "ok", done
    assert all(done.get(s) in ("ok", "skipped") for s in range(2, STEPS, 2)), done  # interval steps
    assert (root / "evals" / f"step_{STEPS}" / "reverse_text.jsonl").is_file()
    versions = {int(row["step"]): float(row["value"]) for path in root.glob("logs/version_*/eval_metrics.csv")
                for row in csv.DictReader(open(path)) if row["name"] == "eval/reverse_text/policy_version"}
    assert versions[0] == 0.0 and versions[STEPS] == STEPS, versions  # the evaluator served the run's steps
    assert not processes_of(root)


@pytest.mark.long
def test_sigterm_to_the_whole_opd_job_saves_and_resumes(vllm_server, data, tmp_path):
    """The student is the session's server; the teacher a server lit-rl starts on sharp weights
    (logits x8: a reverse KL of 3-4 nats, where two random inits give 0.01-0.14). After the first
    step the teacher's server is SIGKILLed: it is restarted and its scoring made again (issue 24).
    Then SIGTERM reaches the trainer and the teacher together, at a seeded moment: the teacher's
    dying is the stop, not a failure. The loss is the dense reverse KL over the teacher server's top 8 tokens and a tail
    bin (the top-k path end to end). Resumed, the run is stopped by two Ctrl-C (the second aborts
    the first's save), then resumed to the end with the session's server as its teacher (the
    resume is what is checked there, not the teacher)."""
    steps = STEPS + 2  # the teacher's restart comes first: the stop lands at step 3-5
    rng = random.Random(SEED + 1)
    stop_after, delay = rng.choice([1, 2]), rng.uniform(0.0, 1.0)
    teacher = write_tiny_checkpoint(tmp_path / "teacher", seed=1, logit_scale=8.0)
    root = tmp_path / "run"

    def args(steps, *extra):
        return ["fit", "--config", str(EXAMPLES / "opd.yaml"), "--model.init_args.model", str(vllm_server.model_dir),
                "--data.init_args.env.init_args.path", data, "--data.init_args.batch_size", "8",
                "--data.init_args.group_size", "2", "--data.init_args.max_tokens", "12",
                "--data.init_args.max_staleness", "1",  # rollouts run ahead of training when the stop comes
                "--inference.base_url", vllm_server.base_url, "--inference.server", "{}",
                "--model.init_args.divergence", "reverse_kl", "--model.init_args.teacher_top_k", "8",
                "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps), *extra]

    proc = start(args(steps, "--inference.teacher_model", str(teacher)))
    trace = root / "rollouts" / "trained.jsonl"
    wait_for(proc, trace.exists, "the first step")
    teachers = groups_of(teacher) - {proc.pid}  # the trainer's command line names the teacher too
    assert teachers, "the teacher's server was not found"
    for pgid in teachers:  # the teacher's server crashes mid-run: restarted, its scoring made again
        os.killpg(pgid, signal.SIGKILL)
    log = root / "vllm_teacher.log"  # one "Application startup complete" per start
    wait_for(proc, lambda: log.read_text().count("Application startup complete") >= 2, "the teacher's restart", poll=0.5)
    # it only scores: served without a tokenizer (runtime.scoring_only), at the start and the restart
    assert "skip_tokenizer_init=True" in log.read_text() and "skip_tokenizer_init=False" not in log.read_text()
    time.sleep(2.0 + delay)  # the runtime sees it healthy within 0.5 s; the run goes on
    teachers = groups_of(teacher) - {proc.pid}
    err, took = stop_and_wait(proc, [proc.pid, *teachers], signal.SIGTERM)
    assert ENDLESS not in err  # max_steps set
    assert "the teacher's vLLM server exited" in err and "restarting it (restart 1 of at most 3)" in err, err[-4000:]
    assert "the teacher's vLLM server is back, serving the teacher" in err, err[-4000:]
    step = assert_stopped_cleanly(err, 143, proc.returncode, root, took)
    rows = [r for r in metrics_rows(root) if r.get("train/divergence")]
    assert len(rows) == step >= stop_after  # the sharp teacher's top 8 and tail, against the student's
    assert all(float(r["train/divergence"]) > 0.5 and float(r["rollout/teacher_s_per_group"]) > 0 for r in rows)
    assert (root / "vllm_teacher.log").is_file() and not processes_of(teacher) and not processes_of(root)

    # Resumed, then Ctrl-C, then Ctrl-C again while the first one's checkpoint is being written (a
    # save made to take ten minutes): the second aborts at once, exit 130 naming the checkpoint
    # there still is (the SIGTERM's, untouched), the teacher stopped all the same.
    saving, ckpt = tmp_path / "saving", root / "checkpoints" / "last.ckpt"
    slow = json.dumps({"class_path": "online_eval_helpers.SlowStopSave", "init_args": {"marker": str(saving)}})
    before = ckpt.read_bytes()
    proc = start(args(steps, "--ckpt_path", "last", "--inference.teacher_model", str(teacher),
                      "--trainer.callbacks+", slow, "--trainer.max_steps", "-1"))  # endless: the signals stop it
    wait_for(proc, lambda: len(trace.read_text().splitlines()) > step, f"step {step + 1}")
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(proc, saving.exists, "the stop's checkpoint")
    err, took = stop_and_wait(proc, [proc.pid], signal.SIGINT)
    assert proc.returncode == 130 and "Traceback" not in err, err[-4000:]
    assert err.count(ENDLESS) == 1, err[-4000:]  # a run without max_steps says it trains until stopped
    last = err.strip().splitlines()[-1]
    assert "aborted by a second Ctrl-C before the stop's checkpoint was written" in last, err[-3000:]
    assert f"{ckpt} (step {step})" in last and "--ckpt_path last" in last, last
    print(f"second Ctrl-C: exit 130 {took:.1f} s after it")
    assert took < 30, f"{took:.0f} s from the second Ctrl-C to the exit"
    assert ckpt.read_bytes() == before and not list(ckpt.parent.glob("*.part"))
    assert not processes_of(teacher) and not processes_of(root)
    # the resumed run's teacher server sampled from seed_everything (0) + the step it started at
    assert f"seed={step}," in (root / "vllm_teacher.log").read_text()

    out = run(args(steps, "--ckpt_path", "last", "--inference.teacher_model", "null",
                   "--inference.teacher_server", "{}", "--inference.teacher_base_url", vllm_server.base_url))
    assert out.returncode == 0, out.stderr[-4000:]
    assert_resumed_exactly(root, step, steps, group_size=2, max_staleness=1)
    rolled_back = [json.loads(line)["step"] for line in open(root / "rollouts" / "trained.rolled_back.jsonl")]
    assert rolled_back and rolled_back[0] == step, rolled_back  # the aborted run's steps, set aside


def test_ctrl_c_during_sft_on_a_teachers_completions_saves_and_resumes(vllm_server, data, tmp_path):
    """The session's server is the teacher (nothing reloads it). The run trains the teacher's
    tokens, stops on Ctrl-C with code 130, and the resumed run finishes with every teacher group
    trained once; HFExport still writes the student's checkpoints."""
    root = tmp_path / "run"

    def args(steps, *extra):
        return ["fit", "--config", str(EXAMPLES / "sft_teacher.yaml"), "--model.init_args.model", TINY_MODEL,
                "--model.init_args.random_init", "true", "--data.init_args.env.init_args.path", data,
                "--data.init_args.batch_size", "4", "--data.init_args.group_size", "2",
                "--data.init_args.max_tokens", "8", "--inference.teacher_model", "null",
                "--inference.teacher_server", "{}", "--inference.teacher_base_url", vllm_server.base_url,
                "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps), *extra]

    proc = start(args(STEPS))
    trace = root / "rollouts" / "trained.jsonl"
    wait_for(proc, lambda: trace.exists() and len(trace.read_text().splitlines()) >= 2, "step 2")
    err, took = stop_and_wait(proc, [proc.pid], signal.SIGINT)
    assert_stopped_cleanly(err, 130, proc.returncode, root, took)
    out = run(args(STEPS, "--ckpt_path", "last"))
    assert out.returncode == 0, out.stderr[-4000:]
    batches = trained(root)
    assert [s["step"] for s in batches] == list(range(STEPS)) and all(len(s["samples"]) == 4 for s in batches)
    draws = [x["draw"] for s in batches for x in s["samples"]]
    assert all(draws.count(d) == 2 for d in draws), sorted(draws)
    rows = [r for r in metrics_rows(root) if r.get("train/loss")]
    for r in rows:
        assert float(r["train/tokens"]) == pytest.approx(float(r["train/completion_length"]) * 4)  # the teacher's tokens
        assert float(r["train/staleness_max"]) == 0.0 and float(r["train/loss"]) > 0  # teacher samples never age
    assert (root / "weights" / f"step_{STEPS}").is_dir()  # HFExport still writes the student's checkpoints
