"""GRPO through the real CLI with a real vLLM server: the staleness bound holds, a resumed run
continues the version count and trains no sample twice (a server that dies mid-run: test_faults.py).

The bound and resume test uses the session's shared server (`inference.base_url`): the run's
weight sync reloads it from the run directory, and the fixture restores its weights afterwards.
"""

import csv
import json
import random
from pathlib import Path

import pytest
import torch

from helpers import REPO, reverse_rows, write_jsonl
from test_cli import run

pytestmark = pytest.mark.slow
CONFIG = str(REPO / "examples" / "reverse_text" / "grpo.yaml")


def grpo_args(root: Path, data: str, model: str, steps: int, *extra: str) -> list[str]:
    return [
        "fit", "--config", CONFIG,
        "--model.init_args.model", model,
        "--data.init_args.env.init_args.path", data,
        "--data.init_args.batch_size", "8", "--data.init_args.group_size", "4",
        "--data.init_args.max_tokens", "12",
        "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps),
        *extra,
    ]


def shared(vllm_server) -> list[str]:
    return ["--inference.base_url", vllm_server.base_url, "--inference.server", "{}"]


def trained(root: Path) -> list[dict]:
    return [json.loads(line) for line in open(root / "rollouts" / "trained.jsonl")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("grpo_data") / "train.jsonl", reverse_rows(40))


@pytest.mark.parametrize("max_staleness, updates_per_batch", [(0, 1), (1, 2)])
def test_staleness_bound_holds_and_a_resume_continues_versions_and_trains_no_sample_twice(
        vllm_server, data, tmp_path, max_staleness, updates_per_batch):
    """Four steps in two runs (one test: both runs would otherwise be repeated). One update per
    batch: two steps, then a resume to four. Two updates per batch (batch k feeds steps 2k and
    2k + 1): three steps, so the checkpoint falls between the two updates of batch 1, then a
    resume that trains that held batch's second update."""
    root, held = tmp_path / "run", updates_per_batch > 1
    common = [*shared(vllm_server), "--data.init_args.max_staleness", str(max_staleness),
              "--model.init_args.updates_per_batch", str(updates_per_batch)]
    # the task order follows the run's seed (no data.seed), and a resume keeps the order it started with
    first = run(grpo_args(root, data, str(vllm_server.model_dir), 3 if held else 2, *common, "--seed_everything", "7"))
    assert first.returncode == 0, first.stderr[-4000:]
    # an RL run has no validation loader by design: Lightning's warning about it is not printed
    assert "have no `val_dataloader`" not in first.stdout + first.stderr
    second = run(grpo_args(root, data, str(vllm_server.model_dir), 4, *common, "--ckpt_path", "last",
                           "--seed_everything", "8"))
    assert second.returncode == 0, second.stderr[-4000:]
    if not held:  # (the held batch's resume draws no new task: no task order is asked for)
        assert "data.seed: resuming the order of seed 7, the one the run started with" in second.stdout + second.stderr
    runs = [[r for r in csv.DictReader(open(path)) if r.get("train/staleness_max")]
            for path in sorted(root.glob("logs/version_*/metrics.csv"))]
    assert [len(rows) for rows in runs] == ([3, 1] if held else [2, 2])
    rows = [r for rows in runs for r in rows]
    assert all(float(r["train/staleness_max"]) <= max_staleness for r in rows)
    for r in rows:  # the whole GRPO story is in the log
        for name in ("train/reward", "train/mismatch_kl", "train/entropy", "train/advantage_std", "train/data_wait_s",
                     "train/compute_s", "rollout/tokens_per_s", "train/clip_fraction"):
            assert r.get(name) not in (None, ""), name
    for run_rows in runs:  # synced after every step but a run's last
        syncs = [float(r["train/weight_sync_s"]) for r in run_rows]
        assert all(x > 0 for x in syncs[:-1]) and syncs[-1] == 0.0, syncs
    steps = trained(root)
    # a batch is traced at the step that draws it: every step, or every other one
    assert [s["step"] for s in steps] == ([0, 2] if held else [0, 1, 2, 3])
    for s in steps:
        assert all(s["step"] - x["policy_version"] <= max_staleness for x in s["samples"])
    draws = [x["draw"] for s in steps for x in s["samples"]]
    groups = {d: draws.count(d) for d in draws}
    assert all(n == 4 for n in groups.values())  # each drawn task's group trained once, whole
    order = list(range(40))  # the 40 tasks' first pass in seed 7's order (RolloutBuffer's shuffle)
    random.Random("lit-rl:7:0").shuffle(order)
    assert all(x["task_index"] == order[x["draw"]] for s in steps for x in s["samples"]), steps
    if held:  # the resumed step trained the batch of the step before it, with the trust region live
        before, after = rows[2], rows[3]
        assert [float(before[k]) for k in ("train/reward", "train/tokens")] == [
            float(after[k]) for k in ("train/reward", "train/tokens")]
        assert float(before["train/clip_fraction"]) == 0.0  # a batch's first update: ratio 1
        # the sampler against the batch's first-update weights: the same old logprobs, kept in the
        # checkpoint (recomputed under the weights after update 0, they would differ)
        assert float(after["train/mismatch_kl"]) == pytest.approx(float(before["train/mismatch_kl"]), rel=1e-6)
        assert float(after["train/entropy"]) != float(before["train/entropy"])  # other weights, same samples
        return
    # a resume with another batch shape is refused by its flags before anything is trained or written
    ckpt = root / "checkpoints" / "last.ckpt"
    before = ckpt.stat().st_mtime_ns
    third = run(grpo_args(root, data, str(vllm_server.model_dir), 5, *common, "--ckpt_path", "last",
                          "--data.init_args.group_size", "2"))
    assert third.returncode == 1 and "data.group_size: saved 4, this run has 2" in third.stderr, third.stderr[-4000:]
    assert ckpt.stat().st_mtime_ns == before and len(trained(root)) == 4
    # A launch that trained step 4 and was killed before its checkpoint left step 4 in the trace; the
    # resume at max_steps 4 trains nothing, and the step stayed listed as trained (a resume that draws a
    # batch rewinds the traces there, this one draws none).
    trace = root / "rollouts" / "trained.jsonl"
    with open(trace, "a") as f:
        f.write(json.dumps({"step": 4, "batch": 4, "samples": []}) + "\n")
    fourth = run(grpo_args(root, data, str(vllm_server.model_dir), 4, *common, "--ckpt_path", "last"))
    assert fourth.returncode == 0, fourth.stderr[-4000:]
    assert [s["step"] for s in trained(root)] == [0, 1, 2, 3]
    assert [json.loads(line)["step"] for line in open(root / "rollouts" / "trained.rolled_back.jsonl")] == [4]
    assert min(x["policy_version"] for x in steps[3]["samples"]) >= 2  # versions continued, not restarted at 0
    assert max(float(r["rollout/policy_version"]) for r in runs[1]) >= 2
    if max_staleness == 0:  # synchronous: every batch was sampled by exactly the weights it trains,
        assert all(x["policy_version"] == s["step"] for s in steps for x in s["samples"])
        assert all(float(r["train/mismatch_kl"]) < 1e-3 for r in rows)  # before and after the resume


