"""Dense on-policy distillation from a teacher server's top-k tokens: the coarsened divergences
against values computed by hand, k = V against the whole-vocabulary divergence, the chunked loss
against full logits (value and gradients), the top-k fields through packing and rank splits, and
one OPD optimizer step on served top-k samples equal to the reference however it is packed.
(A real vLLM teacher's top k against HF's, through the rollout buffer: tests/test_opd.py.)"""

import copy
import dataclasses
import math

import lightning as L
import pytest
import torch

from helpers import TINY_MODEL
from lit_rl.chunked_head import selected_topk_divergence_sum
from lit_rl.data.rank_share import from_wire, rank_share, to_wire
from lit_rl.data.samples import Sample
from lit_rl.data.step_builder import build_step
from lit_rl.losses import TAIL_FLOOR, token_divergence, topk_bins
from lit_rl.modules.model_loading import load_causal_lm
from lit_rl.modules.opd import OPD
from test_grpo_step import OneStep, rollout_samples, sgd, sgd_step

STUDENT = [0.4, 0.3, 0.2, 0.1]  # over a vocabulary of 4
TOP_IDS, TEACHER_TOP = [1, 2], [0.5, 0.3]  # the teacher's top 2: tokens 1 and 2; its tail holds 0.2


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def hand_bins(student, top_ids, teacher_top):
    """The k + 1 bins written out: the top-k tokens, then the rest, each tail floored."""
    s = [student[i] for i in top_ids] + [1 - sum(student[i] for i in top_ids) + TAIL_FLOOR]
    return s, list(teacher_top) + [1 - sum(teacher_top) + TAIL_FLOOR]


def divergence_by_hand(s, t, beta):
    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = [(1 - beta) * a + beta * b for a, b in zip(s, t)]
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 2])
def test_topk_divergence_equals_its_hand_computed_value(beta, k):
    s, t = hand_bins(STUDENT, TOP_IDS[:k], TEACHER_TOP[:k])
    want = divergence_by_hand(s, t, beta)
    student_bins, teacher_bins = topk_bins(torch.tensor([STUDENT]).log(), torch.tensor([TOP_IDS[:k]]),
                                           torch.tensor([TEACHER_TOP[:k]]).log())
    assert student_bins.shape == teacher_bins.shape == (1, k + 1)
    assert token_divergence(student_bins, teacher_bins, beta).item() == pytest.approx(want, abs=1e-6)
    if k == 2:  # the numbers themselves, for the reader: forward KL 0.5 ln(5/3) + 0.3 ln(3/2) + 0.2 ln(2/5)
        forward = 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.5)
        assert divergence_by_hand(s, t, 0.0) == pytest.approx(forward, abs=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_k_equal_to_the_vocabulary_is_the_whole_vocabulary_divergence(beta):
    g = torch.Generator().manual_seed(0)
    student = torch.log_softmax(3 * torch.randn(6, 50, generator=g), -1)
    teacher = torch.log_softmax(3 * torch.randn(6, 50, generator=g), -1)
    top = teacher.topk(50)
    got = token_divergence(*topk_bins(student, top.indices, top.values), beta)
    torch.testing.assert_close(got, token_divergence(student, teacher, beta), atol=1e-6, rtol=0)


def test_the_tail_bin_pulls_the_students_tail_toward_the_teachers():
    """Forward KL with the teacher's tail larger than the student's: the gradient raises the
    logits outside the top k (a renormalised top-k loss would lower them)."""
    z = torch.tensor([[4.0, 3.0, -3.0, -3.0]], requires_grad=True)  # the student's tail: ~0.003
    teacher_top = torch.tensor([[0.45, 0.35]]).log()  # the teacher's tail: 0.2
    token_divergence(*topk_bins(torch.log_softmax(z, -1), torch.tensor([[0, 1]]), teacher_top), 0.0).sum().backward()
    assert (z.grad[0, 2:] < 0).all(), z.grad  # descent raises them


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_chunked_topk_divergence_equals_the_full_logits_one(beta, chunk_size):
    g = torch.Generator().manual_seed(1)
    n, h, v, k = 7, 8, 11, 4
    hidden, weight, bias = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((n, h), (v, h), (v,)))
    top = torch.log_softmax(torch.randn(n, v, generator=g), -1).topk(k)
    full = token_divergence(*topk_bins(torch.log_softmax(hidden @ weight.T + bias, -1), top.indices, top.values), beta).sum()
    want = torch.autograd.grad(full, (hidden, weight, bias))
    got = selected_topk_divergence_sum(hidden, weight, top.indices, top.values, beta=beta, student_bias=bias,
                                       chunk_size=chunk_size)
    assert got.item() == pytest.approx(full.item(), abs=1e-5)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight, bias)), want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def models():
    return load_causal_lm(TINY_MODEL, random_init=True, seed=0), load_causal_lm(TINY_MODEL, random_init=True, seed=1)


