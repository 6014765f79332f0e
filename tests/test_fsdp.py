"""FSDP2 (Lightning's ModelParallelStrategy + lit-rl's sharding) with 2 CPU processes (gloo),
through the real CLI and configs/strategies/fsdp2.yaml as a second --config:

- two sharded ranks train to the same weights, losses and gradient norms as one process with
  the same global batch (so the loss is normalised by the tokens of all ranks, and the
  gradient norm and its clipping are taken over all shards);
- the HF export gathered from the shards equals the one-process export bit for bit, given
  the same weights (loaded from disk, one step with learning rate 0);
- a sharded run stopped after step 1 and resumed continues exactly as an uninterrupted one, and so
  does a one-process run resumed under FSDP2;
- activation checkpointing recomputes every sharded layer in backward and does not change the update;
- GRPO and OPD run under FSDP2 with the real vLLM server;
- a LoRA adapter trains under FSDP2 as in one process, and its sharded checkpoints hold the adapter
  without the frozen base and resume exactly.

SGD with momentum and clipping at a norm below the gradients': the logged gradient norm (measured
before clipping) catches a wrong constant factor, the weights catch a wrong clipping.
"""

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, reverse_rows, write_jsonl
from test_cli import CONFIG, run

# One worker for the file: the `runs` fixture (two trainings) is shared by its tests.
pytestmark = pytest.mark.slow  # one worker runs the file: conftest.ONE_WORKER_FILES
FSDP2 = str(REPO / "configs" / "strategies" / "fsdp2.yaml")
# measured: the largest weight difference after 2 steps was 1.2e-7 (float32 sums in another order)
ATOL = 1e-6
N_LAYERS = json.loads((REPO / "lit_rl" / "assets" / "tiny_qwen3" / "config.json").read_text())["num_hidden_layers"]


def fit(root: Path, data: str, steps: int, *extra: str, configs=()) -> list[str]:
    return [
        "fit", "--config", CONFIG, *(a for c in configs for a in ("--config", c)),
        "--data.init_args.path", data, "--data.init_args.val_path", "", "--data.init_args.num_workers", "0",
        "--data.init_args.batch_size", "8", "--data.init_args.shuffle", "false",
        "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", "1",
        "--model.init_args.optimizer", "torch.optim.SGD", "--model.init_args.optimizer.init_args.lr", "0.5",
        "--model.init_args.optimizer.init_args.momentum", "0.9",  # optimizer state, for the resumes
        "--model.init_args.max_grad_norm", "1.0", "--model.init_args.lr_scheduler", "null", *extra,
    ]


def sharded(root: Path, data: str, steps: int, *extra: str) -> list[str]:
    return fit(root, data, steps, *extra, configs=[FSDP2])


def metrics(root: Path) -> dict[int, dict[str, float]]:
    out = {}
    for path in sorted(root.glob("logs/version_*/metrics.csv")):
        for row in csv.DictReader(open(path)):
            if row.get("train/loss"):
                out[int(row["step"])] = {k: float(v) for k, v in row.items() if k.startswith("train/") and v}
    return out


def weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(root / "weights" / f"step_{step}" / "model.safetensors")


def ok(args, env=None):
    out = run(args, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    data = write_jsonl(tmp / "train.jsonl", reverse_rows(32))
    # 9 held-out rows in steps of 8: the last step's one row leaves a rank with none (validated at step 2)
    held_out = ["--data.init_args.val_path", write_jsonl(tmp / "val.jsonl", reverse_rows(9, offset=100)),
                "--trainer.val_check_interval", "2", "--trainer.num_sanity_val_steps", "0"]
    ok(fit(tmp / "one", data, 2, *held_out))
    out = ok(sharded(tmp / "two", data, 2, *held_out))
    assert "Starting with 2 processes" in out.stdout + out.stderr  # fsdp2.yaml's devices: auto on CPU
    return tmp, data


def test_two_sharded_ranks_match_one_process(runs):
    tmp, _ = runs
    one, two = metrics(tmp / "one"), metrics(tmp / "two")
    assert sorted(one) == sorted(two) == [0, 1]
    for step in (0, 1):
        assert two[step]["train/tokens"] == one[step]["train/tokens"]  # the ranks' rows make up the batch
        assert two[step]["train/grad_norm"] > 1.0  # clipping was active
        for name in ("train/loss", "train/grad_norm"):
            assert two[step][name] == pytest.approx(one[step][name], rel=1e-5, abs=0), (step, name)
    a, b = weights(tmp / "one", 2), weights(tmp / "two", 2)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=ATOL, rtol=0, msg=k)


