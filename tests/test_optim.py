"""LRSchedule: transformers' schedules, as long as the trainer's run unless told otherwise."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from helpers import TINY_MODEL
from lit_rl.errors import ConfigError
from lit_rl.modules import SFT
from lit_rl.optim import LRSchedule, WarmupCosineLR, build_lr_scheduler, parameter_groups


def optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def module_schedule(max_steps: int, **schedule_args):
    """What `configure_optimizers` builds for a run of `max_steps` steps, from a config-style factory."""
    module = SFT(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), lr_scheduler=lambda o: LRSchedule(o, **schedule_args))
    module.model = torch.nn.Linear(2, 2)
    module._trainer = SimpleNamespace(estimated_stepping_batches=max_steps)
    return module.configure_optimizers()["lr_scheduler"]["scheduler"]


def test_length_comes_from_the_trainer():
    kwargs = {"name": "cosine_with_min_lr", "warmup_steps": 2, "scheduler_kwargs": {"min_lr_rate": 0.1}}
    for max_steps in (10, 40):
        values = lrs(module_schedule(max_steps, **kwargs), max_steps + 1)
        assert values[:3] == pytest.approx([0.0, 0.5, 1.0])
        assert values[max_steps] == pytest.approx(0.1)  # the floor exactly at the trainer's last step
        assert values[max_steps - 1] > 0.1


def test_a_resume_with_a_longer_run_goes_on_with_the_longer_schedule():
    """Resumed at step 4 of 4 with trainer.max_steps 8, restored as Lightning restores (optimizer,
    then scheduler): the next steps are those of an 8-step schedule, not one step at the 4-step
    schedule's end (lr 0) first."""
    kwargs = {"name": "linear", "warmup_steps": 2}
    short = module_schedule(4, **kwargs)
    lrs(short, 4)
    resumed = module_schedule(8, **kwargs)
    resumed.optimizer.load_state_dict(short.optimizer.state_dict())
    resumed.load_state_dict(short.state_dict())
    assert lrs(resumed, 4) == pytest.approx(lrs(module_schedule(8, **kwargs), 8)[4:])
    assert resumed.total_steps == 8 and resumed.get_last_lr() == pytest.approx([0.0, 0.0])  # both groups, after the 4 steps


def test_a_schedules_missing_or_unknown_argument_is_one_error_naming_scheduler_kwargs():
    """transformers' own TypeError or ValueError (a traceback from inside it) becomes a ConfigError."""
    for name, kwargs, said in (("warmup_stable_decay", {}, "missing 1 required positional argument: 'num_decay_steps'"),
                               ("cosine_warmup_with_min_lr", {}, "One of min_lr or min_lr_rate should be set")):
        with pytest.raises(ConfigError, match=f"LRSchedule '{name}': .*{said}.*scheduler_kwargs gives the schedule's own"):
            LRSchedule(optimizer(), name=name, warmup_steps=2, total_steps=10, scheduler_kwargs=kwargs)


@pytest.mark.parametrize("name,warmup,kwargs,said", [
    ("constant", 5, {}, ("warmup_steps (5) does nothing with the 'constant' schedule (transformers' constant ignores it); "
                         "use name: constant_with_warmup")),
    ("constant", 0, {"bogus": 0.5}, "scheduler_kwargs ['bogus'] are not arguments of the 'constant' schedule (it takes none)"),
    ("constant_with_warmup", 2, {"min_lr_rate": 0.5}, ("scheduler_kwargs ['min_lr_rate'] are not arguments of the "
                                                       "'constant_with_warmup' schedule (it takes none)")),
    ("cosine", 2, {"bogus": 1}, "scheduler_kwargs ['bogus'] are not arguments of the 'cosine' schedule (it takes num_cycles)"),
    ("cosine_with_min_lr", 2, {"min_lr_rate": 2.0}, "scheduler_kwargs.min_lr_rate is a fraction of the peak lr, in [0, 1]; got 2.0"),
    ("cosine_with_min_lr", 2, {"min_lr_rate": -1.0}, "scheduler_kwargs.min_lr_rate is a fraction of the peak lr, in [0, 1]; got -1.0"),
    ("warmup_stable_decay", 2, {"num_decay_steps": 4, "min_lr_ratio": 1.5}, "scheduler_kwargs.min_lr_ratio is a fraction"),
], ids=["constant-warmup", "constant-kwargs", "constant_with_warmup-kwargs", "cosine-unknown", "min_lr_rate-2", "min_lr_rate-neg",
        "wsd-min_lr_ratio"])
def test_a_setting_the_schedule_would_ignore_or_misread_is_refused(name, warmup, kwargs, said):
    """transformers' constant returns before it reads warmup_steps or scheduler_kwargs (lr 1.0x from
    step 0, the warm-up silently dropped), constant_with_warmup and linear ignore scheduler_kwargs, and
    a min_lr_rate above 1 makes the decay rise to 1.96x the peak: each is a ConfigError naming it."""
    with pytest.raises(ConfigError) as e:
        LRSchedule(optimizer(), name=name, warmup_steps=warmup, total_steps=10, scheduler_kwargs=kwargs)
    assert said in str(e.value)