def served(teacher, samples, k):
    """The samples as a teacher server scores them: at each trained position i the teacher's k most
    likely tokens given tokens < i and their log-probabilities ([0] * k elsewhere)."""
    out = []
    for s in samples:
        with torch.no_grad():
            logp = torch.log_softmax(teacher(input_ids=torch.tensor([s.input_ids]), use_cache=False).logits[0].float(), -1)
        top = logp.topk(k)  # row j: the distribution of token j + 1
        ids = [[0] * k] + [top.indices[i - 1].tolist() if m else [0] * k for i, m in enumerate(s.loss_mask) if i]
        lps = [[0.0] * k] + [top.values[i - 1].tolist() if m else [0.0] * k for i, m in enumerate(s.loss_mask) if i]
        out.append(dataclasses.replace(s, teacher_topk_ids=ids, teacher_topk_logprobs=lps))
    return out


def test_the_topk_fields_survive_packing_and_rank_splits(models):
    student, teacher = models
    samples = served(teacher, rollout_samples(student, n=8), k=3)
    halves = [rank_share(from_wire(to_wire({"samples": samples, "replay": {}}))["samples"], r, 2) for r in (0, 1)]
    assert halves[0] + halves[1] == samples  # the wire and the split keep every value
    for budget, packing in [(4096, "padded"), (40, "packed")]:
        seen = {}
        for mb in build_step(samples, micro_batch_tokens=budget, packing=packing)["micro_batches"]:
            assert mb["teacher_topk_ids"].shape == (*mb["input_ids"].shape, 3) and mb["teacher_topk_ids"].dtype == torch.long
            for index in mb["sequence_ids"].unique().tolist():
                if index >= 0:
                    at = mb["sequence_ids"] == index
                    seen[index] = (mb["teacher_topk_ids"][at].tolist(), mb["teacher_topk_logprobs"][at])
        for i, s in enumerate(samples):
            assert seen[i][0] == s.teacher_topk_ids, (budget, packing, i)
            torch.testing.assert_close(seen[i][1], torch.tensor(s.teacher_topk_logprobs))


def test_samples_refuse_top_k_rows_of_another_length():
    with pytest.raises(ValueError, match="teacher_topk_ids has 2 rows"):
        Sample(input_ids=[1, 2, 3], loss_mask=[False, True, True], teacher_topk_ids=[[1], [2]],
               teacher_topk_logprobs=[[0.0], [0.0], [0.0]])
    with pytest.raises(ValueError, match="not one k"):
        Sample(input_ids=[1, 2], loss_mask=[False, True], teacher_topk_ids=[[1], [2, 3]], teacher_topk_logprobs=[[0.0], [0.0, 0.0]])


class ServedTeacherStep(OneStep):
    has_teacher = True  # as a RolloutDataModule whose runtime serves a teacher


