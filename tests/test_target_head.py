"""The module's head at trained positions only equals the full-logits computation.

SFT's loss and every parameter's gradient, and the per-token logprobs and entropies GRPO
builds on, against the same quantities from the model's full logits, to 1e-5 in float32:
several micro-batches, padded and packed, a tied and an untied head. And the point of it
all: no tensor of `[all positions, vocab]` is built, only `[head_chunk_size, vocab]`.
"""

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config

from lit_rl.data.packing import pack_micro_batches
from lit_rl.data.render import render_messages
from lit_rl.data.samples import Sample
from lit_rl.losses import masked_cross_entropy_sum, shifted_token_logprobs, token_entropy
from lit_rl.modules.sft import SFT
from helpers import TINY_MODEL, reverse_rows

VOCAB = 1000  # larger than the tokenizer's 320 ids, so a wrong row of the head would show


def tiny(tied: bool, vocab_size: int = VOCAB):
    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.vocab_size, config.tie_word_embeddings = vocab_size, tied
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def module_with(model, **kw) -> SFT:
    module = SFT(model=TINY_MODEL, **kw)
    module.model = model
    return module


@pytest.fixture(scope="module")
def samples(tokenizer_module):
    rendered = [render_messages(tokenizer_module, row["messages"]) for row in reverse_rows(12)]
    return [Sample(input_ids=r.input_ids, loss_mask=r.loss_mask) for r in rendered]


@pytest.fixture(scope="module")
def tokenizer_module():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


def full_logits_loss(model, mb):
    logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
    return masked_cross_entropy_sum(logits, mb["input_ids"], mb["loss_mask"]), logits


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_sft_loss_and_gradients_equal_full_logits(samples, tied, packing):
    model = tiny(tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    module = module_with(model, head_chunk_size=16)  # several chunks per micro-batch
    micro_batches = pack_micro_batches(samples, micro_batch_tokens=96, mode=packing)
    assert len(micro_batches) > 2
    params = list(model.parameters())
    trained = sum(int(mb["loss_mask"][:, 1:].sum()) for mb in micro_batches)  # the step's normaliser, as in training
    ours = sum(module.micro_batch_loss_sum(mb) for mb in micro_batches) / trained
    our_grads = torch.autograd.grad(ours, params)
    theirs = sum(full_logits_loss(model, mb)[0] for mb in micro_batches) / trained
    their_grads = torch.autograd.grad(theirs, params)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    for (name, _), a, b in zip(model.named_parameters(), our_grads, their_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("tied", [True, False])
def test_target_logprobs_and_entropy_equal_full_logits(samples, tied):
    model = tiny(tied)
    module = module_with(model, head_chunk_size=16)
    (mb, *_) = pack_micro_batches(samples, micro_batch_tokens=512, mode="packed")
    mask = mb["loss_mask"].clone()
    mask[:, 0] = False
    lp, ent = module.target_logprobs(mb, with_entropy=True)
    g = torch.Generator().manual_seed(0)
    up = torch.randn(mask.shape, generator=g) / mask.sum()  # per-token weights, normalised like a loss
    params = list(model.parameters())
    our_grads = torch.autograd.grad((lp * up).sum() + ent.sum() / mask.sum(), params)
    _, logits = full_logits_loss(model, mb)
    want_lp = shifted_token_logprobs(logits, mb["input_ids"]) * mask
    want_ent = token_entropy(logits) * mask
    their_grads = torch.autograd.grad((want_lp * up).sum() + want_ent.sum() / mask.sum(), params)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    assert lp[~mask].abs().sum() == 0 and ent[~mask].abs().sum() == 0
    for (name, _), a, b in zip(model.named_parameters(), our_grads, their_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


class LargestLogits(TorchDispatchMode):
    """Records the most rows of any tensor whose last dimension is the vocabulary (the
    head's weight itself and views of it excluded)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden, self.rows = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab and t.numel() != self.vocab * self.hidden:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_logits_of_all_positions_are_built(samples):
    model = tiny(tied=True)
    module = module_with(model, head_chunk_size=8)
    (mb,) = pack_micro_batches(samples, micro_batch_tokens=1024, mode="padded")
    positions = mb["input_ids"].numel()
    assert positions > 8 * model.config.hidden_size // VOCAB + 100  # far more positions than a chunk
    module.micro_batch_loss_sum({k: v[:1] for k, v in mb.items()})  # the one-off head check
    with LargestLogits(VOCAB, model.config.hidden_size) as seen:
        loss = module.micro_batch_loss_sum(mb)
        loss.backward()
        module.target_logprobs(mb, with_entropy=True)[0].sum().backward()
    assert 0 < seen.rows <= 8
    with LargestLogits(VOCAB, model.config.hidden_size) as full:  # what the full-logits path builds
        full_logits_loss(model, mb)[0].backward()
    assert full.rows >= positions


def test_a_model_that_soft_caps_its_logits_keeps_the_full_logits_path(samples, caplog):
    config = Gemma2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, final_logit_softcapping=5.0, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    module = module_with(model)
    micro_batches = pack_micro_batches(samples, micro_batch_tokens=128, mode="padded")
    with caplog.at_level(logging.WARNING):
        ours = [module.micro_batch_loss_sum(mb) for mb in micro_batches]
    assert "transforms its logits" in caplog.text
    for mb, got in zip(micro_batches, ours):
        torch.testing.assert_close(got, full_logits_loss(model, mb)[0], atol=1e-5, rtol=0)
    lp, _ = module.target_logprobs(micro_batches[0])
    want = shifted_token_logprobs(full_logits_loss(model, micro_batches[0])[1], micro_batches[0]["input_ids"])
    mask = micro_batches[0]["loss_mask"].clone()
    mask[:, 0] = False
    torch.testing.assert_close(lp, want * mask, atol=1e-5, rtol=0)


def test_head_chunk_size_is_checked():
    with pytest.raises(ValueError, match="head_chunk_size"):
        SFT(model=TINY_MODEL, head_chunk_size=0)
