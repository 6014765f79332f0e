"""DatasetEnv and the built-in rewards: a dataset plus reward functions named in the config.

The rewards are checked on real strings, including the cases math-verify exists for; the
environment reads real files through `datasets`; rollouts, evals and the buffer's reject rules
run against the session's real vLLM server (tiny random model: its completions are gibberish, so
the checks compare each reward with what its function computes from the sampled ids).
"""

from __future__ import annotations

import asyncio
import json

import datasets
import pytest
import reward_fns
from helpers import TINY_MODEL, doc_yaml_blocks, write_jsonl
from transformers import AutoTokenizer

from lit_rl.data.rollout_traces import rollout_stats, trace_batch
from lit_rl.data.samples import Sample
from lit_rl.inference.client import chat_prompt_ids
from lit_rl.rewards import exact_match, length_penalty, math_verify, normalize_answer, regex_match
from lit_rl.rollouts import DatasetEnv, RolloutContext, TrainSampling
from lit_rl.rollouts.buffer import RolloutBuffer
from lit_rl.rollouts.scheduler import Batch
from lit_rl.rollouts.envs import EvalRun
from lit_rl.rollouts.reward_functions import RewardFunction, RewardFunctionError, RewardLog

TOK = AutoTokenizer.from_pretrained(TINY_MODEL)
ROWS = [{"question": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}", "level": 1},
        {"question": "What is 2 + 2?", "answer": "4", "level": 2},
        {"question": "Name the third planet.", "answer": "Earth", "level": 3},
        {"question": "What is 10 * 100?", "answer": "1000", "level": 1}]
TWO_REWARDS = [{"function": "reward_fns.longer_is_better", "weight": 0.5},
               {"function": "reward_fns.mentions_answer", "weight": 2.0, "name": "mentions"}]


def env_of(tmp_path, rows=ROWS, rewards=TWO_REWARDS, **kwargs) -> DatasetEnv:
    return DatasetEnv(write_jsonl(tmp_path / "rows.jsonl", rows), rewards, prompt_column="question", **kwargs)


# ---- built-in rewards on real strings --------------------------------------------------------------

def test_math_verify_accepts_equal_answers_that_strings_miss():
    golds = ["\\frac{3}{4}", "0.5", "\\frac{1}{2}", "x^2 + 1", "1000", "4", "\\sqrt{2}", "12"]
    answers = ["So the sum is $\\boxed{\\frac{3}{4}}$.", "The answer is \\boxed{\\frac{1}{2}}",
               "It is $0.5$", "We get $1 + x^2$", "\\boxed{1,000}", "I think it is \\boxed{5}",
               "\\boxed{2^{1/2}}", "maybe 13"]
    got = asyncio.run(math_verify(["q"] * len(golds), answers, answer=golds))
    assert got == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert [exact_match(["q"], [a], answer=[g])[0] for g, a in zip(golds, answers)][:4] == [1.0, 0.0, 0.0, 0.0]
    # TRL's conversational completions; a gold answer that does not parse gives None (does not apply)
    conv = [[{"role": "assistant", "content": "$\\boxed{\\frac{6}{8}}$"}], [{"role": "assistant", "content": "3/4"}]]
    assert asyncio.run(math_verify(["q", "q"], conv, answer_column="solution", solution=["3/4", "\\frac{"])) == [1.0, None]


def test_math_verify_compares_word_answers_as_text_and_reads_delimited_golds_once():
    """As LaTeX "no" is n*o, equal to \\boxed{on}: a gold of words is compared as text; a gold
    already in \\[...\\] or \\(...\\) wrapped in $...$ again parsed to nothing (None)."""
    golds = ["no", "east", "no", "North East", "\\[\\frac{1}{2}\\]", "\\(\\frac{1}{2}\\)", "A", "A"]
    answers = ["\\boxed{on}", "\\boxed{seat}", "So: \\boxed{No}.", "\\boxed{north east}", "\\boxed{0.5}",
               "\\boxed{1/2}", "\\boxed{A}", "\\boxed{B}"]
    got = asyncio.run(math_verify(["q"] * len(golds), answers, answer=golds))
    assert got == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_answers_in_latex_text_commands_and_golds_with_escaped_dollars_are_scored():
    """Models box word answers as \\text{...}: exact_match (and math_verify's word path) read
    "textyes" and scored every right one 0. A gold "\\$18.90" (MATH-style currency) counted as
    delimited, was not wrapped, parsed to nothing: None for every completion, right ones included."""
    assert exact_match(["q"] * 3, ["\\boxed{\\text{yes}}", "\\boxed{\\textbf{No}}", "\\boxed{\\text{no}}"],
                       answer=["yes", "no", "yes"]) == [1.0, 1.0, 0.0]
    golds = ["Monday", "\\$18.90", "\\$5", "\\$5"]
    answers = ["\\boxed{\\text{Monday}}", "The total is \\boxed{18.90}", "\\boxed{\\$5}", "\\boxed{6}"]
    assert asyncio.run(math_verify(["q"] * 4, answers, answer=golds)) == [1.0, 1.0, 1.0, 0.0]
    assert normalize_answer("\\frac{1}{2}") != normalize_answer("12")  # other commands keep their names


