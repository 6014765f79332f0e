"""A mixed step (rollouts + replay rows) through the real Trainer: the update equals the policy
loss over the rollouts as one [B, T] batch plus the cross-entropy over the replay rows, each
divided by its own count over the whole step, however the step is split, packed or shared out
over ranks (plain SGD, no clipping: a wrong factor would show)."""

import copy
import dataclasses

import lightning as L
import pytest
import torch

from lit_rl.data.mixing import Part, build_mixed_step, split_batch
from lit_rl.data.samples import Sample
from lit_rl.losses import masked_cross_entropy_sum, opd_loss, policy_loss
from lit_rl.modules.grpo import GRPO
from lit_rl.modules.opd import OPD
from lit_rl.modules.model_loading import load_causal_lm
from helpers import TINY_MODEL
from test_grpo_step import as_batch, dr_grpo_length, rollout_samples, sgd, sgd_step

POLICY = Part("policy", "policy_gradient", 3.0, 1)
OPD_PART = Part("policy", "distillation", 3.0, 1)
REPLAY = Part("replay", "cross_entropy", 1.0, 1)


def replay_samples(n=4, seed=1):
    """Static rows: a prompt and an answer whose tokens are trained, no sampling logprobs."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt, answer = 2 + i % 3, 3 + (i * 3) % 7
        ids = torch.randint(0, 250, (prompt + answer,), generator=g).tolist()
        samples.append(Sample(input_ids=ids, loss_mask=[t >= prompt for t in range(len(ids))]))
    return samples


def reference_update(model, rollouts, rows, loss_type):
    """Parameters after one SGD step (lr 1) on policy_loss over the rollouts as [B, T] plus the
    mean cross-entropy over the replay rows' trained tokens (`opd_loss` for loss_type "opd", with
    OPD's defaults: advantages clipped at 1 and centred on the mean of the rollouts' tokens, never
    the replay rows')."""
    model = copy.deepcopy(model)
    lp, inf, teacher, mask, adv = as_batch(model, rollouts)  # [B, T] x 4, [B]
    if loss_type == "opd":
        pg, _ = opd_loss(lp, lp.detach(), inf, teacher, mask, advantage_baseline="step_mean", advantage_clip=1.0)
    else:
        pg, _ = policy_loss(lp, lp.detach(), inf, adv, mask, loss_type=loss_type, max_completion_length=16)
    ce_sum, ce_tokens = torch.zeros(()), 0
    for s in rows:
        ids, row_mask = torch.tensor([s.input_ids]), torch.tensor([s.loss_mask])
        ce_sum = ce_sum + masked_cross_entropy_sum(model(input_ids=ids, use_cache=False).logits, ids, row_mask)
        ce_tokens += int(row_mask[:, 1:].sum())
    ce = ce_sum / ce_tokens
    return sgd_step(model, pg + ce), pg.item(), ce.item()


class MixedShare(L.LightningDataModule):
    """Each rank gets its share of each source, as RolloutDataModule hands them out."""

    has_teacher = True  # OPD checks that its data module scores with a teacher

    def __init__(self, rollouts, rows, policy=POLICY, **layout):
        super().__init__()
        self.rollouts, self.rows, self.policy, self.layout = rollouts, rows, policy, layout

    def train_dataloader(self):
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        share = lambda xs: xs[rank * len(xs) // world:(rank + 1) * len(xs) // world]  # noqa: E731
        step = build_mixed_step([(self.policy, share(self.rollouts)), (REPLAY, share(self.rows))], **self.layout)
        self.parts_per_micro_batch = [mb["part"] for mb in step["micro_batches"]]
        return torch.utils.data.DataLoader([step], batch_size=None, collate_fn=lambda x: x)


def mixed_share(rollouts, replay: int) -> MixedShare:
    """Rollouts longest first and `replay` rows shortest first, in micro-batches of 24 tokens: of
    two ranks, the first packs more of the policy's micro-batches, the second more of the
    replay's (the layout that once hung FSDP2 with a sharded frozen model)."""
    rows = sorted(replay_samples(replay), key=len)
    return MixedShare(sorted(rollouts, key=len, reverse=True), rows, micro_batch_tokens=24, packing="packed")


def grpo(model, loss_type):
    module = GRPO(model=TINY_MODEL, optimizer=sgd, max_grad_norm=None, loss_type=loss_type,
                  max_completion_length=dr_grpo_length(loss_type),
                  head_chunk_size=7)
    module.model = copy.deepcopy(model)
    return module


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(TINY_MODEL, random_init=True, seed=0)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_each_source_feeds_its_own_loss_normalised_by_its_own_count(model, loss_type):
    rollouts, rows = rollout_samples(model, n=6), replay_samples(4)
    want, pg, ce = reference_update(model, rollouts, rows, loss_type)
    for budget, packing in [(4096, "padded"), (40, "padded"), (40, "packed")]:
        module = grpo(model, loss_type)
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, datamodule=MixedShare(rollouts, rows, micro_batch_tokens=budget, packing=packing))
        metrics = trainer.callback_metrics
        assert metrics["train/loss"].item() == pytest.approx(pg + ce, abs=1e-5)
        assert metrics["train/policy/loss"].item() == pytest.approx(pg, abs=1e-5)
        assert metrics["train/replay/loss"].item() == pytest.approx(ce, abs=1e-5)
        assert metrics["train/replay/tokens"].item() == sum(sum(s.loss_mask[1:]) for s in rows)
        assert metrics["train/replay/rows"].item() == len(rows)
        # the policy's metrics come from its own tokens only, globally and per source
        assert metrics["train/mismatch_kl"].item() == pytest.approx(metrics["train/policy/mismatch_kl"].item())
        assert "train/replay/mismatch_kl" not in metrics
        for (name, a), b in zip(want.named_parameters(), module.model.parameters()):
            torch.testing.assert_close(b, a, atol=3e-6, rtol=0, msg=lambda m: f"{loss_type} {budget}/{packing} {name}: {m}")


