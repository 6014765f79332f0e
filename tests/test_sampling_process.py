"""The trainer's logprobs of the distribution vLLM sampled from: temperature, top-k, top-p.

Held against vLLM's own sampler code (its top-k/top-p masking on the same logits), against
full logits with autograd (the chunked head's value and gradient), and against a real vLLM
server sampling at T=0.7 and top_p 0.9 after a weight reload, where the raw T=1 logprobs the
trainer used before are visibly biased.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from lit_rl.chunked_head import selected_token_logprobs
from lit_rl.modules.model_loading import load_causal_lm
from lit_rl.run_dir import step_dir
from lit_rl.sampling_process import RAW, SamplingProcess
from vllm_fixtures import write_tiny_checkpoint

SETTINGS = [SamplingProcess(temperature=0.7), SamplingProcess(top_k=5), SamplingProcess(top_p=0.9),
            SamplingProcess(temperature=1.3, top_k=20, top_p=0.8)]


def vllm_processed_logprobs(logits: torch.Tensor, process: SamplingProcess) -> torch.Tensor:
    """What vLLM's sampler reports with logprobs_mode processed_logprobs (vllm/v1/sample/sampler.py)."""
    rows = logits.shape[0]
    k = torch.full((rows,), process.top_k, dtype=torch.long) if process.uses_top_k else None
    p = torch.full((rows,), process.top_p) if process.top_p < 1 else None
    return apply_top_k_top_p_pytorch(logits.float() / process.temperature, k, p).log_softmax(-1)


@pytest.mark.parametrize("process", SETTINGS, ids=str)
def test_the_kept_tokens_and_logprobs_are_vllms(process):
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3
    want = vllm_processed_logprobs(logits, process)  # [N, V], -inf where dropped
    ours = process.apply(logits).log_softmax(-1)
    kept = torch.isfinite(want)
    assert torch.equal(ours > -1e29, kept)  # the same tokens dropped
    torch.testing.assert_close(ours[kept], want[kept], atol=1e-5, rtol=0)
    assert bool(kept.all()) == (not process.uses_top_k and process.top_p == 1)  # top-k / top-p really drop tokens here


def test_temperature_alone_keeps_every_token_and_rescales():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    process = SamplingProcess(temperature=0.5)
    torch.testing.assert_close(process.apply(logits).log_softmax(-1), vllm_processed_logprobs(logits, process))
    assert process.kept(logits) is None and RAW.is_identity and not process.is_identity


def test_the_sampled_token_is_kept_even_when_the_trainer_would_drop_it():
    logits = torch.tensor([[5.0, 4.0, 0.0, -3.0]])
    process = SamplingProcess(top_k=2)
    assert process.kept(logits).tolist() == [[True, True, False, False]]
    assert process.kept(logits, torch.tensor([3])).tolist() == [[True, True, False, True]]
    lp = process.apply(logits, torch.tensor([3])).log_softmax(-1)[0, 3]
    assert lp.item() == pytest.approx(-3.0 - math.log(math.exp(5) + math.exp(4) + math.exp(-3)), abs=1e-5)


@pytest.mark.parametrize("process", [RAW, *SETTINGS], ids=str)
def test_the_chunked_head_equals_full_logits_in_value_and_gradient(process):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = (torch.randn(120, 16, generator=g) * 0.7).requires_grad_()
    bias = torch.randn(120, generator=g, requires_grad=True)
    targets = torch.randint(0, 120, (23,), generator=g)
    upstream_lp, upstream_ent = torch.randn(23, generator=g), torch.randn(23, generator=g)

    logp = process.apply(hidden @ weight.T + bias, targets).log_softmax(-1)  # [N, V]
    want_lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    want = torch.autograd.grad((want_lp * upstream_lp).sum() + (want_ent * upstream_ent).sum(), (hidden, weight, bias))
    lp, ent = selected_token_logprobs(hidden, weight, targets, bias=bias, chunk_size=5, with_entropy=True, process=process)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    got = torch.autograd.grad((lp * upstream_lp).sum() + (ent * upstream_ent).sum(), (hidden, weight, bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_settings_are_one_error():
    with pytest.raises(ValueError) as e:
        SamplingProcess(temperature=0.0, top_k=-2, top_p=1.5)
    assert all(s in str(e.value) for s in ("temperature must be > 0", "top_k must be", "top_p must be in (0, 1]"))


def mismatch_kl(trainer: torch.Tensor, sampler: torch.Tensor) -> float:
    """The logged train/mismatch_kl: mean of w - log w - 1, log w = trainer - sampler logprob."""
    log_w = trainer - sampler
    return float((log_w.exp() - log_w - 1).mean())


def test_a_real_server_after_a_reload_reports_the_logprobs_the_trainer_computes(vllm_server):
    """A sharp model (random weights, logits x 4) reloaded into the session server (started by
    VLLMServer, hence processed_logprobs); completions sampled at T=1, T=0.7 and top_p 0.9. The
    trainer's logprobs of the sampled distribution match the server's at every setting as at T=1;
    the raw T=1 ones it used before are off by orders of magnitude more where the setting is not 1."""
    weights = write_tiny_checkpoint(step_dir(vllm_server.root, 41), seed=3, logit_scale=4.0)
    model = load_causal_lm(str(weights)).eval()
    head = model.get_output_embeddings().weight
    settings = {"t1": RAW, "t07": SamplingProcess(temperature=0.7), "p09": SamplingProcess(top_p=0.9)}

    async def sample():
        async with vllm_server.client() as client:
            await client.reload_weights(weights)
            out = {}
            for name, p in settings.items():
                out[name] = await asyncio.gather(*[client.generate([10 + i, 20, 30], max_tokens=24, temperature=p.temperature,
                                                                   top_p=p.top_p, seed=i) for i in range(6)])
            return out

    completions = asyncio.run(sample())
    processed, raw = {}, {}
    for name, process in settings.items():
        ours, theirs, plain = [], [], []
        for (c,) in completions[name]:
            ids = torch.tensor([c.prompt_ids + c.completion_ids])
            with torch.no_grad():
                hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, len(c.prompt_ids) - 1:-1]
                targets = ids[0, len(c.prompt_ids):]
                ours.append(selected_token_logprobs(hidden, head, targets, process=process)[0])
                plain.append(selected_token_logprobs(hidden, head, targets)[0])
            theirs.append(torch.tensor(c.logprobs))
        processed[name] = mismatch_kl(torch.cat(ours), torch.cat(theirs))
        raw[name] = mismatch_kl(torch.cat(plain), torch.cat(theirs))
    print(f"mismatch_kl, trainer's processed logprobs: {processed}; the raw T=1 ones: {raw}")
    floor = max(processed["t1"], 1e-7)
    assert processed["t07"] < 10 * floor + 1e-6 and processed["p09"] < 10 * floor + 1e-6
    assert raw["t07"] > 1e-3 and raw["p09"] > 1e-3  # the bias the processed logprobs remove
