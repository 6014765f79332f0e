"""One GRPO optimizer step through the real Trainer equals `policy_loss` over the step's
samples as one [B, T] batch, for every loss_type, however the step is split into
micro-batches or packed (plain SGD, no clipping: a wrong factor would show)."""

import copy
import json

import lightning as L
import pytest
import torch

from lit_rl.data.held_batch import HeldBatch
from lit_rl.data.samples import Sample
from lit_rl.data.step_builder import build_step
from lit_rl.losses import LOSS_TYPES, policy_loss, shifted_token_logprobs
from lit_rl.modules.grpo import GRPO
from lit_rl.modules.model_loading import load_causal_lm
from helpers import TINY_MODEL


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def rollout_samples(model, n=10, seed=0):
    """Prompt + completion samples with sampling logprobs near (not equal to) the model's own,
    and a per-sequence advantage on every completion token."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt, completion = 3 + i % 4, 4 + (i * 5) % 9
        ids = torch.randint(0, 250, (prompt + completion,), generator=g)
        with torch.no_grad():
            lp = shifted_token_logprobs(model(input_ids=ids[None], use_cache=False).logits, ids[None])[0]
        sampler = lp + 0.3 * torch.randn(lp.shape, generator=g)  # the sampler disagrees a little
        mask = [t >= prompt for t in range(len(ids))]
        sample = Sample(input_ids=ids.tolist(), loss_mask=mask, logprobs=[v if m else 0.0 for v, m in zip(sampler.tolist(), mask)],
                        reward=float(i % 3), source="policy")
        samples.append(sample.with_advantage(float(torch.randn((), generator=g))))
    return samples


def as_batch(model, samples):
    """The samples as one padded [B, T] batch: the model's logprobs (differentiable), the sampler's
    logprobs, the teacher's (0 where a sample has none), the trained-token mask and the per-sequence
    advantages [B]."""
    T, B = max(len(s) for s in samples), len(samples)
    lp_rows, inf, teacher = [], torch.zeros(B, T), torch.zeros(B, T)
    adv, mask = torch.zeros(B), torch.zeros(B, T, dtype=torch.bool)
    for b, s in enumerate(samples):
        ids = torch.tensor([s.input_ids])
        lp = shifted_token_logprobs(model(input_ids=ids, use_cache=False).logits, ids)[0]  # [n]
        lp_rows.append(torch.nn.functional.pad(lp, (0, T - len(s))))
        inf[b, : len(s)] = torch.tensor(s.logprobs)
        if s.teacher_logprobs is not None:
            teacher[b, : len(s)] = torch.tensor(s.teacher_logprobs)
        mask[b, : len(s)] = torch.tensor(s.loss_mask)
        mask[b, 0] = False
        adv[b] = next(a for a, m in zip(s.advantages, s.loss_mask) if m)
    return torch.stack(lp_rows), inf, teacher, mask, adv


def sgd_step(model, loss: torch.Tensor):
    """One SGD step (lr 1) of `model` on `loss`, as the references below compute it; the model."""
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return model


def reference_update(model, samples, loss_type):
    """The parameters after one SGD step (lr 1) on policy_loss over all samples as [B, T]."""
    model = copy.deepcopy(model)
    lp, inf, _, mask, adv = as_batch(model, samples)  # [B, T] x 4, [B]
    loss, _ = policy_loss(lp, lp.detach(), inf, adv, mask, loss_type=loss_type, max_completion_length=16)
    return sgd_step(model, loss), loss.item()


def dr_grpo_length(loss_type: str) -> int | None:
    """GRPO's max_completion_length: dr_grpo's constant, refused with the other loss types."""
    return 16 if loss_type == "dr_grpo" else None


class OneStep(L.LightningDataModule):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def train_dataloader(self):
        return torch.utils.data.DataLoader([self.step], batch_size=None, collate_fn=lambda x: x)


def trained(model, samples, loss_type, micro_batch_tokens, packing):
    module = GRPO(model=TINY_MODEL, optimizer=sgd, max_grad_norm=None, loss_type=loss_type,
                  max_completion_length=dr_grpo_length(loss_type),
                  head_chunk_size=7)
    module.model = copy.deepcopy(model)
    step = build_step(samples, micro_batch_tokens=micro_batch_tokens, packing=packing)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=OneStep(step))
    return module.model, trainer.callback_metrics, len(step["micro_batches"])


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(TINY_MODEL, random_init=True, seed=0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_update_equals_policy_loss_over_the_whole_step(model, loss_type):
    samples = rollout_samples(model)
    want, want_loss = reference_update(model, samples, loss_type)
    for budget, packing in [(4096, "padded"), (48, "padded"), (40, "packed")]:
        got, metrics, n_micro = trained(model, samples, loss_type, budget, packing)
        assert budget == 4096 or n_micro > 2  # the small budgets really split the step
        assert metrics["train/loss"].item() == pytest.approx(want_loss, abs=1e-5)
        for (name, a), b in zip(want.named_parameters(), got.parameters()):
            torch.testing.assert_close(b, a, atol=2e-6, rtol=0, msg=lambda m: f"{loss_type} {budget}/{packing} {name}: {m}")
        assert 0 < metrics["train/mismatch_kl"].item() < 1 and metrics["train/entropy"].item() > 0


def test_kl_penalty_off_costs_nothing_and_on_pulls_towards_the_reference(model):
    samples = rollout_samples(model, n=4)
    module = GRPO(model=TINY_MODEL, kl_coef=0.0)
    module.model = copy.deepcopy(model)
    module.configure_model()
    assert module._reference is None  # no reference loaded or computed when off
    with_kl = GRPO(model=TINY_MODEL, random_init=True, kl_coef=0.5)
    torch.manual_seed(0)
    with_kl.configure_model()
    ref = with_kl._reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    assert not any(p is q for p in ref.parameters() for q in with_kl.parameters())  # not trained, not checkpointed
    step = build_step(samples, micro_batch_tokens=4096, packing="padded")
    (mb,) = step["micro_batches"]
    _, metrics = with_kl.micro_batch_loss_sum(mb)
    assert metrics["kl_to_reference"][0].item() == pytest.approx(0.0, abs=1e-6)  # policy == reference at the start
    with torch.no_grad():
        for p in with_kl.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    _, metrics = with_kl.micro_batch_loss_sum(mb)
    assert metrics["kl_to_reference"][0].item() > 1e-4


def test_bad_options_are_reported_together():
    with pytest.raises(ValueError) as e:
        GRPO(model=TINY_MODEL, loss_type="ppo", is_cap=-1, kl_coef=-1, updates_per_batch=0)
    assert all(k in str(e.value) for k in ("loss_type", "is_cap", "kl_coef", "updates_per_batch must be an int >= 1"))


def test_a_kl_reference_of_another_vocabulary_is_refused_when_it_loads(tmp_path):
    """Its logprobs are read at the policy's token ids. Before: a smaller head failed at the first step
    (servers started), a larger one gave a KL between unrelated tokens without a word."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_rl.errors import ConfigError

    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.vocab_size += 64
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    module = GRPO(model=TINY_MODEL, random_init=True, kl_coef=0.1, reference_model=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match=f"reference_model {tmp_path / 'other'} has an output head of "
                                          f"{config.vocab_size} tokens, the policy {config.vocab_size - 64}"):
        module.configure_model()
    module.model.save_pretrained(tmp_path / "same")
    same = GRPO(model=TINY_MODEL, random_init=True, kl_coef=0.1, reference_model=str(tmp_path / "same"))
    same.configure_model()
    assert same.frozen_models()


