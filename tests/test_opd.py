"""On-policy distillation: teacher scoring inside the rollout buffer against the session's vLLM
server, the tokenizer check, and OPD through the real CLI. A teacher server that dies mid-run is
checked in tests/test_rollout_buffer.py, on the throwaway server its crash checks share.

Teacher scores are compared with HF's logprobs of the teacher's weights at LOGPROB_TOL (see
tests/test_rollout_buffer.py: measured 9.5e-7 for vLLM vs HF in float32 on CPU).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import REPO, TINY_MODEL, reverse_rows, write_jsonl
from test_rollout_buffer import FAST, LOGPROB_TOL, TOK, collect, hf_logprobs, hf_model
from transformers import AutoTokenizer
from vllm_fixtures import write_tiny_checkpoint

from lit_rl.rollouts.buffer import RolloutBuffer
from lit_rl.rollouts.context import TrainSampling
from lit_rl.rollouts.envs import ReverseTextEnv
from lit_rl.rollouts.teacher import tokenizer_mismatch

CONFIG = str(REPO / "examples" / "reverse_text" / "opd.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("opd_data") / "train.jsonl", reverse_rows(40))


def test_the_teacher_scores_exactly_the_sampled_tokens(vllm_server, data):
    """The session's server is student and teacher at once: the teacher's logprob of every
    completion token equals HF's for the served weights (and the sampler's); prompts get 0. With
    `teacher_top_k` each completion position also carries HF's top k there ([0] * k on the prompt)."""
    buffer = RolloutBuffer(ReverseTextEnv(data), vllm_server.client, TOK, TrainSampling(max_tokens=8),
                           batch_size=4, group_size=2, num_batches=2, teacher=vllm_server.client, teacher_top_k=3, **FAST)
    batches = asyncio.run(collect(buffer))
    worst_hf = worst_sampler = 0.0
    for s in (s for b in batches for s in b):
        n = s.loss_mask.index(True)
        assert s.teacher_logprobs[:n] == [0.0] * n
        assert s.teacher_topk_ids[:n] == [[0] * 3] * n and s.teacher_topk_logprobs[:n] == [[0.0] * 3] * n
        with torch.no_grad():
            full = torch.log_softmax(hf_model(str(vllm_server.model_dir))(torch.tensor([s.input_ids]), use_cache=False).logits[0], -1)
        for i in range(n, len(s)):  # the distribution of token i given the ones before it
            assert s.teacher_topk_logprobs[i] == pytest.approx(full[i - 1].topk(3).values.tolist(), abs=LOGPROB_TOL)
            assert [full[i - 1, t].item() for t in s.teacher_topk_ids[i]] == pytest.approx(s.teacher_topk_logprobs[i], abs=LOGPROB_TOL)
        ref = hf_logprobs(vllm_server.model_dir, s.input_ids)
        worst_hf = max(worst_hf, max(abs(a - b) for a, b in zip(s.teacher_logprobs[n:], ref[n:])))
        worst_sampler = max(worst_sampler, max(abs(a - b) for a, b in zip(s.teacher_logprobs[n:], s.logprobs[n:])))
    print(f"max |teacher - HF| {worst_hf:.2e}, |teacher - sampler| {worst_sampler:.2e}")
    assert worst_hf < LOGPROB_TOL and worst_sampler < LOGPROB_TOL
    m = buffer.metrics()
    assert m["rollout/teacher_s_per_group"] > 0
    assert "teacher" in buffer.progress()


def test_a_teacher_must_share_the_students_tokenizer(tmp_path):
    same = AutoTokenizer.from_pretrained(TINY_MODEL)
    assert tokenizer_mismatch(TOK, same) is None
    bigger = AutoTokenizer.from_pretrained(TINY_MODEL)
    bigger.add_tokens(["<teacher_only>"])
    assert "another vocabulary" in tokenizer_mismatch(TOK, bigger) and "<teacher_only>" in tokenizer_mismatch(TOK, bigger)
    template = AutoTokenizer.from_pretrained(TINY_MODEL)
    template.chat_template = "{{ messages[0]['content'] }}"
    assert "chat template" in tokenizer_mismatch(TOK, template)


