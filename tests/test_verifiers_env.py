"""VerifiersEnv: verifiers environments (0.4, `verifiers.v1`) played by lit-rl against the
session's real vLLM server. The taskset (`vf_reverse`) and the multi-turn env (`vf_again`) are
written in tests/ with the verifiers API; `user_sim` is verifiers' own two-agent env. The tiny
random model writes gibberish, so each check compares what verifiers recorded with what the
task's functions give on the sampled ids, and the trained ids with the server's own.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import vf_again
import vf_reverse
from helpers import REPO, TINY_MODEL, doc_yaml_blocks
from transformers import AutoTokenizer

from lit_rl.inference.client import Completion, chat_prompt_ids
from lit_rl.rollouts import RolloutContext, TrainSampling
from lit_rl.rollouts.envs import EvalRun, lcs_ratio
from lit_rl.rollouts.turns import Transcript
from lit_rl.rollouts.verifiers_env import VerifiersEnv

TOK = AutoTokenizer.from_pretrained(TINY_MODEL)


def play(vllm_server, env: VerifiersEnv, task: dict, group_size: int = 3, max_tokens: int = 12, evaluate=False):
    async def run():
        async with vllm_server.client() as client:
            ctx = RolloutContext(client=client, tokenizer=TOK, sampling=TrainSampling(max_tokens=max_tokens),
                                 group_size=group_size, policy_version=0)
            group = await env.rollout(task, ctx)
            metrics = await env.evaluate(EvalRun(step=0, step_dir=vllm_server.model_dir, client=client)) if evaluate else None
            scored = [await client.score(s.input_ids) for s in group.samples]  # the server's logprob of each id
            return group, metrics, scored

    return asyncio.run(run())


def model_turns(sample) -> list[list[int]]:
    """The runs of trained ids of a sample, in order."""
    runs, current = [], []
    for token, trained in zip(sample.input_ids, sample.loss_mask):
        if trained:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


def expected_rewards(reply: str, word: str) -> dict[str, float]:
    return {"reversed_text": lcs_ratio(reply, word[::-1]), "short": 1.0 if len(reply) <= 12 else 0.0}


def test_a_verifiers_taskset_trains_the_sampled_ids_and_scores_with_its_own_rewards(vllm_server):
    env = VerifiersEnv("vf_reverse", num_examples=4, max_tokens=12)
    assert [t["id"] for t in env.tasks()] == ["w0", "w1", "w2", "w3"]
    task = env.tasks()[1]
    group, metrics, scored = play(vllm_server, env, task, evaluate=True)
    prompt = chat_prompt_ids(TOK, [{"role": "user", "content": "Reverse the text: lit-rl"}])
    assert len(group.samples) == 3 and group.task_id == "w1"
    for sample, server in zip(group.samples, scored):
        n = len(prompt)
        assert sample.input_ids[:n] == prompt and sample.loss_mask == [False] * n + [True] * (len(sample.input_ids) - n)
        # the trained logprobs are the server's for exactly these ids (nothing re-tokenised)
        assert sample.logprobs[n:] == pytest.approx(server[n:], abs=2e-3)
        reply = TOK.decode(sample.input_ids[n:], skip_special_tokens=True).strip()
        parts = expected_rewards(reply, "lit-rl")
        assert sample.metadata["completion"] == reply and sample.metadata["rewards"] == pytest.approx(parts)
        assert sample.reward == pytest.approx(parts["reversed_text"] + 0.5 * parts["short"])
        assert sample.metadata["metrics"] == {"turns": 1.0}
    # the eval plays every task greedily and reports each reward beside the weighted sum
    assert set(metrics) >= {"reward", "reward/reversed_text", "reward/short"}
    assert metrics["reward"] == pytest.approx(metrics["reward/reversed_text"] + 0.5 * metrics["reward/short"], rel=1e-6)


def test_an_eval_of_k_samples_seeds_each_episode_apart(vllm_server):
    """samples_per_prompt=4 at temperature 1 with the default seed 0: each episode asks with its own
    seed (0..3), so a task's four samples differ; one shared seed repeated one sample (pass@4 = pass@1)."""
    class Recording:
        def __init__(self, client):
            self.client, self.seeds = client, []

        async def tokenizer(self):
            return await self.client.tokenizer()

        async def generate(self, prompt_ids, **kwargs):
            self.seeds.append((tuple(prompt_ids), kwargs["seed"]))
            return await self.client.generate(prompt_ids, **kwargs)

    env = VerifiersEnv("vf_reverse", num_examples=2, samples_per_prompt=4, temperature=1.0, max_tokens=12)

    async def run():
        async with vllm_server.client() as client:
            recording = Recording(client)
            eval_run = EvalRun(step=0, step_dir=vllm_server.model_dir, client=recording)
            await env.evaluate(eval_run)
            return recording.seeds, eval_run.traces

    seeds, traces = asyncio.run(run())
    by_prompt = {}
    for prompt, seed in seeds:
        by_prompt.setdefault(prompt, []).append(seed)
    assert len(by_prompt) == 2 and all(sorted(s) == [0, 1, 2, 3] for s in by_prompt.values())
    assert len({t["completion"] for t in traces[:4]}) > 1  # the tiny model's gibberish, sampled four ways