class RankShare(L.LightningDataModule):
    """Each rank gets its half of the step's samples, as RolloutDataModule hands them out (the same
    samples for `steps` steps)."""

    def __init__(self, samples, steps: int = 1, **layout):
        super().__init__()
        self.samples, self.steps, self.layout = samples, steps, layout

    def train_dataloader(self):
        rank, world = self.trainer.global_rank, self.trainer.world_size
        share = len(self.samples) // world
        step = build_step(self.samples[rank * share:(rank + 1) * share], **self.layout)
        return torch.utils.data.DataLoader([step] * self.steps, batch_size=None, collate_fn=lambda x: x)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_ranks_give_the_update_of_policy_loss_over_the_whole_step(model, loss_type):
    """Tokens (dapo) or sequences (grpo) are counted over both ranks before the backward."""
    samples = rollout_samples(model, n=8)
    want, want_loss = reference_update(model, samples, loss_type)
    module = GRPO(model=TINY_MODEL, optimizer=sgd, max_grad_norm=None, loss_type=loss_type,
                  max_completion_length=dr_grpo_length(loss_type))
    module.model = copy.deepcopy(model)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, datamodule=RankShare(samples, micro_batch_tokens=48, packing="packed"))
    for (name, a), b in zip(want.named_parameters(), module.model.parameters()):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=0, msg=lambda m: f"{loss_type} {name}: {m}")