def test_same_numbers_as_transformers():
    ours = LRSchedule(optimizer(), "cosine_with_min_lr", warmup_steps=3, total_steps=20, scheduler_kwargs={"min_lr_rate": 0.05})
    theirs = get_cosine_with_min_lr_schedule_with_warmup(optimizer(), 3, 20, min_lr_rate=0.05)
    assert lrs(ours, 25) == pytest.approx(lrs(theirs, 25))


def test_given_total_steps_wins_but_a_mismatch_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="lit_rl.optim"):
        scheduler = build_lr_scheduler(lambda o: LRSchedule(o, "linear", total_steps=10), optimizer(), total_steps=300)
    assert scheduler.total_steps == 10 and lrs(scheduler, 11)[10] == 0.0
    assert "total_steps=10 but the trainer runs 300" in caplog.text


def test_every_problem_in_one_clear_error():
    with pytest.raises(ConfigError) as e:  # a UserError: `lit-rl fit` prints it without a traceback
        LRSchedule(optimizer(), "cosine_typo", warmup_steps=-1)
    message = str(e.value)
    assert "cosine_typo" in message and "warmup_steps must be >= 0" in message and "total_steps is unknown" in message
    with pytest.raises(ValueError, match="needs a monitored metric"):
        LRSchedule(optimizer(), "reduce_lr_on_plateau", total_steps=10)


def test_old_warmup_cosine_configs_still_run(caplog):
    with caplog.at_level(logging.WARNING, logger="lit_rl.optim"):
        scheduler = build_lr_scheduler(lambda o: WarmupCosineLR(o, warmup_steps=0, min_lr_ratio=0.2), optimizer(), 8)
    assert "deprecated" in caplog.text and "LRSchedule" in caplog.text
    values = lrs(scheduler, 9)
    assert values[0] == 1.0 and values[8] == pytest.approx(0.2)
    assert values[4] == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))


def test_a_run_shorter_than_the_warmup_just_warms_up(caplog):
    with caplog.at_level(logging.WARNING, logger="lit_rl.optim"):
        values = lrs(module_schedule(3, name="cosine", warmup_steps=10), 3)
    assert values == pytest.approx([0.0, 0.1, 0.2]) and "ends within the warm-up" in caplog.text


def test_weight_decay_spares_biases_and_norm_weights():
    """The optimizer decays the matrices only: after one AdamW step on zero gradients (so the only
    change is the decay) a Linear's weight is scaled by 1 - lr x weight_decay, while its bias and a
    LayerNorm's gain and bias are untouched, as transformers' Trainer leaves them."""
    module = SFT(optimizer=lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5))
    module.model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    optimizer = module.configure_optimizers()
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = dict(module.model.named_parameters())
    torch.testing.assert_close(after["0.weight"].detach(), before["0.weight"] * (1 - 0.1 * 0.5))
    for name in ("0.bias", "1.weight", "1.bias"):
        torch.testing.assert_close(after[name].detach(), before[name], atol=0, rtol=0)


def test_the_tiny_models_undecayed_parameters_are_its_norms():
    """The rank rule of `parameter_groups` on a real causal LM: the vectors it spares are exactly the
    norm weights (Qwen3 has no biases), and every matrix, the embedding among them, is decayed."""
    module = SFT(model=TINY_MODEL, random_init=True)
    module.configure_model()
    names = {id(p): n for n, p in module.named_parameters()}
    decayed, undecayed = parameter_groups(module)
    assert undecayed["weight_decay"] == 0.0 and "weight_decay" not in decayed  # the config's value
    assert {names[id(p)] for p in undecayed["params"]} == {n for n in names.values() if "norm" in n}
    assert any("embed_tokens" in names[id(p)] for p in decayed["params"])
    assert len(decayed["params"]) + len(undecayed["params"]) == len(names)


def test_a_checkpoint_with_one_optimizer_group_resumes_into_the_two():
    """A checkpoint of an earlier lit-rl holds AdamW's state of one group (positions over the trained
    parameters in the model's order). `on_load_checkpoint` puts each tensor's moments at its position
    in the two groups: torch then loads it (before: "a different number of parameter groups") and
    every parameter gets its own moments back."""
    module = SFT(model=TINY_MODEL, random_init=True, optimizer=lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5))
    module.configure_model()
    trained = [p for p in module.parameters() if p.requires_grad]
    earlier = torch.optim.AdamW(trained, lr=0.1, weight_decay=0.5)  # what configure_optimizers built before
    for i, p in enumerate(trained):
        p.grad = torch.full_like(p, float(i + 1))  # each tensor's moments tell it apart
    earlier.step()
    checkpoint = {"state_dict": module.state_dict(), "optimizer_states": [earlier.state_dict()]}
    module.on_save_checkpoint(checkpoint)
    optimizer = module.configure_optimizers()
    with pytest.raises(ValueError, match="different number of parameter groups"):
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    module.on_load_checkpoint(checkpoint)
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    for p in trained:
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], earlier.state[p]["exp_avg"], atol=0, rtol=0)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]
    assert optimizer.param_groups[1]["lr"] == 0.1