def test_a_multi_turn_env_trains_every_model_turn_and_none_of_the_envs_words(vllm_server):
    env = VerifiersEnv("vf_reverse", env="vf_again", max_tokens=12)
    group, _, scored = play(vllm_server, env, env.tasks()[0], group_size=2)
    for sample, server in zip(group.samples, scored):
        first, second = model_turns(sample)
        # rebuild the conversation from the sampled turns: prompt, turn 1, the env's words, turn 2
        t = Transcript.from_messages(TOK, [{"role": "user", "content": "Reverse the text: hello"}])
        assert sample.input_ids[:len(t.prompt_ids) + len(first)] == t.prompt_ids + first
        t.add_completion(Completion(t.prompt_ids, first, [0.0] * len(first), "length", ""))
        t.add_messages([{"role": "user", "content": vf_again.AGAIN}])
        assert sample.input_ids == t.input_ids + second
        trained = [i for i, m in enumerate(sample.loss_mask) if m]
        assert [sample.logprobs[i] for i in trained] == pytest.approx([server[i] for i in trained], abs=2e-3)
        assert all(sample.logprobs[i] == 0.0 for i, m in enumerate(sample.loss_mask) if not m)
        reply = TOK.decode(second, skip_special_tokens=True).strip()  # the task scores the last reply
        assert sample.metadata["rewards"] == pytest.approx(expected_rewards(reply, "hello"))
        assert sample.metadata["turns"] == 2 and sample.metadata["metrics"] == {"turns": 2.0, "env_turns": 2.0}


def test_verifiers_own_user_sim_env_runs_unchanged_and_trains_the_assistant_only(vllm_server):
    """`user_sim`: a second agent (the user, untrainable, opens the conversation and ends it at its
    `max_turns`) talks to the assistant, whose prompt is nulled; one sample per episode, the
    assistant's turns only."""
    env = VerifiersEnv("vf_reverse", env="user_sim", env_args={"user": {"max_turns": 2}}, max_tokens=8)
    group, _, _ = play(vllm_server, env, env.tasks()[0], group_size=2, max_tokens=8)
    for sample in group.samples:
        turns = model_turns(sample)
        assert 1 <= len(turns) <= 2 and sample.metadata["metrics"]["user_turns"] == 2.0
        # the assistant's prompt is the user's opening reply, never the task's scenario
        assert "Reverse the text" not in TOK.decode(sample.input_ids)


def test_a_reward_that_raises_rejects_its_task_under_the_buffers_rules_naming_it(vllm_server):
    """A reward plugged through the taskset's config (verifiers' own mechanism) fails on task w1:
    the error names the taskset and the task, and the buffer retries, then rejects that task."""
    from lit_rl.rollouts.buffer import RolloutBuffer
    from lit_rl.rollouts.reward_functions import RewardFunctionError

    plugged = {"task": {"rewards": {"grader": {"fn": "vf_reverse.grader_down_on_lit_rl", "weight": 0.25}}}}
    env = VerifiersEnv("vf_reverse", taskset_args=plugged, max_tokens=4)

    async def one(task):
        async with vllm_server.client() as client:
            return await env.episode(task, client, TOK, {"max_tokens": 4})

    with pytest.raises(RewardFunctionError, match=r"VerifiersEnv 'vf_reverse', task w1: .*the grader is down"):
        asyncio.run(one(env.tasks()[1]))
    _, trace = asyncio.run(one(env.tasks()[0]))
    assert trace.rewards["grader"].score == 1.0 and trace.rewards["grader"].weight == 0.25
    buffer = RolloutBuffer(env, vllm_server.client, TOK, TrainSampling(max_tokens=4), batch_size=4, group_size=2,
                           max_concurrency=8, num_batches=4, num_retries=1, retry_backoff=0.01)

    async def collect():
        async with buffer:
            return [b async for b in buffer]

    trained = [s.metadata["task_id"] for b in asyncio.run(collect()) for s in b]
    assert len(trained) == 16 and "w1" not in trained
    assert buffer.metrics()["rollout/rejected"] >= 1 and buffer.counters["retries"] >= 1