def test_a_teacher_that_only_scores_is_served_without_a_tokenizer_and_one_that_samples_keeps_it(tmp_path):
    """OPD's teacher only scores the policy's ids: its server skips the tokenizer, so vLLM does not
    turn the top-k tokens at every position into text nobody reads (docs/benchmarks.md, "A teacher
    that only scores"). A teacher whose completions are the data keeps it (stop strings, text), and
    a user's `--no-skip-tokenizer-init` is kept. (The server started so: tests/test_graceful_stop.py.)"""
    from lit_rl.inference.runtime import InferenceRuntime, scoring_only
    from lit_rl.run_seed import with_sampler_seed

    def extra_args(runtime, policy):
        runtime.use(policy=policy, teacher=True, tokenizer=TINY_MODEL, teacher_top_k=8 if policy else 0)
        return runtime.teacher_server_options(tmp_path, 0).get("extra_args", [])

    teacher = write_tiny_checkpoint(tmp_path / "teacher", seed=1)  # never served here
    runtime = InferenceRuntime(teacher_model=teacher, teacher_server={"dtype": "float32"})
    assert "--skip-tokenizer-init" in extra_args(runtime, policy=True)  # OPD: the policy samples
    assert "--skip-tokenizer-init" not in extra_args(runtime, policy=False)  # SFT on the teacher's completions
    kept = InferenceRuntime(teacher_model=teacher, teacher_server={"extra_args": ["--no-skip-tokenizer-init"]})
    assert "--skip-tokenizer-init" not in extra_args(kept, policy=True)
    assert "--no-skip-tokenizer-init" in extra_args(kept, policy=True)
    # extra_args given as one string: refused by name (below), never split into characters
    assert scoring_only(with_sampler_seed({"extra_args": "--max-num-seqs 8"}, 0)) == {"extra_args": "--max-num-seqs 8"}


def test_a_teacher_without_weights_passes_with_a_load_format_of_the_users():
    """vLLM's `--load-format dummy` serves a config without weight files (random weights)."""
    from lit_rl.inference.runtime import InferenceRuntime

    with pytest.raises(ValueError, match="has no weights"):
        InferenceRuntime(teacher_model=TINY_MODEL)
    for extra_args in (["--load-format", "dummy"], ["--load-format=dummy"]):
        assert InferenceRuntime(teacher_model=TINY_MODEL, teacher_server={"extra_args": extra_args}).teacher_model


def opd_args(root, data, model, steps, *extra):
    return ["fit", "--config", CONFIG, "--model.init_args.model", model,
            "--data.init_args.env.init_args.path", data,
            "--data.init_args.batch_size", "8", "--data.init_args.group_size", "2", "--data.init_args.max_tokens", "12",
            "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(steps), *extra]


def test_opd_without_a_teacher_or_with_another_tokenizer_is_refused_before_any_server(data, tmp_path, lit_rl_main):
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "a", data, TINY_MODEL, 2, "--model.init_args.random_init", "true",
                                           "--inference.teacher_model", "null", "--inference.teacher_server", "{}"))
    assert code == 1 and "OPD needs a teacher" in stderr, stderr[-3000:]
    other = tmp_path / "other_tokenizer"
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.add_tokens(["<teacher_only>"])
    write_tiny_checkpoint(other, seed=1)  # a servable model directory (never served: refused first)
    tok.save_pretrained(other)
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "b", data, TINY_MODEL, 2, "--model.init_args.random_init", "true",
                                           "--inference.teacher_model", str(other)))
    assert code == 1 and "another vocabulary" in stderr, stderr[-3000:]
    assert not (tmp_path / "b" / "vllm_teacher.log").exists() and not (tmp_path / "b" / "vllm.log").exists()


def test_a_teacher_servers_tokenizer_may_be_named_for_the_check(vllm_server, data, tmp_path, lit_rl_main):
    """A teacher at inference.teacher_base_url on another machine serves a directory this one does
    not have: inference.teacher_tokenizer names its tokenizer for the check that it shares the
    policy's (here one with an extra token, refused before the policy's server starts; the
    server's own directory would have passed). Without a teacher_base_url it is refused."""
    other = tmp_path / "other_tokenizer"
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.add_tokens(["<teacher_only>"])
    tok.save_pretrained(other)
    served = ("--inference.teacher_model", "null", "--inference.teacher_server", "{}",
              "--inference.teacher_base_url", vllm_server.base_url, "--model.init_args.random_init", "true")
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "a", data, TINY_MODEL, 2, *served,
                                           "--inference.teacher_tokenizer", str(other)))
    assert code == 1 and f"the teacher {vllm_server.base_url} has another vocabulary" in stderr, stderr[-3000:]
    assert not (tmp_path / "a" / "vllm.log").exists()
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "b", data, TINY_MODEL, 2, "--model.init_args.random_init", "true",
                                           "--inference.teacher_tokenizer", str(other)))
    assert code == 1 and "inference.teacher_tokenizer names the tokenizer of the server at" in stderr, stderr[-3000:]