def test_exact_match_normalises_case_spacing_punctuation_and_boxes():
    assert normalize_answer("The answer is $1,000$.") == normalize_answer("answer is 1000") == "answer is 1000"
    cases = [("Earth", "earth."), ("Earth", "\\boxed{EARTH}"), ("-3.5", "  -3.5 "), ("Earth", "Mars"),
             ("Earth", "Answer: the Earth"), ("1/2", "\\boxed{1/2}"), ("42", "42 apples")]
    got = exact_match(["q"] * len(cases), [a for _, a in cases], answer=[g for g, _ in cases])
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert exact_match(["q"], ["Work...\nAnswer: the Earth"], answer=["Earth"], answer_pattern=r"Answer:\s*(.+)") == [1.0]
    assert exact_match(["q"], ["\\boxed{\\frac{1}{2}} then"], answer=["\\frac{1}{2}"]) == [1.0]  # nested braces


def test_exact_match_keeps_a_lone_letter_and_the_commas_between_items():
    """Gold "A" (a choice) is not an article: an empty reply is no answer; "2,3" is two items, not 23."""
    cases = [("A", ""), ("A", "\\boxed{}"), ("A", "\\boxed{B}"), ("A", "\\boxed{(a)}"), ("The", "an"),
             ("2,3", "\\boxed{23}"), ("2,3", "\\boxed{2, 3}"), ("1,000", "\\boxed{1000}"), ("Paris, France", "paris france")]
    got = exact_match(["q"] * len(cases), [a for _, a in cases], answer=[g for g, _ in cases])
    assert got == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert exact_match(["q"], ["Answer: "], answer=["A"], answer_pattern=r"Answer:\s*(.*)") == [0.0]
    assert exact_match(["q"], ["Answer: a"], answer=["A"], answer_pattern=r"Answer:\s*(.*)") == [1.0]


def test_regex_match_is_a_format_reward():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    texts = ["<think>a\nb</think> <answer>4</answer>", "<answer>4</answer>", "x <think>a</think><answer>4</answer>"]
    assert regex_match(["q"] * 3, texts, pattern=pattern) == [1.0, 0.0, 1.0]
    assert regex_match(["q"] * 3, texts, pattern=pattern, full=True) == [1.0, 0.0, 0.0]
    assert regex_match(["q"], ["ANSWER"], pattern="answer", ignore_case=True) == [1.0]


def test_length_penalty_is_dapos_soft_overlong_penalty():
    ids = [[0] * n for n in (10, 12, 14, 16, 17, 30)]
    # free up to 16 - 4 = 12 tokens, then (12 - n) / 4, and -1 from 16 on
    assert length_penalty(["q"] * 6, ["x"] * 6, ids, max_length=16, buffer_length=4) == [0.0, 0.0, -0.5, -1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer_length"):
        RewardFunction("lit_rl.rewards.length_penalty", kwargs={"max_length": 8, "buffer_length": 9})


# ---- reading the dataset ---------------------------------------------------------------------------

def test_rows_become_tasks_from_strings_or_messages_with_system_prompt_filter_and_tools(tmp_path):
    tool = {"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"type": "object"}}}
    rows = [{"prompt": "hi", "answer": "1", "tools": json.dumps([tool])},
            {"prompt": "skip me", "answer": "2", "tools": "[]"},
            {"prompt": "bye", "answer": "3", "tools": "[]"}]
    env = DatasetEnv(write_jsonl(tmp_path / "s.jsonl", rows), ["lit_rl.rewards.exact_match"],
                     system_prompt="Be brief.", tools_column="tools", filter="reward_fns.not_skipped")
    tasks = env.tasks()
    assert [t["id"] for t in tasks] == ["0", "2"]  # ids are the dataset's row numbers
    assert tasks[0]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert env.tools(tasks[0]) == [tool] and env.tools(tasks[1]) is None  # "[]": no tools
    # chat messages (a parquet file), a system turn of their own kept, and the first N rows
    chats = [{"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": f"q{i}"}], "answer": str(i)}
             for i in range(3)]
    path = tmp_path / "c.parquet"
    datasets.Dataset.from_list(chats).to_parquet(str(path))
    env = DatasetEnv(str(path), ["lit_rl.rewards.exact_match"], system_prompt="Be brief.", num_examples=2)
    assert [t["prompt"] for t in env.tasks()] == [c["prompt"] for c in chats[:2]]
    # a saved dataset dictionary, by split
    saved = tmp_path / "saved"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
    env = DatasetEnv(str(saved), ["lit_rl.rewards.exact_match"], prompt_column="question", split="test")
    assert [t["row"]["answer"] for t in env.tasks()] == [r["answer"] for r in ROWS]
    # the evaluator rebuilds the same environment from its config
    again = DatasetEnv(**env.to_config()["init_args"])
    assert again.tasks() == env.tasks()