def test_two_ranks_share_each_batch_of_a_dataset_with_reward_functions_and_resume_mid_batch(vllm_server, tmp_path):
    """Two CPU processes (DDP): rank 0 drives the buffer, every rank trains a half of every batch.
    The step's trained tokens (summed over ranks) are the batch's completion tokens, and the
    samples each rank traced as trained are disjoint halves that together make up rank 0's batch.
    The tasks are a jsonl of prompt/answer rows with two built-in rewards, all from the command
    line (DatasetEnv): each reward is logged beside their weighted sum. Two updates per batch:
    three steps, so the checkpoint falls between the two updates of batch 1 (every rank's old
    logprobs gathered into it), then a resume whose step trains that held batch's second update.
    In the resumed run the grader then fails (`on_failure: raise`): rank 0's rollout error reaches
    rank 1 too, both write `last.ckpt` of step 4 together, and the run exits 1 naming it."""
    root = tmp_path / "run"
    rows = [{"prompt": f"Reverse: {r['messages'][0]['content']}", "answer": r["messages"][0]["content"][::-1]}
            for r in reverse_rows(40)]
    env = {"class_path": "lit_rl.rollouts.DatasetEnv", "init_args": {
        "path": write_jsonl(tmp_path / "prompts.jsonl", rows),
        "rewards": ["lit_rl.rewards.exact_match",
                    {"function": "lit_rl.rewards.length_penalty", "weight": 0.5, "kwargs": {"max_length": 12, "buffer_length": 8}},
                    # the random model's 12 characters: about half of them hold one of a-m, so groups differ
                    {"function": "lit_rl.rewards.regex_match", "weight": 0.25, "name": "a_to_m", "kwargs": {"pattern": "[a-m]"}}]}}

    def args(steps: int, *extra: str, env: dict = env) -> list[str]:
        out = grpo_args(root, "unused", str(vllm_server.model_dir), steps, *shared(vllm_server), "--trainer.devices",
                        "2", "--trainer.strategy", "ddp", "--model.init_args.updates_per_batch", "2", *extra)
        at = out.index("--data.init_args.env.init_args.path")
        out[at: at + 2] = ["--data.init_args.env", json.dumps(env)]
        return out

    first = run(args(3))
    assert first.returncode == 0, first.stderr[-4000:]
    failing = {**env, "init_args": {**env["init_args"], "rewards": [*env["init_args"]["rewards"], "reward_fns.grader_down"]}}
    second = run(args(6, "--ckpt_path", "last", "--data.init_args.on_failure", "raise", "--data.init_args.num_retries",
                      "0", env=failing), env={"PYTHONPATH": str(REPO / "tests")})
    ckpt = root / "checkpoints" / "last.ckpt"
    assert second.returncode == 1 and "the grader is down" in second.stderr, second.stderr[-4000:]
    assert f"resumable checkpoint written after the error: {ckpt} (step 4)" in second.stderr, second.stderr[-4000:]
    assert torch.load(ckpt, weights_only=False, map_location="cpu")["global_step"] == 4  # both ranks saved it
    runs = [[r for r in csv.DictReader(open(path)) if r.get("train/staleness_max")]
            for path in sorted(root.glob("logs/version_*/metrics.csv"))]
    assert [len(r) for r in runs] == [3, 1]
    rows = [r for run_rows in runs for r in run_rows]
    batches = trained(root)  # steps 0-1 train batch 0, steps 2-3 batch 1
    for step, r in enumerate(rows):
        batch_tokens = float(r["train/completion_length"]) * 8  # mean completion tokens x batch_size
        assert float(r["train/tokens"]) == pytest.approx(batch_tokens), r
        parts = (float(r["train/reward/exact_match"]) + 0.5 * float(r["train/reward/length_penalty"])
                 + 0.25 * float(r["train/reward/a_to_m"]))
        assert float(r["train/reward"]) == pytest.approx(parts, abs=1e-6), r
        groups = {}
        for sample in batches[step // 2]["samples"]:
            groups.setdefault(sample["draw"], set()).add(sample["reward"])
        # a step learns exactly when some group's rewards differ (the random model's 12 characters
        # hold one of a-m about half the time, so most do; all equal leaves no advantage at all)
        assert (float(r["train/grad_norm"]) > 0) == any(len(g) > 1 for g in groups.values()), (r, groups)
    assert any(float(r["train/reward/length_penalty"]) < 0 for r in rows)  # some of the 12 tokens are penalised
    # the resumed step trained batch 1 again with the old logprobs of its first update, on both ranks
    before, after = rows[2], rows[3]
    assert [float(before[k]) for k in ("train/reward", "train/tokens")] == [
        float(after[k]) for k in ("train/reward", "train/tokens")]
    assert float(after["train/mismatch_kl"]) == pytest.approx(float(before["train/mismatch_kl"]), rel=1e-6)
    assert float(after["train/entropy"]) != float(before["train/entropy"])  # other weights, same samples
    assert [s["step"] for s in trained(root)] == [0, 2]  # a batch is drawn (and traced) at its first step
    shares = [[json.loads(line) for line in open(root / "rollouts" / f"trained_rank{r}.jsonl")] for r in (0, 1)]
    for batch, half0, half1 in zip(trained(root), *shares, strict=True):
        assert half0["step"] == half1["step"] == batch["step"]
        ids0, ids1 = ({tuple(i) for i in half["samples"]} for half in (half0, half1))
        assert len(ids0) == len(ids1) == 4
        assert not ids0 & ids1, (half0, half1)
        assert ids0 | ids1 == {(s["draw"], s["member"]) for s in batch["samples"]}


def test_a_step_that_fails_after_drawing_its_batch_resumes_on_that_batch(vllm_server, data, tmp_path):
    """A NaN loss at step 2, the first of batch 1's two updates: the batch was drawn (the buffer's
    state has moved past it), so the failure's checkpoint keeps it and the resumed run trains
    it, both updates, where the run without the failure would have; the trust region's old
    logprobs are the resumed first update's own, against the weights that sampled it (max_staleness 0)."""
    root = tmp_path / "run"
    callbacks = [{"class_path": "online_eval_helpers.NaNLossAtStep", "init_args": {"step": 2}}]
    common = [*shared(vllm_server), "--data.init_args.max_staleness", "0", "--model.init_args.updates_per_batch", "2"]
    first = run(grpo_args(root, data, str(vllm_server.model_dir), 4, *common, "--trainer.callbacks", json.dumps(callbacks)),
                env={"PYTHONPATH": str(REPO / "tests")})  # the callback's module
    assert first.returncode == 1 and "(step 2)" in first.stderr, first.stderr[-4000:]
    drawn = trained(root)
    assert [s["step"] for s in drawn] == [0, 2]
    second = run(grpo_args(root, data, str(vllm_server.model_dir), 4, *common, "--ckpt_path", "last"))
    assert second.returncode == 0, second.stderr[-4000:]
    assert trained(root) == drawn  # the failed step's batch, not a new one
    rows = [r for r in csv.DictReader(open(sorted(root.glob("logs/version_*/metrics.csv"))[-1]))
            if r.get("train/reward")]
    assert [int(r["step"]) for r in rows] == [2, 3]
    assert float(rows[0]["train/clip_fraction"]) == 0.0 and float(rows[0]["train/mismatch_kl"]) < 1e-3
    assert rows[0]["train/tokens"] == rows[1]["train/tokens"]
