"""Dense on-policy distillation: each divergence against values computed by hand, the chunked
two-head loss against full logits (value and gradients), and one OPD optimizer step with the
teacher in process equal to the reference over the whole step, however it is split or packed."""

import copy
import math

import lightning as L
import pytest
import torch
from transformers import AutoTokenizer

from helpers import TINY_MODEL
from lit_rl.chunked_head import selected_divergence_sum
from lit_rl.data.step_builder import build_step
from lit_rl.losses import opd_loss, shifted_token_logprobs, token_divergence
from lit_rl.modules.model_loading import load_causal_lm
from lit_rl.modules.opd import OPD
from test_grpo_step import OneStep, as_batch, rollout_samples, sgd, sgd_step

S, T = [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_each_divergence_equals_its_hand_computed_value(beta):
    if beta == 0.0:
        want = kl(T, S)  # forward KL(teacher || student)
    elif beta == 1.0:
        want = kl(S, T)  # reverse KL(student || teacher)
    else:
        m = [(1 - beta) * s + beta * t for s, t in zip(S, T)]
        want = beta * kl(T, m) + (1 - beta) * kl(S, m)
    got = token_divergence(torch.tensor([S]).log(), torch.tensor([T]).log(), beta)
    assert got.shape == (1,) and got.item() == pytest.approx(want, abs=1e-7)
    assert token_divergence(torch.tensor([T]).log(), torch.tensor([T]).log(), beta).item() == pytest.approx(0.0, abs=1e-7)


def test_the_gradients_are_the_hand_derived_ones():
    """d KL(s || t) / d z = s (log s - log t - KL(s || t)); d KL(t || s) / d z = s - t (z: student logits)."""
    g = torch.Generator().manual_seed(0)
    t = torch.log_softmax(torch.randn(3, 6, generator=g), -1)
    for beta, hand in [(1.0, lambda s: s.exp() * (s - t - token_divergence(s, t, 1.0)[:, None])),
                       (0.0, lambda s: s.exp() - t.exp())]:
        z = torch.randn(3, 6, generator=g, requires_grad=True)
        token_divergence(torch.log_softmax(z, -1), t, beta).sum().backward()
        torch.testing.assert_close(z.grad, hand(torch.log_softmax(z.detach(), -1)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_chunked_two_head_divergence_equals_the_full_logits_one(beta, chunk_size):
    g = torch.Generator().manual_seed(1)
    n, hs, ht, v = 7, 8, 5, 11  # the teacher is narrower than the student: only the vocabulary is shared
    hidden, weight, bias = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((n, hs), (v, hs), (v,)))
    t_hidden, t_weight = torch.randn(n, ht, generator=g), torch.randn(v, ht, generator=g)
    full = token_divergence(torch.log_softmax(hidden @ weight.T + bias, -1), torch.log_softmax(t_hidden @ t_weight.T, -1), beta).sum()
    want = torch.autograd.grad(full, (hidden, weight, bias))
    got = selected_divergence_sum(hidden, weight, t_hidden, t_weight, beta=beta, student_bias=bias, chunk_size=chunk_size)
    assert got.item() == pytest.approx(full.item(), abs=1e-5)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight, bias)), want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bad_options_are_one_error_naming_each():
    with pytest.raises(ValueError) as e:
        OPD(model=TINY_MODEL, divergence="kl", beta=1.5)
    assert "divergence must be one of" in str(e.value) and "beta must be in [0, 1], got 1.5" in str(e.value)
    with pytest.raises(ValueError, match="reward_weight"):
        OPD(model=TINY_MODEL, divergence="reverse_kl", reward_weight=0.5)
    with pytest.raises(ValueError, match="advantage_clip must be > 0 or null, got 0"):
        OPD(model=TINY_MODEL, advantage_clip=0)
    with pytest.raises(ValueError, match="advantage_baseline must be one of"):
        OPD(model=TINY_MODEL, advantage_baseline="mean")


