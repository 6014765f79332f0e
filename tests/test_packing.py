"""Packing: budgets, layouts, and packed logits == unpacked logits for every document."""

import pytest
import torch

from lit_rl.data.packing import pack_micro_batches, padding_fraction
from lit_rl.data.samples import Sample


def make_samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, 250, (n,), generator=g).tolist()
        mask = [i >= n // 2 for i in range(n)]
        out.append(Sample(input_ids=ids, loss_mask=mask))
    return out


def documents(mb):
    """(row, start, span) of every document from restarting position ids; a row's last span
    also holds the row's padding, which continues its positions."""
    docs = []
    for r, pos in enumerate(mb["position_ids"].tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        docs += [(r, a, b - a) for a, b in zip(starts, starts[1:])]
    return docs


def placed(mbs, samples):
    """Where each sample went: {sample index: (micro-batch, row, start)}; a sample is the whole
    span of its document, or its start when the rest of the span is the row's padding."""
    out = {}
    for m, mb in enumerate(mbs):
        for r, a, span in documents(mb):
            last = a + span == mb["input_ids"].shape[1]
            ids = mb["input_ids"][r, a : a + span].tolist()
            for i, s in enumerate(samples):
                n = len(s.input_ids)
                if i not in out and ids[:n] == s.input_ids and (n == span or (last and n < span)):
                    assert not mb["loss_mask"][r, a + n : a + span].any()  # padding is never a target
                    out[i] = (m, r, a)
                    break
    return out


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_budget_and_every_sample_placed_once(mode):
    samples = make_samples([5, 17, 3, 30, 12, 8, 8, 25])
    mbs = pack_micro_batches(samples, micro_batch_tokens=40, mode=mode)
    assert all(mb["input_ids"].numel() <= 40 for mb in mbs)
    assert sorted(placed(mbs, samples)) == list(range(len(samples)))
    real = sum(len(s) for s in samples)
    assert sum(int(mb["loss_mask"].sum()) for mb in mbs) == sum(sum(s.loss_mask[1:]) for s in samples)
    assert sum(mb["input_ids"].numel() for mb in mbs) >= real


def test_packed_rows_hold_several_documents_and_restart_positions():
    samples = make_samples([10, 10, 10])
    (mb,) = pack_micro_batches(samples, micro_batch_tokens=32, mode="packed")
    assert mb["input_ids"].shape == (1, 30)
    assert mb["position_ids"][0].tolist() == list(range(10)) * 3
    # a document's first token is never a target: nothing of its own predicts it
    assert not mb["loss_mask"][0, [0, 10, 20]].any()
    assert mb["loss_mask"].sum().item() == 3 * 5


def test_padding_fraction_and_oversized_sample():
    samples = make_samples([10, 4])
    mbs = pack_micro_batches(samples, micro_batch_tokens=64, mode="padded")
    assert mbs[0]["input_ids"].shape == (2, 10)
    assert padding_fraction(mbs, 14) == pytest.approx(6 / 20)
    # the padding continues its row's positions: to transformers the micro-batch is unpacked,
    # so attention runs causal with no mask at all
    from transformers.masking_utils import find_packed_sequence_indices

    assert mbs[0]["position_ids"].tolist() == [list(range(10))] * 2
    assert find_packed_sequence_indices(mbs[0]["position_ids"]) is None
    with pytest.raises(ValueError, match="does not fit"):
        pack_micro_batches(make_samples([50]), micro_batch_tokens=40)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_packed_logits_equal_unpacked_logits(tiny_model, mode):
    tiny_model.eval()  # no dropout; the comparison is about attention, not noise
    samples = make_samples([7, 19, 12, 3, 26], seed=1)
    mbs = pack_micro_batches(samples, micro_batch_tokens=80, mode=mode)
    where = placed(mbs, samples)
    assert len(where) == len(samples)
    logits = [tiny_model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits for mb in mbs]
    for i, (m, r, a) in where.items():
        ids = samples[i].input_ids
        alone = tiny_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        torch.testing.assert_close(logits[m][r, a : a + len(ids)], alone, atol=1e-5, rtol=1e-5)