def test_a_reward_that_is_not_a_number_is_named_in_rollouts_and_evals(vllm_server):
    """A plugged reward gives NaN on task w1: a rollout of it and an eval are a RewardFunctionError
    naming the env and the task (the buffer retries, then rejects, a rollout's); an eval's mean had
    dropped the NaN without a word."""
    from lit_rl.rollouts.reward_functions import RewardFunctionError

    plugged = {"task": {"rewards": {"grader": {"fn": "vf_reverse.grader_nan_on_lit_rl", "weight": 0.25}}}}
    env = VerifiersEnv("vf_reverse", taskset_args=plugged, max_tokens=4)
    with pytest.raises(RewardFunctionError, match=r"environment 'verifiers': score_group on task w1, completion 0: "
                                                  r"the reward is nan"):
        play(vllm_server, env, env.tasks()[1], group_size=1, max_tokens=4)
    group, _, _ = play(vllm_server, env, env.tasks()[0], group_size=1, max_tokens=4)
    assert all(s.reward == s.reward for s in group.samples)  # another task's rewards are numbers
    with pytest.raises(RewardFunctionError, match=r"task w1, completion 0: the reward is nan"):
        play(vllm_server, env, env.tasks()[0], group_size=1, max_tokens=4, evaluate=True)


def test_bad_input_is_one_error_naming_what_is_wrong(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    with monkeypatch.context() as m:  # verifiers hidden from the import system: the extra is named
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else real(name, *a))
        with pytest.raises(ImportError, match=r"VerifiersEnv needs the 'verifiers' package: pip install 'lit-rl\[envs\]'"):
            VerifiersEnv("vf_reverse")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        VerifiersEnv("vf_reverse", max_turns=0)
    with pytest.raises(ModuleNotFoundError, match="taskset 'no_such_taskset' not found"):
        VerifiersEnv("no_such_taskset").tasks()
    idle = VerifiersEnv("vf_reverse", env="vf_idle")

    async def run():
        return await idle.episode(idle.tasks()[0], client=None, tokenizer=TOK, sampling={})

    with pytest.raises(ValueError, match="an episode gave 0 trainable agent runs"):
        asyncio.run(run())


@pytest.mark.slow
def test_grpo_on_a_multi_turn_verifiers_env_from_the_cli_trains_exactly_what_was_sampled(vllm_server, tmp_path):
    """`lit-rl fit` with the env given on the command line (synchronous, on the session's server):
    every step's mismatch_kl is ~0 (the trainer's logprobs of the trained ids are the server's:
    nothing re-tokenised across the two turns), each verifiers reward is logged beside the sum."""
    from test_cli import metrics_rows, run
    from test_grpo_cli import grpo_args, shared, trained

    root = tmp_path / "run"
    env = {"class_path": "lit_rl.rollouts.VerifiersEnv", "init_args": {"taskset": "vf_reverse", "env": "vf_again"}}
    args = grpo_args(root, "unused", str(vllm_server.model_dir), 2, *shared(vllm_server), "--data.init_args.max_staleness", "0")
    at = args.index("--data.init_args.env.init_args.path")
    args[at: at + 2] = ["--data.init_args.env", json.dumps(env)]
    done = run(args, env={"PYTHONPATH": str(REPO / "tests")})
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [r for r in metrics_rows(root) if r.get("train/mismatch_kl")]
    assert len(rows) == 2
    for r in rows:
        assert float(r["train/mismatch_kl"]) < 1e-3, r
        assert float(r["train/reward"]) == pytest.approx(
            float(r["train/reward/reversed_text"]) + 0.5 * float(r["train/reward/short"]), abs=1e-6), r
    batches = trained(root)
    assert [len(b["samples"]) for b in batches] == [8, 8]
    for b in batches:
        for s in b["samples"]:
            assert s["policy_version"] == b["step"] and s["task_id"] in {f"w{i}" for i in range(len(vf_reverse.WORDS))}
            assert set(s["rewards"]) == {"reversed_text", "short"}