def test_reward_options_that_do_not_exist_or_do_not_fit_name_the_entry(tmp_path):
    """A built-in's `**columns` took a misspelt option and dropped it (`answer_colum`: scored against
    `answer`; `timeout_second`: no timeout); a required option missing was a bare TypeError, and kwargs
    that do not fit a function of the user's were functools' "partial object ... has incorrect arguments"."""
    with pytest.raises(ValueError, match=r"rewards\[0\]: exact_match has no option 'answer_colum'; its options are "
                                         r"answer_column, answer_pattern"):
        env_of(tmp_path, rewards=[{"function": "lit_rl.rewards.exact_match", "kwargs": {"answer_colum": "solution"}}]).tasks()
    with pytest.raises(ValueError, match=r"rewards\[1\]: math_verify has no option 'timeout_second'"):
        env_of(tmp_path, rewards=["lit_rl.rewards.exact_match",
                                  {"function": "lit_rl.rewards.math_verify", "kwargs": {"timeout_second": 30}}]).tasks()
    with pytest.raises(ValueError, match=r"rewards\[0\]: length_penalty: .*max_length"):
        env_of(tmp_path, rewards=[{"function": "lit_rl.rewards.length_penalty", "kwargs": {"buffer_length": 8}}]).tasks()
    with pytest.raises(ValueError, match=r"rewards\[0\]: kwargs \['prompt', 'x'\] do not fit no_completions_argument's"):
        env_of(tmp_path, rewards=[{"function": "reward_fns.no_completions_argument", "kwargs": {"prompt": 1, "x": 2}}]).tasks()