@pytest.mark.slow
def test_the_kl_to_the_initial_policy_under_fsdp2_gives_the_one_process_update(model, tmp_path):
    """GRPO with kl_coef and no reference_model under FSDP2 (2 CPU processes): the reference is a
    copy of the initial policy taken before sharding, sharded like it; two steps on the same
    samples (the second one's KL is not 0) give the weights of the same two steps in one process."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from helpers import REPO

    options = {"kl_coef": 0.5, "loss_type": "dapo"}
    lr = 0.05  # a first step that moves the policy a little: the second step's KL is 0.4 nats, not 50
    module = GRPO(model=TINY_MODEL, optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None, head_chunk_size=7,
                  **options)
    module.model = copy.deepcopy(model)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=RankShare(rollout_samples(model, n=8), steps=2, micro_batch_tokens=48, packing="packed"))
    assert trainer.callback_metrics["train/kl_to_reference"].item() > 0.1  # the second step's KL is live
    out = subprocess.run([sys.executable, str(REPO / "tests" / "fsdp_rl_step.py"), "GRPO", json.dumps({**options, "lr": lr}),
                          str(tmp_path / "out"), "2"], cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["frozen_sharded"], metrics
    assert metrics["train/kl_to_reference"] == pytest.approx(trainer.callback_metrics["train/kl_to_reference"].item(),
                                                             rel=1e-5)
    got = load_file(tmp_path / "out" / "model.safetensors")
    for name, a in module.model.named_parameters():
        torch.testing.assert_close(got[name], a.detach(), atol=2e-6, rtol=0, msg=name)


# -- several updates per batch -------------------------------------------------------------------


def reference_updates(model, samples, updates: int, lr: float):
    """The parameters after `updates` SGD steps on policy_loss over one batch, each with the
    ratio to the logprobs of the weights before the first step; each step's clip_fraction."""
    model = copy.deepcopy(model)
    old = as_batch(model, samples)[0].detach()  # [B, T]
    clip_fractions = []
    for _ in range(updates):
        lp, inf, _, mask, adv = as_batch(model, samples)  # [B, T] x 4, [B]
        loss, metrics = policy_loss(lp, old, inf, adv, mask, loss_type="dapo")
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        clip_fractions.append(metrics["clip_fraction"])
    return model, clip_fractions


class HeldUpdates(L.LightningDataModule):
    """A batch for `updates` optimizer steps, held as RolloutDataModule holds it (`HeldBatch`:
    one step of micro-batches, each with its old-logprob slot) from update `start` on."""

    def __init__(self, held: HeldBatch, updates: int, start: int = 0, **layout):
        super().__init__()
        self.held, self.updates, self.start, self.layout = held, updates, start, layout

    def train_dataloader(self):
        step = self.held.step or self.held.hold(build_step(self.held.payload["samples"], **self.layout), 0, 1)
        return torch.utils.data.DataLoader([step] * (self.updates - self.start),
                                           batch_size=None, collate_fn=lambda x: x)


def held_batch(samples):
    return HeldBatch(0, {"samples": samples, "staleness": [0] * len(samples), "replay": {}, "metrics": {}})


