"""One SFT optimizer step through the real Trainer: the loss is CE over trained tokens
divided by the trained tokens of the whole step, so the update does not depend on the
micro-batch split or the layout (gradient-accumulation invariance)."""

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_rl.data.datamodules import StaticDataModule
from lit_rl.data.render import render_messages
from lit_rl.modules.sft import SFT
from helpers import TINY_MODEL, reverse_rows, write_jsonl


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def one_step(data_file, *, micro_batch_tokens, packing, batch_size=8, trainer_kw=None, **module_kw):
    L.seed_everything(0)
    module = SFT(model=TINY_MODEL, random_init=True, **{"optimizer": sgd, "max_grad_norm": None, **module_kw})
    dm = StaticDataModule(
        data_file, batch_size=batch_size, shuffle=False, micro_batch_tokens=micro_batch_tokens,
        packing=packing, max_length=64, num_workers=0,
    )
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, **(trainer_kw or {}),
    )
    module.configure_model()
    initial = copy.deepcopy(module.model)
    trainer.fit(module, datamodule=dm)
    return initial, module, trainer.callback_metrics


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("sft") / "train.jsonl", reverse_rows(16))


def hand_loss(model, tokenizer, rows):
    """Sum of CE over every trained token of every row, over the count of trained tokens."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for row in rows:
            r = render_messages(tokenizer, row["messages"])
            ids = torch.tensor([r.input_ids])
            logits = model(input_ids=ids, use_cache=False).logits[0]
            for t in range(1, len(r.input_ids)):
                if r.loss_mask[t]:
                    total += F.cross_entropy(logits[t - 1], ids[0, t]).item()
                    count += 1
    return total / count, count


def test_loss_is_mean_over_trained_tokens_of_the_step(data_file, tokenizer):
    initial, _, metrics = one_step(data_file, micro_batch_tokens=4096, packing="padded")
    want, count = hand_loss(initial, tokenizer, reverse_rows(8))
    assert metrics["train/loss"].item() == pytest.approx(want, abs=1e-5)
    assert metrics["train/tokens"].item() == count
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    # this process's peak RSS so far, in GB; logged as float32, hence the 1e-6 GB slack
    assert 0.1 < metrics["train/peak_memory_gb"].item() <= peak + 1e-6


def test_update_is_invariant_to_micro_batch_split_and_layout(data_file):
    _, reference, _ = one_step(data_file, micro_batch_tokens=4096, packing="padded")
    for budget, packing in [(64, "padded"), (64, "packed"), (128, "packed")]:
        _, other, metrics = one_step(data_file, micro_batch_tokens=budget, packing=packing)
        for (name, a), b in zip(reference.model.named_parameters(), other.model.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=f"{name} differs with {budget}/{packing}")
        # the small budgets really did split the step into several micro-batches
        assert metrics["train/micro_batches"].item() > 1


def test_torch_compile_gives_the_same_update_and_state_dict_names(data_file):
    _, reference, _ = one_step(data_file, micro_batch_tokens=256, packing="packed")
    from torch._dynamo.utils import counters

    counters.clear()
    _, compiled, _ = one_step(data_file, micro_batch_tokens=256, packing="packed", torch_compile=True)
    # the forward really ran compiled, as one graph: the head probe's no-grad calls run eager
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert list(compiled.model.state_dict()) == list(reference.model.state_dict())
    for a, b in zip(reference.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_no_gradient_is_held_between_steps(data_file):
    """A weight-sized gradient left over after the optimizer step would sit in memory through
    validation, exports and checkpoints until the next step frees it."""
    _, module, _ = one_step(data_file, micro_batch_tokens=256, packing="packed")
    assert all(p.grad is None for p in module.model.parameters())


def test_gradient_checkpointing_gives_the_same_update(data_file):
    _, reference, _ = one_step(data_file, micro_batch_tokens=4096, packing="padded")
    _, checkpointed, _ = one_step(data_file, micro_batch_tokens=4096, packing="padded", gradient_checkpointing=True)
    assert checkpointed.model.is_gradient_checkpointing
    for a, b in zip(reference.model.parameters(), checkpointed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def fp16_mixed(init_scale: float = 2.0**16):
    """Lightning's `16-mixed` plugin as a GPU gets it: a GradScaler scales the loss (on a CPU,
    Lightning swaps `16-mixed` for bf16 without a scaler, so the GPU's plugin is built by hand)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]}


def test_fp16_mixed_precision_clips_the_unscaled_gradient_and_skips_an_overflow(data_file):
    """The gradient is clipped after the GradScaler unscaled it: the same norm and the same clipped
    SGD update (0.5) as in float32. Clipped before, the scaled norm (x65536) was clipped and the
    update came out 65536 times too small. A loss scale that overflows skips the step (weights
    unchanged, the scale halved) instead of stopping the run."""
    _, _, plain = one_step(data_file, micro_batch_tokens=4096, packing="padded", max_grad_norm=0.5)
    initial, module, scaled = one_step(data_file, micro_batch_tokens=4096, packing="padded", max_grad_norm=0.5,
                                       trainer_kw=fp16_mixed())
    assert scaled["train/grad_norm"].item() == pytest.approx(plain["train/grad_norm"].item(), rel=1e-2)
    assert plain["train/grad_norm"].item() > 1  # the clip acted
    moved = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(module.model.parameters(), initial.parameters())))
    assert moved.item() == pytest.approx(0.5, rel=1e-3)
    assert scaled["train/loss_scale"].item() == 2.0**16

    initial, module, overflow = one_step(data_file, micro_batch_tokens=4096, packing="padded", max_grad_norm=0.5,
                                         trainer_kw=fp16_mixed(init_scale=2.0**127))
    assert not torch.isfinite(overflow["train/grad_norm"])
    assert overflow["train/loss_scale"].item() == 2.0**126
    for a, b in zip(module.model.parameters(), initial.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


class SGDIgnoringItsClosure(torch.optim.SGD):
    def step(self, closure=None):
        return super().step()


def test_an_optimizer_that_ignores_its_closure_stops_the_run_instead_of_training_unclipped(data_file):
    """The clip runs from the closure Lightning hands `optimizer.step`: an optimizer that never calls
    it would train with no clipping and no grad_norm, so the run stops with one message naming it."""
    from lit_rl.stopping import RunFailed

    with pytest.raises(RunFailed, match="SGDIgnoringItsClosure.step\\(\\) did not call the closure"):
        one_step(data_file, micro_batch_tokens=4096, packing="padded", max_grad_norm=0.5,
                 optimizer=lambda p: SGDIgnoringItsClosure(p, lr=1.0))