def test_bad_input_is_one_error_naming_the_column_row_or_function(tmp_path):
    with pytest.raises(ValueError, match=r"no column 'prompt' \(for prompt_column\), 'solution' \(for reward "
                                         r"'exact_match'\); its columns: \['question', 'answer', 'level'\]"):
        DatasetEnv(write_jsonl(tmp_path / "a.jsonl", ROWS),
                   [{"function": "lit_rl.rewards.exact_match", "kwargs": {"answer_column": "solution"}}]).tasks()
    with pytest.raises(ValueError, match="row 1 of .*column 'question': expected a string or chat messages"):
        DatasetEnv(write_jsonl(tmp_path / "b.jsonl", [{"question": "fine"}, {"question": ""}, {"question": "x"}]),
                   [{"function": "lit_rl.rewards.regex_match", "kwargs": {"pattern": "x"}}], prompt_column="question").tasks()
    # a row's tools are read when the rows are, not by the first rollout or eval of that row
    tool_rows = [{"question": q, "answer": "1", "tools": t} for q, t in [("a", "[]"), ("b", ""), ("c", "{not json")]]
    env = DatasetEnv(write_jsonl(tmp_path / "t.jsonl", tool_rows), ["lit_rl.rewards.exact_match"],
                     prompt_column="question", tools_column="tools")
    assert "row 2 of " in (env.tasks_problem() or "")
    with pytest.raises(ValueError, match="row 2 of .*column 'tools': tools is a string but not valid JSON"):
        env.tasks()
    with pytest.raises(ValueError, match="row 0 of .*column 'tools': tool 0"):
        DatasetEnv(write_jsonl(tmp_path / "u.jsonl", [{"question": "a", "answer": "1", "tools": json.dumps([{"type": "function"}])}]),
                   ["lit_rl.rewards.exact_match"], prompt_column="question", tools_column="tools").tasks()
    with pytest.raises(ValueError, match=r"rewards\[0\]: cannot import module 'no_such_module'"):
        env_of(tmp_path, rewards=["no_such_module.fn"]).tasks()
    with pytest.raises(ValueError, match=r"rewards\[1\]: no_completions_argument takes \(prompt, answer\)"):
        env_of(tmp_path, rewards=["lit_rl.rewards.exact_match", "reward_fns.no_completions_argument"]).tasks()
    with pytest.raises(ValueError, match=r"rewards\[0\]: completion_without_task takes \(completion\); lit-rl's "
                                         r"per-sample form is called as fn\(completion=..., task=...\)"):
        env_of(tmp_path, rewards=["reward_fns.completion_without_task"]).tasks()
    with pytest.raises(ValueError, match=r"two functions are named \['exact_match'\]"):
        env_of(tmp_path, rewards=["lit_rl.rewards.exact_match", {"function": "lit_rl.rewards.exact_match"}]).tasks()
    with pytest.raises(ValueError, match=r"regex_match needs kwargs: \{pattern: <a regular expression>\}"):
        env_of(tmp_path, rewards=["lit_rl.rewards.regex_match"]).tasks()
    with pytest.raises(ValueError, match=r"regex_match: pattern '\(' is not a regular expression"):
        env_of(tmp_path, rewards=[{"function": "lit_rl.rewards.regex_match", "kwargs": {"pattern": "("}}]).tasks()
    with pytest.raises(ValueError, match=r"rewards\[0\]: unknown keys \['weights'\]"):
        env_of(tmp_path, rewards=[{"function": "lit_rl.rewards.exact_match", "weights": 2}]).tasks()


@pytest.mark.parametrize("function, message", [
    ("reward_fns.fails_on_row_one", r"'fails_on_row_one' raised on row 1: RuntimeError\('the grader is down for row 1'\)"),
    ("reward_fns.one_value_short", r"'one_value_short' on row 1: returned 2 values for 3 completions"),
    ("reward_fns.not_a_number", r"'not_a_number' on row 1: value 0 is nan"),
    ("reward_fns.only_level_two", r"row 0, completion 0: every reward function returned None \(only_level_two\)"),
])
def test_a_reward_function_that_fails_names_itself_and_the_row(tmp_path, function, message):
    env = env_of(tmp_path, rewards=[function])
    task = env.tasks()[0 if "level_two" in function else 1]
    with pytest.raises(RewardFunctionError, match=message):
        asyncio.run(env.score_group(["a", "b", "c"], task, [[1], [2], [3]]))


def test_each_reward_is_logged_beside_the_sum():
    def sample(reward, parts):
        return Sample(input_ids=[1, 2], loss_mask=[False, True], advantages=[0.0, 0.0], reward=reward,
                      metadata={"rewards": parts})
    stats = rollout_stats([sample(1.5, {"a": 1.0, "b": 0.5}), sample(0.2, {"a": None, "b": 0.2})], [0, 0])
    assert stats["reward"] == pytest.approx(0.85)
    assert stats["reward/a"] == 1.0 and stats["reward/b"] == pytest.approx(0.35)  # None: left out of a's mean


def test_trl_functions_get_what_trl_hands_them_and_may_return_arrays(tmp_path):
    """TRL's `trainer_state`, `log_metric` and `log_extra`; only the named arguments to a function
    without **kwargs, the prompt column among them; numpy and torch values, as TRL takes them."""
    env = env_of(tmp_path, rewards=["reward_fns.names_its_arguments", "reward_fns.numpy_values",
                                    "reward_fns.tensor_values", "reward_fns.scalar_tensors"])
    total, parts = asyncio.run(env.score_group(["a", "b"], env.tasks()[1], [[1], [2]]))
    assert parts == {"names_its_arguments": [1.0, 1.0], "numpy_values": [0.0, 1.0], "tensor_values": [1.0, 1.0],
                     "scalar_tensors": [0.25, 0.25]}
    assert total == [2.25, 3.25]
    with pytest.raises(ValueError, match=r"column\(s\) \['completions'\] named as arguments TRL-form reward functions"):
        env_of(tmp_path, rows=[{**r, "completions": 1} for r in ROWS], rewards=["reward_fns.numpy_values"]).tasks()
    with pytest.raises(RewardFunctionError, match=r"row 0: log_extra\('chars', ...\) got 1 values for 2 completions"):
        RewardLog(extra={"chars": [1]}).extra_of(2, "0")
    with pytest.raises(RewardFunctionError, match=r"log_extra\('when', ...\): values must be JSON"):
        RewardLog(extra={"when": [object(), 1]}).extra_of(2, "0")
    with pytest.raises(RewardFunctionError, match=r"log_metric\('x', nan\): expected a metric name and a finite number"):
        RewardLog().log_metric("x", float("nan"))