@pytest.mark.parametrize("options", [{"reward_weight": math.nan}, {"reward_weight": math.inf}, {"is_cap": math.nan}])
def test_a_nan_or_inf_that_would_spoil_every_advantage_is_refused(options):
    """A YAML `.nan` or `.inf` passes jsonargparse's float; `reward_weight < 0` and `is_cap <= 0` let
    them through, to make every advantage or behaviour weight NaN at the first step, servers started."""
    with pytest.raises(ValueError, match="reward_weight must be a finite number >= 0|is_cap must be > 0, got nan"):
        OPD(model=TINY_MODEL, **options)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student and a teacher of other weights (a directory with its tokenizer, as a user gives it)."""
    teacher_dir = tmp_path_factory.mktemp("teacher")
    teacher = load_causal_lm(TINY_MODEL, random_init=True, seed=1)
    teacher.save_pretrained(teacher_dir)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(teacher_dir)
    return load_causal_lm(TINY_MODEL, random_init=True, seed=0), teacher, str(teacher_dir)


def reference_update(student, teacher, samples, divergence, beta, **advantage_options):
    """Parameters after one SGD step (lr 1) on the loss over all samples as one [B, T] batch: the
    divergence of the full logits at every trained position over their number, or opd_loss (with
    `advantage_options`: its baseline, over the whole step, and clip)."""
    student = copy.deepcopy(student)
    lp, inf, _, mask, _ = as_batch(student, samples)  # [B, T] x 4
    if divergence == "sampled_reverse_kl":
        teacher_lp = torch.zeros_like(inf)
        for b, s in enumerate(samples):
            ids = torch.tensor([s.input_ids])
            with torch.no_grad():
                teacher_lp[b, : len(s)] = shifted_token_logprobs(teacher(input_ids=ids, use_cache=False).logits, ids)[0]
        loss, _ = opd_loss(lp, lp.detach(), inf, teacher_lp * mask, mask, **advantage_options)
    else:
        beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": beta}[divergence]
        total, count = torch.zeros(()), 0
        for s in samples:
            ids = torch.tensor([s.input_ids])
            at = torch.tensor(s.loss_mask[1:])  # positions whose next token is trained
            ours = torch.log_softmax(student(input_ids=ids, use_cache=False).logits[0, :-1][at].float(), -1)
            with torch.no_grad():
                theirs = torch.log_softmax(teacher(input_ids=ids, use_cache=False).logits[0, :-1][at].float(), -1)
            total, count = total + token_divergence(ours, theirs, beta).sum(), count + int(at.sum())
        loss = total / count
    return sgd_step(student, loss), loss.item()


SAMPLED_STEP_MEAN = {"advantage_baseline": "step_mean", "advantage_clip": 1.0}  # the defaults
SAMPLED_RAW_CLIPPED = {"advantage_baseline": "none", "advantage_clip": 0.05}


@pytest.mark.parametrize("divergence, beta, advantage_options", [
    ("reverse_kl", 0.5, {}), ("forward_kl", 0.5, {}), ("jsd", 0.3, {}),
    ("sampled_reverse_kl", 0.5, SAMPLED_STEP_MEAN), ("sampled_reverse_kl", 0.5, SAMPLED_RAW_CLIPPED)])
def test_one_step_with_the_teacher_in_process_equals_the_reference(models, divergence, beta, advantage_options):
    """Whole step at once and split into packed micro-batches: the same update (for the sampled
    estimator's step-mean baseline: the mean over all micro-batches, not each one's own)."""
    student, teacher, teacher_dir = models
    samples = rollout_samples(student, n=8)
    want, want_loss = reference_update(student, teacher, samples, divergence, beta, **advantage_options)
    for budget, packing in [(4096, "padded"), (40, "packed")]:
        module = OPD(model=TINY_MODEL, optimizer=sgd, max_grad_norm=None, divergence=divergence, beta=beta,
                     teacher_model=teacher_dir, head_chunk_size=7, **advantage_options)
        module.model = copy.deepcopy(student)
        step = build_step(samples, micro_batch_tokens=budget, packing=packing)
        assert budget == 4096 or len(step["micro_batches"]) > 2  # the small budget really splits the step
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, datamodule=OneStep(step))
        assert trainer.callback_metrics["train/loss"].item() == pytest.approx(want_loss, abs=1e-5)
        if divergence != "sampled_reverse_kl":
            assert trainer.callback_metrics["train/divergence"].item() == pytest.approx(want_loss, abs=1e-5)
        for (name, a), b in zip(want.named_parameters(), module.model.parameters()):
            torch.testing.assert_close(b, a, atol=2e-6, rtol=0, msg=lambda m: f"{divergence} {budget}/{packing} {name}: {m}")
        assert not any(p.requires_grad for p in module.teacher.parameters())
        assert not any(k.startswith("teacher") for k in module.state_dict())  # not checkpointed, not exported


@pytest.mark.slow
@pytest.mark.parametrize("divergence", ["reverse_kl", "sampled_reverse_kl"])
def test_the_teacher_in_process_sharded_with_the_student_gives_the_one_process_update(models, tmp_path, divergence):
    """FSDP2, 2 CPU processes, student and teacher both sharded, each rank half the samples: the
    update is the reference over all samples (the divergence normalised by both ranks' positions;
    the sampled estimator's step-mean baseline over both ranks' tokens)."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from helpers import REPO

    student, teacher, teacher_dir = models
    options = SAMPLED_STEP_MEAN if divergence == "sampled_reverse_kl" else {}
    want, want_loss = reference_update(student, teacher, rollout_samples(student, n=8), divergence, 0.5, **options)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    options = json.dumps({"divergence": divergence, "teacher_model": teacher_dir})
    out = subprocess.run([sys.executable, str(REPO / "tests" / "fsdp_rl_step.py"), "OPD", options,
                          str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["frozen_sharded"], metrics
    assert metrics["train/loss"] == pytest.approx(want_loss, abs=1e-5)
    got = load_file(tmp_path / "out" / "model.safetensors")
    for name, a in want.named_parameters():
        torch.testing.assert_close(got[name], a.detach(), atol=2e-6, rtol=0, msg=name)
