"""Mixed sources through the real CLI: GRPO rollouts from a real vLLM server plus replay rows of
a static dataset in every batch, both losses logged, and a resumed run that continues the
replay order without repeating a row; bad replay options are all reported before any server."""

import json

import pytest

from helpers import reverse_rows, write_jsonl
from lit_rl.data.sampler import row_order
from test_cli import metrics_rows, run
from test_grpo_cli import grpo_args, shared, trained


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("mixed_data") / "train.jsonl", reverse_rows(40))


def replay(*sources: dict) -> list[str]:
    return ["--data.init_args.replay", json.dumps(list(sources))]


def test_every_replay_problem_is_reported_at_once_before_any_server(data, tmp_path, lit_rl_main):
    root = tmp_path / "run"
    code, _, err = lit_rl_main(grpo_args(root, data, "lit-rl:tiny_qwen3", 2, "--model.init_args.random_init", "true",
                                         *replay({"path": data, "group_size": 16},
                                                 {"path": str(tmp_path / "missing.jsonl")},
                                                 {"path": data, "name": "policy", "weight": 0})))
    assert code != 0
    assert "data.replay[0].group_size is 16" in err, err[-3000:]
    assert "data.replay[1].name 'replay' is already the name of another source" in err
    assert "data.replay[1] (" in err and "no such file" in err  # names the source and the file
    assert "data.replay[2].weight must be > 0" in err
    assert "data.replay[2].name 'policy' is already the name" in err
    assert not (root / "vllm.log").exists()  # nothing was started


def test_a_replay_max_length_beyond_the_step_layout_is_refused_before_any_server(data, tmp_path, lit_rl_main):
    """A replay row longer than a micro-batch would stop the run at the step that draws it (packing
    raises "does not fit"), naming neither the source nor its option: refuse it at start-up."""
    root = tmp_path / "run"
    code, _, err = lit_rl_main(grpo_args(root, data, "lit-rl:tiny_qwen3", 2, "--model.init_args.random_init", "true",
                                         "--data.init_args.micro_batch_tokens", "512",
                                         *replay({"path": data}, {"path": data, "name": "short", "max_length": 256})))
    assert code != 0
    assert "data.replay[0].max_length (2048) exceeds data.micro_batch_tokens (512)" in err, err[-3000:]
    assert "data.replay[1]" not in err  # a source that fits is not blamed
    code, _, err = lit_rl_main(grpo_args(root, data, "lit-rl:tiny_qwen3", 2, "--model.init_args.random_init", "true",
                                         "--data.init_args.packing", "packed", "--data.init_args.pack_length", "512",
                                         *replay({"path": data})))
    assert code != 0
    assert "data.replay[0].max_length (2048) exceeds data.pack_length (512)" in err, err[-3000:]
    assert not (root / "vllm.log").exists()  # nothing was started


@pytest.mark.slow
def test_grpo_with_replay_logs_both_losses_and_resumes_the_replay_order(vllm_server, data, tmp_path):
    """12 samples a step: 8 rollouts (2 groups of 4) and 4 replay rows (weights 2:1); the
    second launch resumes at step 2 and trains the next rows of the same shuffled order: the one
    of the first launch's seed (the replay source sets none), though the second has another."""
    root = tmp_path / "run"
    common = [*shared(vllm_server), "--data.init_args.batch_size", "12", "--data.init_args.weight", "2",
              *replay({"path": data, "weight": 1})]
    first = run(grpo_args(root, data, str(vllm_server.model_dir), 2, *common, "--seed_everything", "3"))
    assert first.returncode == 0, first.stderr[-4000:]
    assert "policy 8 samples (policy_gradient), replay 4 samples (cross_entropy)" in first.stderr
    second = run(grpo_args(root, data, str(vllm_server.model_dir), 4, *common, "--ckpt_path", "last",
                           "--seed_everything", "4"))
    assert second.returncode == 0, second.stderr[-4000:]
    steps = trained(root)
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(len(s["samples"]) == 8 for s in steps)
    rows = [r for s in steps for r in s["replay"]["replay"]]
    assert rows == row_order(40, 0, shuffle=True, seed=3)[:16]  # in order, none repeated or skipped on resume
    logged = [r for r in metrics_rows(root) if r.get("train/replay/loss")]  # the resumed launch's log
    assert len(logged) == 2
    for r in logged:
        assert float(r["train/replay/loss"]) > 0 and r.get("train/policy/loss") not in (None, "")
        assert float(r["train/replay/rows"]) == 4 and float(r["train/policy/rows"]) == 8
        assert float(r["train/tokens"]) == float(r["train/replay/tokens"]) + float(r["train/policy/tokens"])
        # reward and policy metrics come from the rollouts only
        assert r.get("train/reward") not in (None, "") and r.get("train/policy/mismatch_kl") not in (None, "")
        assert "train/replay/mismatch_kl" not in r or r["train/replay/mismatch_kl"] in ("", None)
    # A resume whose batch gives the rollouts another share is refused at restore, before anything is
    # trained, naming the flag and how the replay sources split it (12 of 18 here, 8 of 12 saved).
    third = run(grpo_args(root, data, str(vllm_server.model_dir), 5, *common, "--ckpt_path", "last",
                          "--data.init_args.batch_size", "18"))
    assert third.returncode == 1, third.stderr[-4000:]
    assert ("data.batch_size: saved 8, this run has 12 rollout samples per step (their share of data.batch_size 18 "
            "beside the replay sources") in third.stderr, third.stderr[-4000:]
    assert len(trained(root)) == 4


def test_a_bad_replay_row_fails_the_step_before_its_rollouts_are_drawn_and_the_fixed_run_resumes(vllm_server, data,
                                                                                              tmp_path):
    """Replay rows in file order, row 9 with nothing to train on (bad_rows: error), taken at step 2: the run
    stops there with its checkpoint. The step's rollout batch was drawn before the replay rows, so that
    checkpoint's buffer had moved past a batch it did not hold: the batch was lost and every resume stopped
    ("batch 3 can never be filled" here, synchronous; "drew rollout batch k+1, which belongs to step k+1"
    with rollouts ahead). Now the replay rows come first, and the run resumed with the row skipped trains
    batches 0-3, one per step, and every replay row but 9 in order."""
    rows = reverse_rows(40)
    rows[9] = {"messages": [{"role": "user", "content": "no answer"}]}
    bad = write_jsonl(tmp_path / "replay.jsonl", rows)
    root = tmp_path / "run"
    common = [*shared(vllm_server), "--data.init_args.batch_size", "12", "--data.init_args.weight", "2"]
    source = {"path": bad, "weight": 1, "shuffle": False}
    first = run(grpo_args(root, data, str(vllm_server.model_dir), 4, *common, *replay(source)))
    assert first.returncode == 1 and "replay source 'replay': row 9: no assistant token" in first.stderr, first.stderr[-4000:]
    assert "resumable checkpoint written after the error" in first.stderr and "(step 2)" in first.stderr
    second = run(grpo_args(root, data, str(vllm_server.model_dir), 4, *common, *replay({**source, "bad_rows": "skip"}),
                           "--ckpt_path", "last"))
    assert second.returncode == 0, second.stderr[-4000:]
    steps = trained(root)
    assert [(s["step"], s["batch"]) for s in steps] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [r for s in steps for r in s["replay"]["replay"]] == [r for r in range(17) if r != 9]