def test_a_reward_shaped_by_progress_takes_max_steps_as_a_bound_keyword():
    """`trainer_state` has TRL's `global_step` but no `max_steps` (the rollouts are not told it):
    the way docs/environments.md gives binds it in the config's kwargs, not a column the row needs."""
    from lit_rl.rollouts.reward_functions import RewardState

    fn = RewardFunction("reward_fns.ramped", kwargs={"max_steps": 8})
    assert fn.columns == [] and not hasattr(RewardState(2), "max_steps")
    assert asyncio.run(fn(["q"], ["a"], {}, [{"id": "0"}], None, "0", RewardState(2))) == [0.25]


def test_an_async_per_sample_function_scores_a_group_concurrently(tmp_path):
    """An async judge's eight calls for a group are in flight together, not one after another."""
    env = env_of(tmp_path, rewards=["reward_fns.slow_judge"])
    reward_fns.JUDGE.update(in_flight=0, most=0)
    total, _ = asyncio.run(env.score_group([" " * i for i in range(8)], env.tasks()[0], None))
    assert total == [float(i) for i in range(8)]
    assert reward_fns.JUDGE["most"] == 8


def test_reward_metrics_and_sampled_lengths_are_logged_from_every_sample(tmp_path):
    """`reward_metric/<name>`: the mean of what the functions logged; a sample a filter kept
    from training still counts its sampled tokens in `completion_length`."""
    kept = Sample(input_ids=[1, 2, 3], loss_mask=[False, True, True], advantages=[0.0, 1.0, 1.0], reward=1.0,
                  metadata={"completion_tokens": 2, "reward_metrics": {"chars": 4.0}})
    filtered = Sample(input_ids=[1] + [2] * 8, loss_mask=[False] * 9, advantages=[0.0] * 9, reward=0.0,
                      metadata={"completion_tokens": 8, "filtered": "repetition", "reward_metrics": {"chars": 10.0}})
    stats = rollout_stats([kept, filtered], [0, 0])
    assert stats["completion_length"] == 5.0 and stats["reward_metric/chars"] == 7.0
    # what log_extra recorded goes with each sample into the run's traces (TRL's completions table)
    kept.metadata["extra"] = {"chars": 4}
    trace_batch(tmp_path, 5, Batch([kept], index=5, versions=[5]), {})
    line = json.loads((tmp_path / "rollouts" / "trained.jsonl").read_text())
    assert line["step"] == 5 and line["samples"][0]["extra"] == {"chars": 4}


# ---- against the real server -----------------------------------------------------------------------