def test_bad_distillation_options_and_two_teachers_are_refused_before_any_server(data, tmp_path, lit_rl_main):
    student = ("--model.init_args.random_init", "true")
    servable = str(write_tiny_checkpoint(tmp_path / "teacher", seed=1))  # a teacher vLLM could serve (never started)
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "a", data, TINY_MODEL, 2, *student, "--model.init_args.divergence",
                                           "reverse_kl", "--model.init_args.teacher_top_k", "0"))
    assert code == 1 and "teacher_top_k must be an int >= 1, got 0" in stderr, stderr
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "b", data, TINY_MODEL, 2, *student, "--model.init_args.teacher_model",
                                           TINY_MODEL, "--inference.teacher_model", servable))
    assert code == 1 and "OPD: two teachers" in stderr, stderr
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "c", data, TINY_MODEL, 2, *student, "--model.init_args.beta", "2"))
    assert code == 1 and "beta must be in [0, 1], got 2.0" in stderr, stderr
    other = tmp_path / "other_tokenizer"
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.add_tokens(["<teacher_only>"])
    tok.save_pretrained(other)
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "d", data, TINY_MODEL, 2, *student, "--model.init_args.teacher_model",
                                           str(other), "--inference.teacher_model", "null", "--inference.teacher_server", "{}"))
    assert code == 1 and f"OPD: model.teacher_model {other} has another vocabulary" in stderr, stderr
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "e", data, TINY_MODEL, 2, *student, "--inference.teacher_server",
                                           '{"dtype": "float32", "extra_args": "--max-num-seqs 8"}'))
    assert code == 1 and "inference.teacher_server.extra_args must be a list of vLLM arguments" in stderr, stderr
    # a teacher directory that is missing, or no model (before: transformers' traceback at the start)
    (tmp_path / "empty").mkdir()
    for run, teacher, said in (("f", tmp_path / "missing", ": no such directory"),
                               ("g", tmp_path / "empty", " has no config.json: not a model directory"),
                               ("j", TINY_MODEL, " has no weights")):  # vLLM said so after its start-up
        code, _, stderr = lit_rl_main(opd_args(tmp_path / run, data, TINY_MODEL, 2, *student,
                                               "--inference.teacher_model", str(teacher)))
        assert code == 1 and f"inference.teacher_model {teacher}{said}" in stderr, stderr
    # a reward mixed into the sampled-token advantage, with one completion per task: always 0
    code, _, stderr = lit_rl_main(opd_args(tmp_path / "h", data, TINY_MODEL, 2, *student, "--model.init_args.divergence",
                                           "sampled_reverse_kl", "--model.init_args.reward_weight", "0.5",
                                           "--data.init_args.group_size", "1", "--inference.teacher_model", servable))
    assert code == 1 and "with data.group_size 1 every such advantage is 0" in stderr, stderr[-3000:]
    # GRPO with opd.yaml's teacher left in: a second server scoring every sample for nothing
    grpo = ["fit", "--config", str(REPO / "examples/reverse_text/grpo.yaml"), "--model.init_args.model", TINY_MODEL,
            "--data.init_args.env.init_args.path", data, "--trainer.default_root_dir", str(tmp_path / "i"),
            "--inference.teacher_model", servable]
    code, _, stderr = lit_rl_main(grpo)
    assert code == 1 and "and GRPO would not use a score" in stderr, stderr[-3000:]
    for run in "abcdefghij":
        assert not (tmp_path / run / "vllm.log").exists() and not (tmp_path / run / "vllm_teacher.log").exists()


@pytest.mark.slow
def test_opd_with_the_teacher_in_process_lowers_the_divergence_through_the_cli(vllm_server, data, tmp_path):
    """The documented command's shape (docs/distillation.md): the student on the session's server,
    a teacher of other weights loaded in the trainer, reverse KL over the whole vocabulary."""
    from lit_rl.modules.model_loading import load_causal_lm
    from test_cli import metrics_rows, run
    from test_online_eval import restore_shared_server

    teacher = tmp_path / "teacher"
    load_causal_lm(TINY_MODEL, random_init=True, seed=1).save_pretrained(teacher)
    TOK.save_pretrained(teacher)
    root = tmp_path / "run"
    try:
        out = run(opd_args(root, data, str(vllm_server.model_dir), 4, "--inference.base_url", vllm_server.base_url,
                           "--inference.server", "{}", "--inference.teacher_model", "null", "--inference.teacher_server", "{}",
                           "--model.init_args.teacher_model", str(teacher), "--model.init_args.divergence", "reverse_kl",
                           "--model.init_args.optimizer.init_args.lr", "0.003", "--trainer.log_every_n_steps", "1"))
    finally:
        restore_shared_server(vllm_server)
    assert out.returncode == 0, out.stderr[-4000:]
    divergence = [float(r["train/divergence"]) for r in metrics_rows(root) if r.get("train/divergence")]
    assert len(divergence) == 4 and divergence[-1] < 0.8 * divergence[0], divergence
    assert not (root / "vllm_teacher.log").exists()  # no teacher server was started