def test_sharded_validation_covers_every_row_as_one_process(runs):
    """val/loss of 9 rows in steps of 8 over two ranks, one of which has no row in the last step
    (it takes part in the forward's collectives with an empty micro-batch): one process's value."""
    tmp, _ = runs

    def val_loss(root: Path) -> float:
        rows = [r for p in root.glob("logs/version_*/metrics.csv") for r in csv.DictReader(open(p)) if r.get("val/loss")]
        assert len(rows) == 1, rows
        return float(rows[0]["val/loss"])

    assert val_loss(tmp / "two") == pytest.approx(val_loss(tmp / "one"), rel=1e-5, abs=0)


def test_sharded_export_equals_one_process_export(runs):
    """The same saved weights (the one-process run's export) loaded in one process and in two
    sharded ranks, one step with learning rate 0 (the weights stay exactly as loaded): the
    export gathered from the shards has the same files, byte for byte."""
    tmp, data = runs
    same = ["--model.init_args.model", str(tmp / "one" / "weights" / "step_2"), "--model.init_args.random_init", "false",
            "--model.init_args.optimizer.init_args.lr", "0.0"]
    for name, args in (("one_lr0", fit), ("two_lr0", sharded)):
        ok(args(tmp / name, data, 1, *same))
    a, b = (tmp / "one_lr0" / "weights" / "step_1"), (tmp / "two_lr0" / "weights" / "step_1")
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for path in a.iterdir():
        assert path.read_bytes() == (b / path.name).read_bytes(), path.name


def test_sharded_resume_continues_exactly(runs):
    tmp, data = runs
    split = tmp / "split"
    ok(sharded(split, data, 1))
    assert (split / "checkpoints" / "last.ckpt").is_dir()  # sharded: one file per rank
    # resumed without the strategy that reads it: one message saying which, the checkpoint kept
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (split / "checkpoints" / "last.ckpt").iterdir())
    out = run(fit(split, data, 2, "--ckpt_path", "last"))
    assert out.returncode == 1 and "is a sharded FSDP2 checkpoint" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "configs/strategies/fsdp2.yaml" in out.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (split / "checkpoints" / "last.ckpt").iterdir()) == before
    ok(sharded(split, data, 2, "--ckpt_path", "last"))
    straight, resumed = metrics(tmp / "two"), metrics(split)
    assert [resumed[s]["train/loss"] for s in (0, 1)] == [straight[s]["train/loss"] for s in (0, 1)]
    a, b = weights(tmp / "two", 2), weights(split, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_one_process_checkpoint_resumes_under_fsdp2_exactly(runs):
    """A one-process `last.ckpt` (one file, SGD's momentum for each parameter in the optimizer's two
    groups, lit_rl.optim.parameter_groups) resumed under FSDP2: the run goes on as the one-process
    run did. Lightning's own loading names the momentum buffers by `model.parameters()`' order, which
    is not the groups' order: the norms' buffers would land on other tensors or refuse to load. The
    same checkpoint with the one group an earlier lit-rl wrote resumes the same way."""
    tmp, data = runs
    cross, earlier = tmp / "cross", tmp / "cross_earlier"
    ok(fit(cross, data, 1))
    # the same checkpoint as an earlier lit-rl wrote it: one group, positions in the model's order
    checkpoint = torch.load(cross / "checkpoints" / "last.ckpt", weights_only=False)
    (earlier / "checkpoints").mkdir(parents=True)
    torch.save({**checkpoint, "optimizer_states": [one_group(checkpoint)]}, earlier / "checkpoints" / "last.ckpt")
    for root in (cross, earlier):
        ok(sharded(root, data, 2, "--ckpt_path", "last"))
        a, b = weights(tmp / "one", 2), weights(root, 2)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=ATOL, rtol=0, msg=(root.name, k))


def one_group(checkpoint: dict) -> dict:
    """The optimizer state of `checkpoint` (lit_rl.optim.parameter_groups: matrices, then vectors) as
    one group over the parameters in the model's order, as lit-rl wrote it before the two groups."""
    seen, shapes = set(), []  # every parameter of the model trains here; the tied head is the embedding's
    for tensor in checkpoint["state_dict"].values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            shapes.append(tensor.shape)
    order = [i for i, s in enumerate(shapes) if len(s) >= 2] + [i for i, s in enumerate(shapes) if len(s) < 2]
    state = checkpoint["optimizer_states"][0]
    group = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
    return {"state": {order[i]: v for i, v in state["state"].items()},
            "param_groups": [{**group, "params": list(range(len(shapes)))}]}