def test_rollout_and_eval_score_the_sampled_ids_with_every_function(vllm_server, tmp_path):
    env = env_of(tmp_path, system_prompt="Answer.", max_tokens=12)
    task = env.tasks()[2]
    reward_fns.CALLS.clear()

    async def run():
        async with vllm_server.client() as client:
            ctx = RolloutContext(client=client, tokenizer=TOK, sampling=TrainSampling(max_tokens=12), group_size=3,
                                 policy_version=0)
            group = await env.rollout(task, ctx)
            metrics = await env.evaluate(EvalRun(step=0, step_dir=vllm_server.model_dir, client=client))
            # TRL's trainer_state, log_metric and log_extra: at the rollout's policy version, the eval's step
            ctx = RolloutContext(client=client, tokenizer=TOK, sampling=TrainSampling(max_tokens=12), group_size=3,
                                 policy_version=7)
            shaped = await by_step.rollout(task, ctx)
            shaped_metrics = await by_step.evaluate(EvalRun(step=3, step_dir=vllm_server.model_dir, client=client))
            return group, metrics, shaped, shaped_metrics

    by_step = env_of(tmp_path, rewards=["reward_fns.shaped_by_step"], max_tokens=12)
    group, metrics, shaped, shaped_metrics = asyncio.run(run())
    chars = [len(s.metadata["completion"]) for s in shaped.samples]
    assert [s.reward for s in shaped.samples] == [7.0] * 3
    assert [s.metadata["extra"] for s in shaped.samples] == [{"chars": n} for n in chars]
    assert [s.metadata["reward_metrics"] for s in shaped.samples] == [{"completion_chars": sum(chars) / 3}] * 3
    assert shaped_metrics["reward"] == 3.0 and shaped_metrics["reward_metric/completion_chars"] >= 0
    assert set(shaped_metrics) >= {"reward", "reward/shaped_by_step", "reward_metric/completion_chars"}
    prompt = chat_prompt_ids(TOK, [{"role": "system", "content": "Answer."}, {"role": "user", "content": ROWS[2]["question"]}])
    ids = [s.input_ids[len(prompt):] for s in group.samples]
    texts = [TOK.decode(i, skip_special_tokens=True) for i in ids]
    assert all(s.input_ids[:len(prompt)] == prompt for s in group.samples)
    trl_call = next(c for c in reward_fns.CALLS if c["fn"] == "longer_is_better")
    assert trl_call["prompts"] == [ROWS[2]["question"]] * 3 and trl_call["completions"] == texts  # text prompts: text
    assert trl_call["completion_ids"] == ids and trl_call["level"] == [3] * 3
    assert trl_call["columns"] == ["answer", "log_extra", "log_metric", "question", "task_ids", "trainer_state"]
    for s, i, text in zip(group.samples, ids, texts):
        parts = {"longer_is_better": len(i) / 10 * 3, "mentions": float("Earth" in text)}
        assert s.metadata["rewards"] == pytest.approx(parts)
        assert s.reward == pytest.approx(0.5 * parts["longer_is_better"] + 2.0 * parts["mentions"])
    # the eval of every row (greedy, one sample each) reports each function beside the sum
    assert set(metrics) >= {"reward", "reward/longer_is_better", "reward/mentions"}
    evals = [c for c in reward_fns.CALLS if c["fn"] == "longer_is_better"][1:]
    longer = [len(i) / 10 * lv for c in evals for i, lv in zip(c["completion_ids"], c["level"])]
    assert len(evals) == len(ROWS) and metrics["reward/longer_is_better"] == pytest.approx(sum(longer) / len(longer))
    assert metrics["reward"] == pytest.approx(0.5 * metrics["reward/longer_is_better"] + 2.0 * metrics["reward/mentions"], rel=1e-6)


def test_a_failing_reward_function_rejects_its_row_under_the_buffers_rules(vllm_server, tmp_path):
    rows = [{"question": f"Say {i}.", "answer": str(i), "level": 1} for i in range(6)]
    env = env_of(tmp_path, rows=rows, rewards=["reward_fns.fails_on_row_one", "lit_rl.rewards.exact_match"])
    buffer = RolloutBuffer(env, vllm_server.client, TOK, TrainSampling(max_tokens=4), batch_size=4, group_size=2,
                           max_concurrency=8, num_batches=4, num_retries=1, retry_backoff=0.01)

    async def collect():
        async with buffer:
            return [b async for b in buffer]

    batches = asyncio.run(collect())
    trained = [s.metadata["task_id"] for b in batches for s in b]
    assert len(trained) == 16 and "1" not in trained
    assert buffer.metrics()["rollout/rejected"] >= 1 and buffer.counters["retries"] >= 1
    assert all(s.metadata["rewards"]["fails_on_row_one"] == 0.5 for b in batches for s in b)


# ---- reasoning-gym ---------------------------------------------------------------------------------