def grpo_updates(model, datamodule, lr, clip_fractions=None):
    """`GRPO(updates_per_batch=3)` trained on the datamodule's updates (from its `start`, as a
    run resumed after that many optimizer steps)."""
    module = GRPO(model=TINY_MODEL, optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None,
                  head_chunk_size=7, updates_per_batch=3)
    module.model = model
    if clip_fractions is not None:  # each step's, as logged
        module.on_train_batch_end = lambda *a: clip_fractions.append(module.trainer.callback_metrics["train/clip_fraction"].item())
    trainer = L.Trainer(max_steps=datamodule.updates, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total.completed = datamodule.start
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == datamodule.updates
    return module.model


def test_several_updates_per_batch_clip_against_the_first_updates_weights_and_resume_mid_batch(model):
    """Three SGD steps on one batch (`updates_per_batch=3`, packed into several micro-batches)
    equal three steps of policy_loss whose ratio is to the weights before the first: the old
    logprobs are the first update's own (no extra pass), kept for the later updates, and the
    clip binds there (clip_fraction > 0 at updates 1 and 2, 0 at update 0). A run stopped after
    update 1 and resumed from the batch's plain-data state (samples, old logprobs) ends with
    the same weights. Keeping each update's own logprobs as the old ones (a ratio of 1) would
    give other weights, checked."""
    samples, lr = rollout_samples(model, n=8), 1.0
    want, want_clip = reference_updates(model, samples, 3, lr)
    assert want_clip[0] == 0 and want_clip[1] > 0.05 and want_clip[2] > 0.05  # the trust region binds
    layout = dict(micro_batch_tokens=40, packing="packed")
    clip = []
    got = grpo_updates(copy.deepcopy(model), HeldUpdates(held_batch(samples), 3, **layout), lr, clip)
    for (name, a), b in zip(want.named_parameters(), got.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    assert clip == pytest.approx(want_clip, abs=1e-6)
    # ratio 1 at every update (each update its own old policy) is another run: the test can tell
    no_trust_region = copy.deepcopy(model)
    for _ in range(3):
        lp, inf, _, mask, adv = as_batch(no_trust_region, samples)
        loss, _ = policy_loss(lp, lp.detach(), inf, adv, mask, loss_type="dapo")
        no_trust_region.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in no_trust_region.parameters():
                p -= lr * p.grad
    assert max((a - b).abs().max().item() for a, b in zip(want.parameters(), no_trust_region.parameters())) > 1e-3
    # stopped after update 1 (of 0, 1, 2), its held batch saved as plain data, resumed
    held = held_batch(samples)
    first_two = grpo_updates(copy.deepcopy(model), HeldUpdates(held, 2, **layout), lr)
    state = held.state_dict(world_size=1)
    assert json.loads(json.dumps(state)) == state  # plain data: no pickle in the checkpoint
    resumed = grpo_updates(first_two, HeldUpdates(HeldBatch.from_state(state), 3, start=2, **layout), lr)
    for (name, a), b in zip(want.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=lambda m: f"resumed {name}: {m}")


def test_a_step_refuses_a_rollout_batch_that_belongs_to_another_step(tmp_path, monkeypatch):
    """Step k trains batch k // updates_per_batch and nothing else: a buffer whose next batch is
    not the step's (rollout state and trainer step out of line) stops the run with both numbers,
    before anything is traced or trained."""
    from helpers import reverse_rows, write_jsonl

    from lit_rl.data.rollout_datamodule import RolloutDataModule
    from lit_rl.inference.client import InferenceClient
    from lit_rl.rollouts import ReverseTextEnv, TrainSampling
    from lit_rl.rollouts.buffer import RolloutBuffer
    from lit_rl.rollouts.scheduler import Batch

    env = ReverseTextEnv(write_jsonl(tmp_path / "t.jsonl", reverse_rows(2)))
    dm = RolloutDataModule(env, batch_size=2, group_size=2)
    dm.trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    sample = Sample(input_ids=[1, 2], loss_mask=[False, True], logprobs=[0.0, -1.0], reward=1.0, source="policy")
    drawn = iter([Batch([sample, sample], index=1, versions=[1, 1], first_step=2),
                  Batch([sample, sample], index=1, versions=[1, 1], first_step=2)])
    monkeypatch.setattr(dm, "_wait_for_batch", lambda: next(drawn))
    never_called = InferenceClient("http://127.0.0.1:9/v1")  # the buffer is not started: only its metrics are read
    dm.rollouts = RolloutBuffer(env, never_called, None, TrainSampling(), batch_size=2, group_size=2)
    with pytest.raises(RuntimeError, match=r"step 1 drew rollout batch 1, which belongs to step 2: the rollouts' "
                                           r"state and the trainer's step disagree"):
        dm._draw_payload(first_step=1)
    assert not (tmp_path / "rollouts" / "trained.jsonl").exists()
    assert dm._draw_payload(first_step=2)["samples"] == [sample, sample]  # its own step takes it