def reference_update(student, samples, beta):
    """Parameters after one SGD step (lr 1) on the top-k divergence of the full logits at every
    trained position, over their number, all samples as one batch; and the loss."""
    student = copy.deepcopy(student)
    total, count = torch.zeros(()), 0
    for s in samples:
        ids = torch.tensor([s.input_ids])
        at = torch.tensor(s.loss_mask[1:])  # positions whose next token is trained
        ours = torch.log_softmax(student(input_ids=ids, use_cache=False).logits[0, :-1][at].float(), -1)
        top_ids = torch.tensor(s.teacher_topk_ids[1:])[at]
        top_lps = torch.tensor(s.teacher_topk_logprobs[1:])[at]
        total, count = total + token_divergence(*topk_bins(ours, top_ids, top_lps), beta).sum(), count + int(at.sum())
    loss = total / count
    return sgd_step(student, loss), loss.item()


@pytest.mark.parametrize("divergence, beta, k", [("reverse_kl", 1.0, 4), ("forward_kl", 0.0, 4), ("jsd", 0.3, 20)])
def test_one_step_on_a_servers_top_k_equals_the_reference(models, divergence, beta, k):
    student, teacher = models
    samples = served(teacher, rollout_samples(student, n=8), k)
    want, want_loss = reference_update(student, samples, beta)
    for budget, packing in [(4096, "padded"), (40, "packed")]:
        module = OPD(model=TINY_MODEL, optimizer=sgd, max_grad_norm=None, divergence=divergence, beta=beta,
                     teacher_top_k=k, head_chunk_size=7)
        assert module.served_teacher_top_k == k  # what the rollout data module asks the teacher server for
        module.model = copy.deepcopy(student)
        step = build_step(samples, micro_batch_tokens=budget, packing=packing)
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, datamodule=ServedTeacherStep(step))
        assert trainer.callback_metrics["train/divergence"].item() == pytest.approx(want_loss, abs=1e-5)
        for (name, a), b in zip(want.named_parameters(), module.model.parameters()):
            torch.testing.assert_close(b, a, atol=2e-6, rtol=0, msg=lambda m: f"{divergence} {budget}/{packing} {name}: {m}")


def test_top_k_is_checked_at_construction():
    with pytest.raises(ValueError, match="teacher_top_k must be an int >= 1, got 0"):
        OPD(model=TINY_MODEL, divergence="reverse_kl", teacher_top_k=0)


def test_a_teacher_server_that_cannot_return_the_top_k_is_refused_before_the_policys_server(vllm_server, tmp_path,
                                                                                          lit_rl_main):
    """An existing teacher server (the session's, vLLM's default --max-logprobs 20) asked for 32 tokens
    per position: one message before training and before the policy's server starts, where every
    rollout's scoring used to fail once training had begun. A teacher lit-rl starts gets
    --max-logprobs raised to the top k instead (unless its options set it)."""
    from helpers import reverse_rows, write_jsonl
    from test_graceful_stop import EXAMPLES

    from lit_rl.inference.runtime import with_max_logprobs

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    root = tmp_path / "run"
    code, _, err = lit_rl_main(["fit", "--config", str(EXAMPLES / "opd.yaml"), "--model.init_args.model",
                                str(vllm_server.model_dir), "--data.init_args.env.init_args.path", data,
                                "--model.init_args.teacher_top_k", "32", "--inference.teacher_model", "null",
                                "--inference.teacher_server", "{}", "--inference.teacher_base_url", vllm_server.base_url,
                                "--trainer.default_root_dir", str(root), "--trainer.max_steps", "1"])
    assert code == 1, err[-3000:]
    assert "cannot return model.init_args.teacher_top_k=32 tokens per position" in err, err[-3000:]
    assert "max allowed: 20" in err and "start it with --max-logprobs 32 or more" in err, err[-3000:]
    assert not (root / "vllm.log").exists()  # the policy's server never started
    assert with_max_logprobs({"extra_args": ["--seed", "1"]}, 32)["extra_args"] == ["--seed", "1", "--max-logprobs", "32"]
    assert with_max_logprobs({"extra_args": ["--max-logprobs=64"]}, 32)["extra_args"] == ["--max-logprobs=64"]
    assert "extra_args" not in with_max_logprobs({}, 20)