def test_reasoning_gym_tasks_repeat_from_the_seed_and_score_with_the_datasets_own_scorer():
    from lit_rl.rollouts import ReasoningGymEnv
    from lit_rl.rollouts.reasoning_gym_env import held_out_overlap

    env = ReasoningGymEnv("spell_backward", size=6, task_seed=3, config={"max_word_len": 6})
    again = ReasoningGymEnv(**env.to_config()["init_args"])  # what the evaluator process builds
    assert again.tasks() == env.tasks()
    # task i comes from seed + i: the next seed is the same tasks shifted by one, a far one is held out
    questions = [t["entry"]["question"] for t in env.tasks()]
    nxt = ReasoningGymEnv("spell_backward", size=6, task_seed=4, config={"max_word_len": 6})
    assert [t["entry"]["question"] for t in nxt.tasks()][:5] == questions[1:] and held_out_overlap(env, nxt) == 5
    far = ReasoningGymEnv("spell_backward", size=6, task_seed=1_000_000, config={"max_word_len": 6})
    assert held_out_overlap(env, far) == sum(t["entry"]["question"] in questions for t in far.tasks()) <= 1
    task = env.tasks()[0]
    word = task["entry"]["metadata"]["word"]
    assert task["prompt"][0]["role"] == "system" and "<answer>" in task["prompt"][0]["content"]
    assert task["prompt"][1]["content"].endswith(word) and 3 <= len(word) <= 6
    assert env.reward(f"Reversed: <answer>{word[::-1]}</answer>", task) == 1.0
    assert env.reward(word[::-1], task) == 0.0  # no answer tag: no answer
    assert env.reward(f"<answer>{word[::-1][:-1]}x</answer>", task) == pytest.approx((len(word) - 1) / len(word))
    plain = ReasoningGymEnv("spell_backward", size=6, task_seed=3, config={"max_word_len": 6}, system_prompt=None,
                            answer_tag=None)
    assert plain.tasks()[0]["prompt"] == task["prompt"][1:] and plain.reward(f" {word[::-1]}\n", task) == 1.0
    with pytest.raises(ValueError, match=r"no reasoning-gym dataset 'spell_backwards' \(similar: \['spell_backward'\]\)"):
        ReasoningGymEnv("spell_backwards")
    with pytest.raises(ValueError, match="spell_backward with size=1000, config={'max_len': 3}: .*unexpected keyword"):
        ReasoningGymEnv("spell_backward", config={"max_len": 3})


def test_reasoning_gym_scores_a_malformed_answer_zero_where_its_scorer_raises(caplog):
    """prime_factorization's scorer parses with int() and boxnet's iterates the answer: junk raises
    there, and is a wrong answer (0.0, one warning per dataset), not a failed group or eval."""
    from lit_rl.rollouts import ReasoningGymEnv

    env = ReasoningGymEnv("prime_factorization", size=3)
    task = env.tasks()[0]
    good = f"<answer>{task['entry']['answer']}</answer>"
    with caplog.at_level("WARNING", logger="lit_rl.rollouts.reasoning_gym_env"):
        total, _ = asyncio.run(env.score_group([good, "<answer>2 x 3</answer>", "<answer>two</answer>"], task))
        assert total == [1.0, 0.0, 0.0]
        boxnet = ReasoningGymEnv("boxnet", size=1, answer_tag=None)
        assert boxnet.reward("-1", boxnet.tasks()[0]) == 0.0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "prime_factorization's score_answer raised on the answer '2 x 3'" in warned[0]
    assert "boxnet" in warned[1]


def test_a_missing_extra_is_one_message_naming_it(monkeypatch, tmp_path):
    """Without math-verify (hidden from the import system here), naming its reward says what to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ImportError, match=r"rewards\[0\]: lit_rl.rewards.math_verify needs the 'math-verify' package: "
                                          r"pip install 'lit-rl\[envs\]'"):
        env_of(tmp_path, rewards=["lit_rl.rewards.math_verify"]).tasks()


def test_the_yaml_in_docs_environments_builds_and_scores(tmp_path):
    """docs/environments.md's copy-paste YAML (on a jsonl of its row format) and its reasoning-gym block."""
    from lit_rl.rollouts import ReasoningGymEnv

    blocks = doc_yaml_blocks("docs/environments.md")
    env_args = blocks[0]["data"]["init_args"]["env"]["init_args"]
    rows = [{"question": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}]
    env = DatasetEnv(**{**env_args, "path": write_jsonl(tmp_path / "math.jsonl", rows)})
    task = env.tasks()[0]
    assert task["prompt"][0] == {"role": "system", "content": env_args["system_prompt"]}
    total, parts = asyncio.run(env.score_group(["so \\boxed{0.75}", "3/5"], task, [[0] * 10, [0] * 1000]))
    assert parts == {"math_verify": [1.0, 0.0], "length_penalty": [0.0, pytest.approx(-232 / 256)]}
    assert total == [1.0, pytest.approx(0.1 * -232 / 256)]
    gym = ReasoningGymEnv(**blocks[1]["env"]["init_args"])
    assert len(gym.tasks()) == 2000 and all(3 <= len(t["entry"]["metadata"]["word"]) <= 6 for t in gym.tasks())


