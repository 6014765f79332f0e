"""Dropout while training: off for GRPO and OPD by default (their losses compare the trainer's
log-probabilities with the sampler's, which runs without dropout), kept for SFT.

Before, a model with dropout (GPT-2's 0.1, or an `attention_dropout` in the config) trained GRPO
and OPD with it on: two training-mode passes over the same tokens disagreed, and so did the
trainer and vLLM (mismatch_kl 1e-3 to 1e-2 on random tiny models instead of 1e-12).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import TINY_MODEL
from lit_rl.lora import LoRAOptions
from lit_rl.modules.grpo import GRPO
from lit_rl.modules.opd import OPD
from lit_rl.modules.sft import SFT


def qwen3_with_attention_dropout() -> transformers.PreTrainedModel:
    """The tiny Qwen3 with `attention_dropout` 0.3: a float the attention hands to sdpa, no module."""
    config = transformers.AutoConfig.from_pretrained(TINY_MODEL, attention_dropout=0.3)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def gpt2_with_dropout_modules() -> transformers.PreTrainedModel:
    """A tiny GPT-2: nn.Dropout modules (embeddings, attention, residual), 0.1 each by default."""
    config = transformers.GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=256, eos_token_id=256)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def training_passes_agree(module) -> bool:
    """Two forwards in training mode give the logits of eval mode, i.e. no dropout acts."""
    module.configure_model()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        module.eval()
        reference = module.model(ids).logits
        module.train()
        first, second = module.model(ids).logits, module.model(ids).logits
    return torch.equal(first, reference) and torch.equal(second, reference)


@pytest.mark.parametrize("build", [qwen3_with_attention_dropout, gpt2_with_dropout_modules])
def test_grpo_and_opd_train_without_dropout_and_sft_keeps_it(build):
    for make, expected in ((lambda: GRPO(model=TINY_MODEL), True), (lambda: OPD(model=TINY_MODEL), True),
                           (lambda: SFT(model=TINY_MODEL), False),
                           (lambda: GRPO(model=TINY_MODEL, disable_dropout=False), False),
                           (lambda: SFT(model=TINY_MODEL, disable_dropout=True), True)):
        module = make()
        module.model = build()  # kept by configure_model, as a model set beforehand is
        assert training_passes_agree(module) is expected, (type(module).__name__, module.disable_dropout)
    # what is exported keeps the model's own values
    module = GRPO(model=TINY_MODEL)
    module.model = build()
    module.configure_model()
    config = module.model.config
    assert getattr(config, "attention_dropout", None) == 0.3 or getattr(config, "attn_pdrop", None) == 0.1


def test_dropout_on_a_lora_adapter_and_disable_dropout_together_are_refused():
    with pytest.raises(ValueError, match=r"model.lora.dropout 0.05 asks for dropout on the adapter, and "
                                         r"model.disable_dropout true \(GRPO's and OPD's default\)"):
        GRPO(model=TINY_MODEL, lora=LoRAOptions(rank=4, dropout=0.05))
    GRPO(model=TINY_MODEL, lora=LoRAOptions(rank=4, dropout=0.05), disable_dropout=False)
    SFT(model=TINY_MODEL, lora=LoRAOptions(rank=4, dropout=0.05))
    # an adapter without dropout on a base whose dropout is turned off: the base's only
    module = GRPO(model=TINY_MODEL, lora=LoRAOptions(rank=4))
    module.model = qwen3_with_attention_dropout()
    assert training_passes_agree(module)


@pytest.mark.parametrize("build", [qwen3_with_attention_dropout, gpt2_with_dropout_modules])
def test_a_model_that_trains_with_dropout_keeps_the_chunked_head(build):
    """SFT keeps a model's dropout: the check that its logits are the head over the hidden states
    ran its two passes with dropout on, drew two masks, and fell back to full [B, T, V] logits for
    the whole run (with a warning about soft-capping). The modes are as they were afterwards."""
    module = SFT(model=TINY_MODEL)
    module.model = build()
    module.configure_model()
    module.train()
    module.model.get_input_embeddings().eval()  # one module left in eval mode: every mode must come back as it was
    modes = {name: m.training for name, m in module.model.named_modules()}
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    assert module._uses_plain_head({"input_ids": ids, "position_ids": torch.arange(16)[None]})
    assert {name: m.training for name, m in module.model.named_modules()} == modes
