"""Packing: budgets, layouts, RL fields and sequence ids, packed logits == unpacked logits, build_step."""

import pytest
import torch

from lit_rl.data.packing import pack_micro_batches, padding_fraction
from lit_rl.data.samples import Sample
from lit_rl.data.step_builder import build_step


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


def test_pack_length_above_the_micro_batch_budget_is_refused():
    """A packed row of pack_length tokens is a whole micro-batch: a longer one breaks the bound."""
    with pytest.raises(ValueError, match="pack_length=300 exceeds micro_batch_tokens=200"):
        pack_micro_batches(make_samples([150] * 4), micro_batch_tokens=200, mode="packed", pack_length=300)


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


# ---- RL fields: per-token values and sequence ids survive both layouts --------------------------
RL_FIELDS = ("logprobs", "advantages", "teacher_logprobs")


def make_rl_samples(lengths, seed=0):
    """Samples with every per-token field set to distinct random values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in make_samples(lengths, seed=seed):
        n = len(s)
        values = {name: torch.randn(n, generator=g).tolist() for name in RL_FIELDS}
        out.append(Sample(input_ids=s.input_ids, loss_mask=s.loss_mask, policy_version=3, reward=1.0, source="policy", **values))
    return out


RL_LENGTHS = [9, 31, 4, 17, 17, 2, 25, 12, 6, 20]


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_rl_fields_read_back_exactly_by_sequence_id(mode):
    samples = make_rl_samples(RL_LENGTHS, seed=2)
    mbs = pack_micro_batches(samples, micro_batch_tokens=80, mode=mode, pack_length=40)
    assert len(mbs) > 1 and any((mb["sequence_ids"] == -1).any() for mb in mbs)  # several micro-batches, some padding
    if mode == "packed":  # the case that matters: several sequences share a row
        assert any(len(set(row.tolist()) - {-1}) > 1 for mb in mbs for row in mb["sequence_ids"])
    seen = []
    for mb in mbs:
        seq = mb["sequence_ids"]
        assert seq.dtype == torch.long
        for name in RL_FIELDS:
            assert mb[name].dtype == torch.float32 and mb[name].shape == seq.shape
        pad = seq == -1
        assert not mb["loss_mask"][pad].any() and (mb["input_ids"][pad] == 0).all()
        assert all((mb[name][pad] == 0).all() for name in RL_FIELDS)
        for i in seq.unique().tolist():
            if i == -1:
                continue
            seen.append(i)
            at = seq == i
            assert len(set(torch.nonzero(at)[:, 0].tolist())) == 1  # a sequence lives in one row of one micro-batch
            assert mb["input_ids"][at].tolist() == samples[i].input_ids
            for name in RL_FIELDS:
                assert mb[name][at].tolist() == torch.tensor(getattr(samples[i], name), dtype=torch.float32).tolist()
    assert sorted(seen) == list(range(len(samples)))  # every index once across all micro-batches of the call


def per_sequence_sums(mbs, n):
    """Per sequence: sum over targets of advantages * (logprobs - teacher_logprobs), the shape of an RL loss."""
    sums = torch.zeros(n)
    for mb in mbs:
        keep = mb["loss_mask"] & (mb["sequence_ids"] >= 0)
        values = mb["advantages"] * (mb["logprobs"] - mb["teacher_logprobs"])
        sums.index_add_(0, mb["sequence_ids"][keep], values[keep])
    return sums


def test_per_sequence_sums_packed_equal_padded():
    samples = make_rl_samples(RL_LENGTHS, seed=3)
    packed = pack_micro_batches(samples, micro_batch_tokens=80, mode="packed", pack_length=40)
    padded = pack_micro_batches(samples, micro_batch_tokens=80, mode="padded")
    expected = torch.tensor(
        [sum(a * (lp - t) for a, lp, t, m in list(zip(s.advantages, s.logprobs, s.teacher_logprobs, s.loss_mask))[1:] if m) for s in samples]
    )
    torch.testing.assert_close(per_sequence_sums(packed, len(samples)), per_sequence_sums(padded, len(samples)))
    torch.testing.assert_close(per_sequence_sums(packed, len(samples)), expected)


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_rl_keys_only_when_some_sample_has_them(mode):
    static = make_samples([12, 12, 12, 12])
    for mb in pack_micro_batches(static, micro_batch_tokens=24, mode=mode):
        assert set(mb) == {"input_ids", "position_ids", "loss_mask", "sequence_ids"}  # SFT steps carry no RL tensors
    (rl,) = make_rl_samples([12], seed=4)
    rl.teacher_logprobs = None
    mixed = [*static[:3], rl]
    mbs = pack_micro_batches(mixed, micro_batch_tokens=24, mode=mode)
    assert len(mbs) == 2
    for mb in mbs:  # present in every micro-batch of the call, zeros for the samples lacking them
        assert set(mb) == {"input_ids", "position_ids", "loss_mask", "sequence_ids", "logprobs", "advantages"}
        for name in ("logprobs", "advantages"):
            assert (mb[name][mb["sequence_ids"] != 3] == 0).all()
    got = torch.cat([mb["logprobs"][mb["sequence_ids"] == 3] for mb in mbs])
    assert got.tolist() == torch.tensor(rl.logprobs).tolist()


@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_build_step_stats_and_micro_batches(packing):
    samples = make_samples([10, 4, 7])
    samples[1].truncated = True
    step = build_step(samples, micro_batch_tokens=64, packing=packing, pack_length=32)
    mbs = pack_micro_batches(samples, micro_batch_tokens=64, mode=packing, pack_length=32)
    assert len(step["micro_batches"]) == len(mbs) == 1
    assert all(torch.equal(step["micro_batches"][0][k], v) for k, v in mbs[0].items())
    slots = {"padded": 3 * 10, "packed": 21}[packing]
    assert step["stats"] == {"rows": 3.0, "micro_batches": 1.0, "truncated_rows": 1.0, "padding_fraction": pytest.approx(1 - 21 / slots),
                             "_token_slots": float(slots)}
    assert build_step([], micro_batch_tokens=64, packing=packing) == {
        "micro_batches": [],
        "stats": {"rows": 0.0, "micro_batches": 0.0, "truncated_rows": 0.0, "padding_fraction": 0.0, "_token_slots": 0.0},
    }