def test_lit_rl_evaluate_runs_a_dataset_env_unchanged_and_logs_each_reward(vllm_server, tmp_path, monkeypatch):
    """`lit-rl evaluate --env lit_rl.rollouts.DatasetEnv --env-args ...` on a checkpoint, against the
    session's server: the environment rebuilt from its arguments, each reward in eval_metrics.csv."""
    import csv
    import sys

    from lit_rl import cli

    args = {"path": write_jsonl(tmp_path / "rows.jsonl", ROWS), "prompt_column": "question", "rewards": TWO_REWARDS,
            "max_tokens": 8, "name": "math"}
    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    with vllm_server.run_dir() as run:
        cli.main(["evaluate", "--weights-dir", str(run / "weights"), "--base-url", vllm_server.base_url,
                  "--env", "lit_rl.rollouts.DatasetEnv", "--env-args", json.dumps(args), "--log-dir", str(tmp_path / "evals")])
    logged = {r["name"]: float(r["value"]) for r in csv.DictReader(open(tmp_path / "evals" / "eval_metrics.csv"))}
    assert {"eval/math/reward", "eval/math/reward/longer_is_better", "eval/math/reward/mentions"} <= set(logged), logged
    assert logged["eval/math/reward"] == pytest.approx(
        0.5 * logged["eval/math/reward/longer_is_better"] + 2.0 * logged["eval/math/reward/mentions"], rel=1e-6)


def test_chat_prompts_give_trl_functions_conversational_prompts_and_completions(tmp_path):
    chats = [{"prompt": [{"role": "user", "content": "Greet me."}], "answer": "hello"}]
    env = DatasetEnv(write_jsonl(tmp_path / "c.jsonl", chats), ["reward_fns.says_hello", "lit_rl.rewards.exact_match"])
    reward_fns.CALLS.clear()
    total, parts = asyncio.run(env.score_group(["hello there", "go away", "Hello"], env.tasks()[0], [[1], [2], [3]]))
    call = reward_fns.CALLS[0]
    assert call["prompts"] == [chats[0]["prompt"]] * 3
    assert call["completions"] == [[{"role": "assistant", "content": t}] for t in ("hello there", "go away", "Hello")]
    assert parts == {"says_hello": [1.0, 0.0, 0.0], "exact_match": [0.0, 0.0, 1.0]} and total == [1.0, 0.0, 1.0]


def test_math_verify_scores_on_a_fresh_pool_after_a_worker_dies(tmp_path):
    """A SIGKILLed worker (the OOM killer, say) breaks its pool: the next groups are scored on a new
    one, not failed with BrokenProcessPool for the rest of the run; no worker outlives the scorer."""
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "import asyncio, os, signal, time\n"
        "from lit_rl.rewards import math_answers, math_verify\n"
        "def score():\n"
        "    return asyncio.run(math_verify(['q', 'q'], ['\\\\boxed{1}', '2'], answer=['1', '1']))\n"
        "if __name__ == '__main__':\n"
        "    print(score(), flush=True)\n"
        "    old = list(math_answers._POOL._processes)\n"
        "    os.kill(old[0], signal.SIGKILL)\n"
        "    time.sleep(1)\n"
        "    print(score(), score(), flush=True)\n"
        "    print(' '.join(str(p) for p in old + list(math_answers._POOL._processes)), flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    workers = [int(p) for p in lines[2].split()] if len(lines) > 2 else []
    left = _outliving(workers)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert lines[:2] == ["[1.0, 0.0]", "[1.0, 0.0] [1.0, 0.0]"]
    assert "a scoring worker died; starting a fresh pool" in proc.stderr
    assert workers and not left, f"math_verify workers {left} outlived their parent"


def _outliving(pids: list[int], wait: float = 15) -> list[int]:
    """Those of `pids` still alive (not zombies) after `wait` seconds; they are killed."""
    import os
    import signal
    import time

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"

    deadline = time.monotonic() + wait
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


def test_math_verify_workers_go_with_a_killed_parent(tmp_path):
    """The spawned scoring workers exit when the process that scored is SIGKILLed (nothing of
    lit-rl's outlives its run; without the parent-death signal one worker stayed, adopted by init)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "import asyncio, time\n"
        "from lit_rl.rewards import math_answers, math_verify\n"
        "if __name__ == '__main__':\n"
        "    print(asyncio.run(math_verify(['q', 'q'], ['\\\\boxed{1}', '2'], answer=['1', '1'])), flush=True)\n"
        "    print(' '.join(str(p) for p in math_answers._POOL._processes), flush=True)\n"
        "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "[1.0, 0.0]"
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert workers
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = _outliving(workers)
    assert not left, f"math_verify workers {left} outlived their parent"