def test_grpo_under_fsdp2_with_a_real_server(vllm_server, tmp_path):
    """GRPO, 2 sharded ranks, synchronous (max_staleness 0), the session's real vLLM server:
    rank 0 drives the buffer, each rank trains a disjoint half of each batch with the chunked
    logprob path on the sharded model, and the weights gathered and synced after step 0 are
    exactly the trained ones (the server's logprobs match the trainer's at step 1)."""
    from test_grpo_cli import CONFIG as GRPO, grpo_args, shared, trained

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(40))
    root = tmp_path / "run"
    args = grpo_args(root, data, str(vllm_server.model_dir), 2, *shared(vllm_server), "--data.init_args.max_staleness", "0")
    args[args.index(GRPO) + 1:args.index(GRPO) + 1] = ["--config", FSDP2]
    ok(args)
    rows = [r for r in metrics(root).values() if "train/staleness_max" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["train/tokens"] == pytest.approx(r["train/completion_length"] * 8), r  # both halves trained
        assert r["train/mismatch_kl"] < 1e-3, r  # the server sampled with exactly the weights trained
    assert [s["step"] for s in trained(root)] == [0, 1]
    assert all(x["policy_version"] == s["step"] for s in trained(root) for x in s["samples"])
    halves = [[{tuple(i) for i in json.loads(line)["samples"]} for line in open(root / "rollouts" / f"trained_rank{r}.jsonl")]
              for r in (0, 1)]
    for batch, half0, half1 in zip(trained(root), *halves, strict=True):
        assert len(half0) == len(half1) == 4 and not half0 & half1
        assert half0 | half1 == {(s["draw"], s["member"]) for s in batch["samples"]}


def test_activation_checkpointing_under_fsdp2_gives_the_same_update(runs):
    """Each sharded layer recomputed in backward (model.gradient_checkpointing): every layer's
    forward runs twice per forward of the model on both ranks, and the losses, gradient norms
    and weights are the same as without."""
    tmp, data = runs
    counted = tmp / "checkpointed" / "layer_forwards"
    ok(sharded(tmp / "checkpointed", data, 2, "--model.init_args.gradient_checkpointing", "true",
               "--trainer.callbacks+=layer_forward_counter.CountLayerForwards", "--trainer.callbacks.out_dir", str(counted)),
       env={"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))})
    for rank in (0, 1):
        counts = json.loads((counted / f"rank{rank}.json").read_text())
        layers = {k: v for k, v in counts.items() if k.startswith("layers.")}
        assert counts["embed_tokens"] > 0 and len(layers) == N_LAYERS, counts
        assert all(v == 2 * counts["embed_tokens"] for v in layers.values()), counts  # forward + recompute
    plain, checkpointed = metrics(tmp / "two"), metrics(tmp / "checkpointed")
    for step in (0, 1):
        for name in ("train/loss", "train/grad_norm"):
            assert checkpointed[step][name] == pytest.approx(plain[step][name], rel=1e-6, abs=0), (step, name)
    a, b = weights(tmp / "two", 2), weights(tmp / "checkpointed", 2)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-7, rtol=0, msg=k)


def test_opd_under_fsdp2_with_a_real_server(vllm_server, tmp_path):
    """OPD with the sampled-token loss, 2 sharded ranks, synchronous, the session's server as the
    policy's server and as the teacher (no second server to start): the student's logprobs from the sharded model match the
    server's after every sync, and each rank trains its half of each batch."""
    from test_opd import CONFIG as OPD, opd_args

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(40))
    root = tmp_path / "run"
    args = opd_args(root, data, str(vllm_server.model_dir), 2, "--inference.base_url", vllm_server.base_url,
                    "--inference.server", "{}", "--inference.teacher_model", "null",
                    "--inference.teacher_server", "{}", "--inference.teacher_base_url", vllm_server.base_url,
                    "--data.init_args.max_staleness", "0", "--model.init_args.divergence", "sampled_reverse_kl")
    args[args.index(OPD) + 1:args.index(OPD) + 1] = ["--config", FSDP2]
    ok(args)
    rows = [r for r in metrics(root).values() if "train/reverse_kl" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["train/mismatch_kl"] < 1e-3, r  # the trainer's logprobs are the served weights'
        assert r["train/tokens"] == pytest.approx(r["train/completion_length"] * 8), r


def adapter(root: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(root / "weights" / f"step_{step}" / "adapter_model.safetensors")


LORA = ["--model.init_args.lora.rank", "4", "--model.init_args.lora.alpha", "8",
        "--model.init_args.lora.target_modules", "[q_proj, v_proj, down_proj]"]


@pytest.fixture(scope="module")
def lora_runs(runs):
    tmp, data = runs
    ok(fit(tmp / "lora_one", data, 2, *LORA))
    ok(sharded(tmp / "lora_two", data, 2, *LORA))
    return tmp, data


def test_lora_under_fsdp2_trains_as_one_process(lora_runs):
    """A LoRA adapter (the frozen base in the shards beside it): two sharded ranks train the adapter
    that one process trains, with the same losses and gradient norms; the exports hold only the
    adapter. (A LoRA resume is exact: tests/test_lora.py; a sharded one: below.)"""
    tmp, data = lora_runs
    one, two = metrics(tmp / "lora_one"), metrics(tmp / "lora_two")
    for step in (0, 1):
        for name in ("train/loss", "train/grad_norm"):
            assert two[step][name] == pytest.approx(one[step][name], rel=1e-5, abs=0), (step, name)
    a, b = adapter(tmp / "lora_one", 2), adapter(tmp / "lora_two", 2)
    assert len(a) == N_LAYERS * 3 * 2 and a.keys() == b.keys()  # A and B of three layers per block
    assert not any(torch.equal(v, torch.zeros_like(v)) for v in a.values())  # every B moved from its zero init
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=ATOL, rtol=0, msg=k)
    assert not (tmp / "lora_two" / "weights" / "step_2" / "model.safetensors").exists()


def test_a_one_process_lora_checkpoint_resumes_under_fsdp2(lora_runs):
    """A LoRA checkpoint of one process holds the adapter without the frozen base (one file):
    resumed under FSDP2 (2 ranks), the base comes from the model and the run goes on as the
    one-process run did (it stopped at Lightning's strict load: the base's keys were missing)."""
    tmp, data = lora_runs
    cross = tmp / "lora_cross"
    ok(fit(cross, data, 1, *LORA))
    ok(sharded(cross, data, 2, "--ckpt_path", "last", *LORA))
    a, b = adapter(tmp / "lora_one", 2), adapter(cross, 2)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=ATOL, rtol=0, msg=k)


def test_a_sharded_lora_checkpoint_leaves_the_base_out_and_resumes_exactly(lora_runs):
    """lit-rl's FSDP2 strategy (fsdp2.yaml) writes a LoRA run's shards without the frozen base,
    with the whole base's fingerprint, and a resume loads the adapter and its optimizer state
    from them and the base from the model: it continues as the uninterrupted sharded run. A
    resume without the adapter is refused naming the flag."""
    from torch.distributed.checkpoint import FileSystemReader

    from lit_rl.lora import base_difference

    tmp, data = lora_runs
    split = tmp / "lora_split"
    ok(sharded(split, data, 1, *LORA))
    checkpoint = split / "checkpoints" / "last.ckpt"
    stored = [k for k in FileSystemReader(checkpoint).read_metadata().state_dict_metadata if k.startswith("state_dict.")]
    assert len(stored) == N_LAYERS * 3 * 2 and all(".lora_" in k for k in stored), stored[:5]
    saved = torch.load(checkpoint / "meta.pt", weights_only=False)["lit_rl"]["frozen_base"]
    one_process = torch.load(tmp / "lora_one" / "checkpoints" / "last.ckpt", weights_only=False)["lit_rl"]["frozen_base"]
    assert base_difference(saved, one_process) is None  # the fingerprint of the whole tensors, not of a shard
    ok(sharded(split, data, 2, "--ckpt_path", "last", *LORA))
    straight, resumed = metrics(tmp / "lora_two"), metrics(split)
    assert [resumed[s]["train/loss"] for s in (0, 1)] == [straight[s]["train/loss"] for s in (0, 1)]
    a, b = adapter(tmp / "lora_two", 2), adapter(split, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = run(sharded(split, data, 3, "--ckpt_path", "last"))
    assert out.returncode != 0 and "resume it with the same model.init_args.lora" in out.stderr, out.stderr[-3000:]
