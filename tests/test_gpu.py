"""GPU-only checks of the strategy configs, over NCCL on every GPU of the machine (skipped
without CUDA; bench/gpu_check.sh runs them): FSDP1 (Lightning refuses it on CPU) trains and
resumes from its sharded checkpoint, FSDP2 with bf16 mixed precision follows the float32 run
and still exports float32 weights, FSDP2 with CPU offload trains to the same weights."""

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, reverse_rows, write_jsonl
from test_fsdp import fit, metrics, ok

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
STRATEGIES = REPO / "configs" / "strategies"


def on(strategy: str, root, data, steps, *extra):
    return fit(root, data, steps, *extra, configs=[str(STRATEGIES / f"{strategy}.yaml")])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("gpu") / "train.jsonl", reverse_rows(32))


@pytest.fixture(scope="module")
def fsdp2_float32(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2_fp32")
    out = ok(on("fsdp2", root, data, 2))
    assert "distributed_backend=nccl" in out.stdout + out.stderr
    return root


def test_fsdp1_trains_and_resumes_from_its_sharded_checkpoint(data, tmp_path):
    out = ok(on("fsdp1", tmp_path / "straight", data, 2))
    assert "distributed_backend=nccl" in out.stdout + out.stderr
    ok(on("fsdp1", tmp_path / "split", data, 1))
    assert (tmp_path / "split" / "checkpoints" / "last.ckpt").is_dir()
    ok(on("fsdp1", tmp_path / "split", data, 2, "--ckpt_path", "last"))
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "split")
    assert sorted(a) == sorted(b) == [0, 1]
    assert b[1]["train/loss"] == pytest.approx(a[1]["train/loss"], rel=1e-4)
    wa = load_file(tmp_path / "straight" / "weights" / "step_2" / "model.safetensors")
    wb = load_file(tmp_path / "split" / "weights" / "step_2" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=0, msg=k)


def test_fsdp2_bf16_mixed_precision_follows_float32(data, fsdp2_float32, tmp_path):
    ok(on("fsdp2", tmp_path, data, 2, "--model.init_args.sharding.mixed_precision", "bfloat16"))
    fp32, bf16 = metrics(fsdp2_float32), metrics(tmp_path)
    for step in (0, 1):
        assert bf16[step]["train/loss"] == pytest.approx(fp32[step]["train/loss"], rel=2e-2)
    weights = load_file(tmp_path / "weights" / "step_2" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}  # the weights themselves stay float32


def test_fsdp2_cpu_offload_trains_to_the_same_weights(data, fsdp2_float32, tmp_path):
    ok(on("fsdp2", tmp_path, data, 2, "--model.init_args.sharding.cpu_offload", "true"))
    wa = load_file(fsdp2_float32 / "weights" / "step_2" / "model.safetensors")
    wb = load_file(tmp_path / "weights" / "step_2" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-4, rtol=0, msg=k)
