"""Two DDP ranks (CPU, gloo) through the real CLI train to the same weights as one process:
the loss is divided by the trained tokens of the whole step over all ranks, and the step's data
counts are the whole step's."""

import csv

import pytest
import torch
from safetensors.torch import load_file

from helpers import reverse_rows, write_jsonl
from test_cli import CONFIG, run


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    common = ["fit", "--config", CONFIG, "--data.init_args.path", data, "--data.init_args.val_path", "",
              "--data.init_args.num_workers", "0", "--data.init_args.batch_size", "8", "--data.init_args.shuffle", "false",
              "--data.init_args.max_length", "40",  # some rows cut: truncated_rows counts them
              "--trainer.max_steps", "2", "--trainer.enable_checkpointing", "false", "--trainer.log_every_n_steps", "1",
              # plain SGD and no clipping: Adam and norm clipping would hide a wrong constant factor
              "--model.init_args.optimizer", "torch.optim.SGD", "--model.init_args.optimizer.init_args.lr", "0.5",
              "--model.init_args.max_grad_norm", "null", "--model.init_args.lr_scheduler", "null"]
    one = run(common + ["--trainer.default_root_dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run(common + ["--trainer.default_root_dir", str(tmp_path / "two"), "--trainer.devices", "2",
                        "--trainer.strategy", "ddp"])
    assert two.returncode == 0, two.stderr[-3000:]
    a = load_file(tmp_path / "one" / "weights" / "step_2" / "model.safetensors")
    b = load_file(tmp_path / "two" / "weights" / "step_2" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0, msg=k)
    logged = [[{k: row[k] for k in ("train/rows", "train/truncated_rows", "train/tokens")}
               for row in csv.DictReader(open(next((tmp_path / run_dir / "logs").glob("*/metrics.csv"))))
               if row.get("train/rows")] for run_dir in ("one", "two")]
    assert logged[0] == logged[1] and float(logged[0][0]["train/rows"]) == 8, logged
    assert any(float(step["train/truncated_rows"]) > 0 for step in logged[0]), logged
