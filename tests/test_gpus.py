"""plan_gpus: how one node's GPUs are split between training and the vLLM server (pure, no CUDA)."""

import pytest

from lit_rl.inference.gpus import plan_gpus, visible_gpus


def test_extra_inference_gpus_become_data_parallel_ranks():
    plan = plan_gpus(8, num_infer_gpus=4, tensor_parallel_size=2)
    assert plan.train_devices == [0, 1, 2, 3]
    assert plan.infer_devices == ["4", "5", "6", "7"]
    assert (plan.tensor_parallel_size, plan.data_parallel_size) == (2, 2)
    assert plan.server_kwargs() == {"devices": ["4", "5", "6", "7"], "tensor_parallel_size": 2, "data_parallel_size": 2}


@pytest.mark.parametrize(
    "gpus, infer, tp, train, serve, dp",
    [
        (2, 1, 1, [0], ["1"], 1),
        (8, 2, 2, [0, 1, 2, 3, 4, 5], ["6", "7"], 1),
        (8, 6, 1, [0, 1], ["2", "3", "4", "5", "6", "7"], 6),
        (8, 4, 4, [0, 1, 2, 3], ["4", "5", "6", "7"], 1),
    ],
)
def test_splits(gpus, infer, tp, train, serve, dp):
    plan = plan_gpus(gpus, num_infer_gpus=infer, tensor_parallel_size=tp)
    assert (plan.train_devices, plan.infer_devices, plan.data_parallel_size) == (train, serve, dp)


def test_visible_ids_are_kept_for_the_server():
    # CUDA_VISIBLE_DEVICES=2,3,5,7: Lightning counts from 0, the server needs the real ids
    plan = plan_gpus(["2", "3", "5", "7"], num_infer_gpus=2, tensor_parallel_size=1)
    assert plan.train_devices == [0, 1] and plan.infer_devices == ["5", "7"] and plan.data_parallel_size == 2


@pytest.mark.parametrize(
    "gpus, infer, tp, message",
    [
        (8, 3, 2, "not a multiple of tensor_parallel_size=2"),
        (8, 8, 1, "leaves no GPU for training"),
        (4, 0, 1, "num_infer_gpus must be >= 1"),
        (4, 2, 0, "tensor_parallel_size must be >= 1"),
        (0, 1, 1, "no GPUs are visible"),
        (["0", "0", "1"], 1, 1, "repeat"),
    ],
)
def test_bad_combinations_are_refused(gpus, infer, tp, message):
    with pytest.raises(ValueError, match=message):
        plan_gpus(gpus, num_infer_gpus=infer, tensor_parallel_size=tp)


def test_all_problems_in_one_error():
    with pytest.raises(ValueError) as err:
        plan_gpus(4, num_infer_gpus=4, tensor_parallel_size=3)
    assert "leaves no GPU" in str(err.value) and "not a multiple" in str(err.value)


def test_visible_gpus_reads_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1,GPU-abc")
    assert visible_gpus() == ["3", "1", "GPU-abc"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_num_infer_gpus_in_server_options(monkeypatch):
    from lit_rl.commands.evaluate import with_gpu_split

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    kw = with_gpu_split({"num_infer_gpus": 4, "tensor_parallel_size": 2, "max_model_len": 1024})
    assert kw == {"max_model_len": 1024, "devices": ["4", "5", "6", "7"], "tensor_parallel_size": 2, "data_parallel_size": 2}
    assert with_gpu_split({"max_model_len": 8}) == {"max_model_len": 8}