def test_opd_with_replay_sums_the_reverse_kl_part_and_the_cross_entropy_part(model):
    g = torch.Generator().manual_seed(7)
    rollouts = [dataclasses.replace(s, teacher_logprobs=[v - 0.5 * float(torch.rand((), generator=g)) if m else 0.0
                                                         for v, m in zip(s.logprobs, s.loss_mask)])
                for s in rollout_samples(model, n=6)]
    rows = replay_samples(4)
    want, distill, ce = reference_update(model, rollouts, rows, "opd")
    module = OPD(model=TINY_MODEL, optimizer=sgd, max_grad_norm=None, head_chunk_size=7)
    module.model = copy.deepcopy(model)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=MixedShare(rollouts, rows, micro_batch_tokens=40, packing="packed", policy=OPD_PART))
    metrics = trainer.callback_metrics
    assert metrics["train/loss"].item() == pytest.approx(distill + ce, abs=1e-5)
    assert metrics["train/replay/loss"].item() == pytest.approx(ce, abs=1e-5)
    for (name, a), b in zip(want.named_parameters(), module.model.parameters()):
        torch.testing.assert_close(b, a, atol=3e-6, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_two_ranks_give_the_mixed_update_of_one_process(model):
    """Each part's count is summed over both ranks before the backward; a rank whose share of a
    source is empty (here one rank gets the only replay row, the other none) still takes part in every collective."""
    rollouts, rows = rollout_samples(model, n=8), replay_samples(1)
    want, _, _ = reference_update(model, rollouts, rows, "dapo")
    module = grpo(model, "dapo")
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, datamodule=MixedShare(rollouts, rows, micro_batch_tokens=48, packing="packed"))
    for (name, a), b in zip(want.named_parameters(), module.model.parameters()):
        torch.testing.assert_close(b, a, atol=3e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def test_split_follows_the_weights_in_whole_groups_and_rank_shares():
    assert split_batch(32, [Part("policy", "policy_gradient", 3, 8), REPLAY]) == [24, 8]
    # 64 / 3 = 21.3 each: the policy in whole groups of 16, the others in rank pairs
    assert split_batch(64, [Part("policy", "policy_gradient", 1, 16), Part("a", "cross_entropy", 1, 2),
                            Part("b", "cross_entropy", 1, 2)]) == [16, 24, 24]
    # 40 x 0.5 = 20 is not whole groups of 8: a split that is
    assert split_batch(40, [Part("policy", "policy_gradient", 1, 8), REPLAY]) == [16, 24]
    # 12 x 0.5 = 6 each: rounding every part down leaves the policy no group, but 8 + 4 is closest
    assert split_batch(12, [Part("policy", "policy_gradient", 1, 8), REPLAY]) == [8, 4]
    # 1 and 2 ideal: 2 + 1 and 0 + 3 are as close; the split that gives every part samples wins
    assert split_batch(3, [Part("policy", "policy_gradient", 1, 2), Part("replay", "cross_entropy", 2, 1)]) == [2, 1]
    with pytest.raises(ValueError, match="gives \\['replay'\\] no samples"):
        split_batch(16, [Part("policy", "policy_gradient", 100, 8), REPLAY])
    with pytest.raises(ValueError, match="left over"):
        split_batch(12, [Part("policy", "policy_gradient", 1, 8), Part("replay", "cross_entropy", 1, 8)])


@pytest.mark.slow
def test_a_mixed_step_with_a_sharded_reference_lines_up_on_two_ranks(model, tmp_path):
    """GRPO's reference (kl_coef) is sharded under FSDP2 like the policy and runs on the policy's
    micro-batches only: with rollouts and replay rows packed into other counts per rank (equal in
    total), one rank's extra reference forward waited forever for the other's. Each source is now
    evened out apart, and two ranks give one process's update."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from helpers import REPO

    rollouts = rollout_samples(model, n=8)
    module = GRPO(model=TINY_MODEL, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), max_grad_norm=None,
                  head_chunk_size=7, kl_coef=0.5, loss_type="dapo")
    module.model = copy.deepcopy(model)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=mixed_share(rollouts, 8))
    out = subprocess.run([sys.executable, str(REPO / "tests" / "fsdp_rl_step.py"), "GRPO",
                          json.dumps({"kl_coef": 0.5, "loss_type": "dapo", "lr": 0.05, "replay": 8}), str(tmp_path / "out")],
                         cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = dict(line.split(" parts: ") for line in out.stdout.splitlines() if " parts: " in line)
    counts = {rank: (parts.count("'policy'"), parts.count("'replay'")) for rank, parts in ranks.items()}
    assert len(set(counts.values())) == 2, counts  # the ranks' layouts differ, part by part
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["frozen_sharded"]
    got = load_file(tmp_path / "out" / "model.safetensors")
    for name, a in module.model.named_parameters():
        torch.testing.assert_close(got[name], a.detach(), atol=2e-6, rtol=0, msg=name)
