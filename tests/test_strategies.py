"""configs/strategies/*.yaml compose with any config; the decoder layers are found from the
model; `devices: auto` starts 2 CPU processes without a GPU; FSDP1 is refused on CPU with
Lightning's message. (Training under the strategies: tests/test_ddp.py, tests/test_fsdp.py,
and on a GPU tests/test_gpu.py.)"""

import pytest
import torch
import yaml
from jsonargparse import Namespace

from helpers import REPO, reverse_rows, write_jsonl
from lit_rl.lightning_cli import auto_devices_without_gpu
from lit_rl.sharding import DecoderLayerPolicy, decoder_layer_classes
from test_cli import CONFIG

STRATEGIES = REPO / "configs" / "strategies"


@pytest.mark.parametrize("name, strategy", [
    ("ddp", "ddp"),
    ("fsdp2", "lit_rl.model_parallel.ModelParallelStrategy"),  # Lightning's, LoRA checkpoints without the base
    ("fsdp1", "lightning.pytorch.strategies.FSDPStrategy"),
])
def test_strategy_configs_compose_with_an_algorithm_config(name, strategy, lit_rl_main):
    code, stdout, stderr = lit_rl_main(["fit", "--config", CONFIG, "--config", str(STRATEGIES / f"{name}.yaml"),
                                        "--print_config"])
    assert code == 0, stderr[-3000:]
    config = yaml.safe_load(stdout)
    given = config["trainer"]["strategy"]
    assert (given if isinstance(given, str) else given["class_path"]) == strategy
    assert config["trainer"]["devices"] == "auto" and config["trainer"]["accelerator"] == "auto"
    assert config["model"]["class_path"] == "lit_rl.modules.SFT"  # the first config's module, kept


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_fsdp1_is_refused_on_cpu_with_a_clear_message(tmp_path, lit_rl_main):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    code, _, stderr = lit_rl_main(["fit", "--config", CONFIG, "--config", str(STRATEGIES / "fsdp1.yaml"),
                                   "--data.init_args.path", data, "--data.init_args.val_path", "",
                                   "--trainer.default_root_dir", str(tmp_path / "run")])
    assert code == 1
    assert "requires a GPU accelerator" in stderr and "Traceback" not in stderr, stderr[-2000:]


def test_decoder_layers_come_from_the_model(tiny_model):
    layers = list(tiny_model.model.layers)
    assert decoder_layer_classes(tiny_model) == (type(layers[0]),)
    container = torch.nn.ModuleDict({"model": tiny_model})  # FSDP1 wraps the LightningModule around the model
    wrapped = DecoderLayerPolicy()._run_policy(container, set(), {"device_id": None})
    assert list(wrapped) == layers
    tiny_model._no_split_modules = ["NoSuchLayer"]
    with pytest.raises(ValueError, match="_no_split_modules"):
        decoder_layer_classes(tiny_model)


@pytest.mark.parametrize("trainer, devices", [
    ({"strategy": Namespace(class_path="lightning.pytorch.strategies.ModelParallelStrategy"), "devices": "auto"}, 2),
    ({"strategy": "ddp", "accelerator": "cpu", "devices": "auto"}, 2),
    ({"strategy": "ddp", "accelerator": "cpu", "devices": 3}, 3),  # chosen: kept
    ({"strategy": "auto", "accelerator": "cpu", "devices": "auto"}, "auto"),  # one process: Lightning's auto
])
def test_auto_devices_without_a_gpu(monkeypatch, trainer, devices):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto_devices_without_gpu(trainer)
    assert trainer["devices"] == devices


def test_a_bad_sharding_option_names_the_flag(capsys, monkeypatch):
    from lit_rl import cli

    monkeypatch.setattr("sys.argv", ["lit-rl"])
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", "--config", CONFIG, "--config", str(STRATEGIES / "fsdp2.yaml"),
                  "--model.init_args.sharding.mixed_precision", "bf16"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err, err[-3000:]
    assert "model.sharding.mixed_precision must be one of bfloat16, float16 or null, got 'bf16'" in err, err[-3000:]


def test_sharding_options_under_another_strategy_are_refused_before_the_model_loads(tmp_path, lit_rl_main):
    """Before: FSDP2's mixed precision (or CPU offload) under one process, DDP or FSDP1 trained in
    float32 (all in memory) without a word."""
    from test_cli import fit_args

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    code, _, stderr = lit_rl_main([*fit_args(tmp_path, data, steps=1), "--model.init_args.sharding.mixed_precision",
                                   "bfloat16", "--model.init_args.sharding.cpu_offload", "true"])
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "model.init_args.sharding (cpu_offload True, mixed_precision 'bfloat16') applies under FSDP2 only " \
           "(configs/strategies/fsdp2.yaml), and this run's trainer.strategy SingleDeviceStrategy would ignore it" \
           in stderr, stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    # fsdp2.yaml's own sharding section (its defaults) under another strategy is no contradiction
    code, _, stderr = lit_rl_main([*fit_args(tmp_path / "b", data, steps=1), "--config", str(STRATEGIES / "fsdp2.yaml"),
                                   "--trainer.strategy", "auto", "--trainer.devices", "1"])
    assert code == 0, stderr[-3000:]


def test_torch_compile_under_fsdp2_is_refused_before_the_model_loads():
    """Before: refused in `configure_model`, after the model (of any size) had loaded."""
    from types import SimpleNamespace

    from lit_rl.errors import ConfigError
    from lit_rl.model_parallel import ModelParallelStrategy
    from lit_rl.modules import SFT

    module = SFT(torch_compile=True)
    module._trainer = SimpleNamespace(strategy=ModelParallelStrategy(), datamodule=None)
    with pytest.raises(ConfigError, match="model.init_args.torch_compile is not supported with ModelParallelStrategy"):
        module.setup("fit")
    assert module.model is None


def _build_and_shard(rank: int, port: int, seed_step: int, errors):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_rl.modules.model_loading import load_causal_lm
    from lit_rl.sharding import apply_fsdp2
    from helpers import TINY_MODEL

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        apply_fsdp2(load_causal_lm(TINY_MODEL, random_init=True, seed=rank * seed_step), init_device_mesh("cpu", (2,)))
    except ValueError as e:
        errors.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_refuses_ranks_with_different_weights(seed_step=1):
    """Two gloo processes build the tiny model from different seeds: refused on both ranks,
    naming the fix. (Equal weights are sharded: every FSDP2 run in tests/test_fsdp.py.)"""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_build_and_shard, args=(r, port, seed_step, errors)) for r in (0, 1)]
    [p.start() for p in procs]
    [p.join(120) for p in procs]
    assert [p.exitcode for p in procs] == [0, 0]
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert sorted(r for r, _ in found) == [0, 1] and all("seed_everything" in m for _, m in found), found
