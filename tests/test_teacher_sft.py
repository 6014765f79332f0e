"""SFT on a frozen teacher's completions (`RolloutDataModule(source="teacher")`): the samples
carry the teacher's exact ids and no policy logprobs, the start-up checks report every problem
at once, and a real CLI run trains on them.

The session's vLLM server plays the teacher (nothing reloads it: no policy is served, so nothing is synced).
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import REPO, TINY_MODEL, reverse_rows, write_jsonl
from test_rollout_buffer import FAST, LOGPROB_TOL, TOK, collect, hf_logprobs
from vllm_fixtures import write_tiny_checkpoint

from lit_rl.inference.runtime import InferenceRuntime
from lit_rl.rollouts.buffer import RolloutBuffer
from lit_rl.rollouts.context import TrainSampling
from lit_rl.rollouts.envs import PromptsEnv, ReverseTextEnv
from lit_rl.rollouts.filters import GibberishFilter

CONFIG = str(REPO / "examples" / "reverse_text" / "sft_teacher.yaml")
GRPO_CONFIG = str(REPO / "examples" / "reverse_text" / "grpo.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("teacher_sft_data") / "train.jsonl", reverse_rows(40))


def test_teacher_samples_keep_the_teachers_ids_and_carry_no_policy_logprobs(vllm_server, data):
    """Every sample is the teacher's: `logprobs` None (no staleness, no logprob filters) and its
    sampling logprobs kept as `teacher_logprobs`, equal to HF's logprobs of the teacher on the
    sample's ids, which shows the ids are exactly the sampled ones. A gibberish filter that
    flags every token of a random model flags none of them."""
    flag_all = GibberishFilter(threshold=0.0, run=1, enforce=True)
    buffer = RolloutBuffer(ReverseTextEnv(data), vllm_server.client, TOK, TrainSampling(max_tokens=8), batch_size=4,
                           group_size=2, num_batches=2, filters=[flag_all], source="teacher", **FAST)
    batches = asyncio.run(collect(buffer))
    worst = 0.0
    for s in (s for b in batches for s in b):
        assert s.source == "teacher" and s.logprobs is None and not s.has_sampling_logprobs
        n = s.loss_mask.index(True)
        assert all(s.loss_mask[n:]) and s.teacher_logprobs[:n] == [0.0] * n
        ref = hf_logprobs(vllm_server.model_dir, s.input_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(s.teacher_logprobs[n:], ref[n:])))
    assert worst < LOGPROB_TOL
    assert buffer.counters["flagged_gibberish"] == 0 and buffer.counters["filtered"] == 0


@pytest.mark.parametrize("max_staleness", [1, None])
def test_a_teacher_runs_ahead_of_a_slow_consumer_only_as_far_as_the_bound(vllm_server, data, max_staleness):
    """No policy versions here, so drawing a batch advances the buffer's version: with
    max_staleness=1 at most batches k+1 and k+2 are waiting after batch k is drawn, however slow
    the trainer (the data module's setting); unbounded, the teacher fills memory with samples
    nobody trains (measured: 19,472 waiting after 20 steps of a real run before the bound)."""
    buffer = RolloutBuffer(ReverseTextEnv(data), vllm_server.client, TOK, TrainSampling(max_tokens=4), batch_size=4,
                           group_size=2, max_concurrency=8, max_staleness=max_staleness, source="teacher", **FAST)

    async def slow_consumer():
        waiting = []
        async with buffer:
            for _ in range(4):
                await buffer.next_batch()
                await asyncio.sleep(0.5)  # a training step
                waiting.append(buffer.scheduler.waiting_samples)
        return waiting

    waiting = asyncio.run(slow_consumer())
    print(f"max_staleness={max_staleness}: waiting after each step {waiting}")
    if max_staleness == 1:
        assert max(waiting) <= 2 * 4
    else:
        assert max(waiting) > 4 * 4  # the case the bound is for


def test_prompts_env_reads_strings_and_conversations(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "hello"},
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "drop me"}]},
    ])
    tasks = PromptsEnv(path).tasks()
    assert [t["prompt"] for t in tasks] == [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "hi"}]]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(ValueError, match="row 1 of .*column 'prompt'"):
        PromptsEnv(bad).tasks()
    with pytest.raises(ValueError, match="no column 'question'"):
        PromptsEnv(path, column="question").tasks()


def sft_args(root, data, *extra):
    return ["fit", "--config", CONFIG, "--model.init_args.model", TINY_MODEL, "--model.init_args.random_init", "true",
            "--data.init_args.env.init_args.path", data, "--data.init_args.batch_size", "4",
            "--data.init_args.group_size", "2", "--data.init_args.max_tokens", "8",
            "--trainer.default_root_dir", str(root), *extra]


def test_every_source_problem_is_reported_at_once_before_any_server(data, tmp_path, lit_rl_main):
    # GRPO (a policy-gradient loss) from a teacher source with no teacher, and the policy's server options still set
    code, _, stderr = lit_rl_main(["fit", "--config", GRPO_CONFIG, "--model.init_args.model", TINY_MODEL,
                                   "--model.init_args.random_init", "true", "--data.init_args.env.init_args.path", data,
                                   "--data.init_args.source", "teacher", "--trainer.default_root_dir",
                                   str(tmp_path / "a"), "--trainer.max_steps", "2",
                                   "--data.init_args.skip_zero_advantage", "true"])
    assert code == 1, stderr[-3000:]
    for words in ("needs a model to sample from: set inference.teacher_model", "inference.server are the policy's server",
                  "can only feed a cross-entropy loss", ("data.skip_zero_advantage rejects every group whose rewards are "
                  "all equal; with data.source 'teacher' the reward is only a metric"), "4 problem(s)"):
        assert words in stderr, (words, stderr[-3000:])
    # SFT on the policy's own samples
    code, _, stderr = lit_rl_main(sft_args(tmp_path / "b", data, "--data.init_args.source", "policy",
                                           "--inference.teacher_model", "null", "--inference.teacher_server", "{}",
                                           "--trainer.max_steps", "2"))
    assert code == 1 and "SFT may not train on the policy's own samples" in stderr, stderr[-3000:]
    # GRPO at T=0.7 on an existing server whose logprobs mode is not stated, then stated wrongly
    grpo_on_a_server = ["fit", "--config", GRPO_CONFIG, "--model.init_args.model", TINY_MODEL, "--model.init_args.random_init",
                        "true", "--data.init_args.env.init_args.path", data, "--data.init_args.temperature", "0.7",
                        "--inference.base_url", "http://127.0.0.1:9/v1", "--inference.server", "{}",
                        "--trainer.default_root_dir", str(tmp_path / "c"), "--trainer.max_steps", "2"]
    code, _, stderr = lit_rl_main(grpo_on_a_server + ["--model.init_args.loss_type", "dr_grpo",
                                                      "--model.init_args.max_completion_length", "8",
                                                      "--data.init_args.max_tokens", "16"])
    assert code == 1, stderr[-3000:]
    for words in ("data.temperature 0.7, top_p 1.0, top_k None sample from a processed distribution",
                  "start it so and set inference.logprobs_mode processed_logprobs",
                  "model.init_args.max_completion_length (8) is below data.max_tokens (16)", "2 problem(s)"):
        assert words in stderr, (words, stderr[-3000:])
    code, _, stderr = lit_rl_main(grpo_on_a_server + ["--inference.logprobs_mode", "processed"])
    assert code == 1 and "inference.logprobs_mode must be raw_logprobs or processed_logprobs" in stderr, stderr[-3000:]
    # GRPO with one completion per task (every advantage 0), sampled greedily in groups of 8
    grpo = grpo_on_a_server[: grpo_on_a_server.index("--inference.base_url")] + [
        "--trainer.default_root_dir", str(tmp_path / "d"), "--trainer.max_steps", "2"]
    code, _, stderr = lit_rl_main(grpo + ["--data.init_args.group_size", "1", "--data.init_args.batch_size", "4"])
    assert code == 1 and "data.group_size 1: a completion's advantage is its reward minus the mean" in stderr, \
        stderr[-3000:]
    code, _, stderr = lit_rl_main(grpo + ["--data.init_args.temperature", "0"])
    assert code == 1 and "data.temperature 0 is greedy: the 8 completions of a task (data.group_size)" in stderr, \
        stderr[-3000:]
    # completions as long as the server's whole context: vLLM 0.32 refuses a longer max_tokens (400)
    # after the server's start, every rollout, and cuts one this long to what the prompt leaves
    code, _, stderr = lit_rl_main(grpo + ["--data.init_args.max_tokens", "512"])
    assert code == 1 and "data.max_tokens (512) leaves no room for a prompt in inference.server.max_model_len (512)" \
        in stderr, stderr[-3000:]
    servable = str(write_tiny_checkpoint(tmp_path / "teacher", seed=1))  # a teacher vLLM could serve (never started)
    code, _, stderr = lit_rl_main(sft_args(tmp_path / "e", data, "--data.init_args.max_tokens", "600",
                                           "--inference.teacher_model", servable, "--trainer.max_steps", "2"))
    assert code == 1 and "data.max_tokens (600) leaves no room for a prompt in inference.teacher_server.max_model_len " \
        "(512)" in stderr, stderr[-3000:]
    # the same options as dotted flags into the server's mapping: jsonargparse gives them as strings, so
    # max_model_len '8' escaped the check above and enforce_eager 'false' (a true string) was on
    teacher = ["--inference.teacher_model", servable, "--trainer.max_steps", "2"]
    code, _, stderr = lit_rl_main(sft_args(tmp_path / "f", data, *teacher, "--inference.teacher_server.max_model_len", "8"))
    assert code == 1 and "data.max_tokens (8) leaves no room for a prompt in inference.teacher_server.max_model_len " \
        "(8)" in stderr, stderr[-3000:]
    code, _, stderr = lit_rl_main(sft_args(tmp_path / "g", data, *teacher, "--inference.teacher_server.enforce_eager", "sometimes"))
    assert code == 1 and "inference.teacher_server.enforce_eager must be bool, got 'sometimes'" in stderr, stderr[-3000:]
    assert InferenceRuntime(teacher_model=servable, teacher_server={"enforce_eager": "false", "max_model_len": "8"}).teacher_server == {
        "enforce_eager": False, "max_model_len": 8}
    assert not list(tmp_path.glob("*/vllm*.log"))  # refused before any server started