def test_lit_rl_evaluate_runs_a_verifiers_env_unchanged(vllm_server, tmp_path, monkeypatch):
    """The environment rebuilt in `lit-rl evaluate` (and in the online evaluator) from its
    `to_config`: each verifiers reward in eval_metrics.csv beside the sum."""
    import csv
    import sys

    from lit_rl import cli

    env = VerifiersEnv("vf_reverse", env="vf_again", num_examples=3, max_tokens=8, name="rev")
    config = env.to_config()
    assert config == {"class_path": "lit_rl.rollouts.verifiers_env.VerifiersEnv", "init_args": {
        "taskset": "vf_reverse", "taskset_args": {}, "env": "vf_again", "env_args": {}, "max_turns": 8, "name": "rev",
        "num_examples": 3, "samples_per_prompt": 1, "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": 0}}
    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    with vllm_server.run_dir() as run:
        cli.main(["evaluate", "--weights-dir", str(run / "weights"), "--base-url", vllm_server.base_url,
                  "--env", config["class_path"], "--env-args", json.dumps(config["init_args"]),
                  "--log-dir", str(tmp_path / "evals")])
    logged = {r["name"]: float(r["value"]) for r in csv.DictReader(open(tmp_path / "evals" / "eval_metrics.csv"))}
    assert {"eval/rev/reward", "eval/rev/reward/reversed_text", "eval/rev/reward/short"} <= set(logged), logged
    assert logged["eval/rev/reward"] == pytest.approx(
        logged["eval/rev/reward/reversed_text"] + 0.5 * logged["eval/rev/reward/short"], rel=1e-6)


def test_the_yaml_in_docs_environments_builds_a_verifiers_env():
    blocks = doc_yaml_blocks("docs/environments.md")
    (env,) = [b["data"]["init_args"]["env"] for b in blocks if "VerifiersEnv" in str(b)]
    assert env["class_path"] == "lit_rl.rollouts.VerifiersEnv"
    built = VerifiersEnv(**{**env["init_args"], "taskset": "vf_reverse"})
    assert len(built.tasks()) == len(vf_reverse.WORDS) and type(built.vf_env()).__name__ == "SingleAgentEnv"


def test_an_episode_that_fills_the_context_ends_with_the_turns_it_has(vllm_server):
    """The client refuses the second turn of `vf_again` as a prompt that fills the server's context
    (ContextLengthError, raised before the request): the episode stops as verifiers' traces do
    ("prompt_too_long") and trains its first turn, not the env's words after it."""
    from lit_rl.inference import ContextLengthError

    class FullAfterOneTurn:
        def __init__(self, client):
            self.client, self.calls = client, 0

        async def generate(self, prompt_ids, **kwargs):
            self.calls += 1
            if self.calls > 1:
                raise ContextLengthError(f"generate: the prompt has {len(prompt_ids)} tokens ...")
            return await self.client.generate(prompt_ids, **kwargs)

    env = VerifiersEnv("vf_reverse", env="vf_again", max_tokens=12)

    async def run():
        async with vllm_server.client() as client:
            ctx = RolloutContext(client=FullAfterOneTurn(client), tokenizer=TOK, sampling=TrainSampling(max_tokens=12),
                                 group_size=1, policy_version=0)
            return await env.rollout(env.tasks()[0], ctx)

    (sample,) = asyncio.run(run()).samples
    prompt = Transcript.from_messages(TOK, [{"role": "user", "content": "Reverse the text: hello"}]).prompt_ids
    assert len(model_turns(sample)) == 1 and sample.input_ids[:len(prompt)] == prompt
    assert sample.loss_mask[-1] and vf_again.AGAIN not in TOK.decode(sample.input_ids)
    assert sample.metadata["turns"] == 1
