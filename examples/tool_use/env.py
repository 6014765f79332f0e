"""A multi-turn tool-use environment: the model must call `lookup(key)` to learn a secret code,
then answer with it. It shows how a multi-turn rollout is written with `Transcript`, and needs
no data: tasks are generated in code from a seed.

    rollout per sample:  prompt (with the tool) -> model turn -> tool result or a reminder -> ...
    reward: 1.0 if the tool was called and the final answer (a turn without a tool call)
            contains the secret code, else 0.0

Use it as `class_path: examples.tool_use.env.LookupEnv` (run from the repository root).
"""

from __future__ import annotations

import asyncio
import json
import random
import re

from lit_rl.data.samples import Sample, SampleGroup
from lit_rl.inference import ContextLengthError
from lit_rl.rollouts import Environment, RolloutContext, TrainSampling, Transcript, completion_text
from lit_rl.rollouts.envs import EvalRun, eval_metrics

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Return the secret code stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
REMINDER = "Call the lookup tool first."
_KEYS = ["apple", "river", "stone", "light", "music", "green", "table", "water", "cloud", "tiger"]
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_call(text: str) -> dict | None:
    """The first well-formed ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in
    `text` (the format of Qwen-style templates) as ``{"name", "arguments"}``, else None."""
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1).strip())
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, str):
            args = json.loads(args)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
        return None
    return {"name": call["name"], "arguments": args}


class LookupEnv(Environment):
    """Find a secret code with the `lookup` tool, then say it (see the module docstring)."""

    default_name = "lookup"
    default_max_tokens = 64

    def __init__(self, num_tasks: int = 100, max_turns: int = 3, task_seed: int = 0, **kwargs):
        """
        Args:
            num_tasks: how many tasks to generate.
            max_turns: model turns per rollout at most (tool calls and reminders included).
            task_seed: seed of the task generator.
        """
        problems = [f"num_tasks must be >= 1, got {num_tasks}"] if num_tasks < 1 else []
        if max_turns < 2:
            problems.append(f"max_turns must be >= 2 (a tool call, then an answer), got {max_turns}")
        if problems:
            raise ValueError("LookupEnv: " + "; ".join(problems))
        super().__init__(**kwargs)
        self.num_tasks, self.max_turns, self.task_seed = num_tasks, max_turns, task_seed

    def load_tasks(self) -> list[dict]:
        rng = random.Random(self.task_seed)
        tasks = []
        for i in range(self.num_tasks):
            key = f"{rng.choice(_KEYS)}{i}"
            prompt = f"Find the code for {key!r} with the lookup tool, then reply with the code."
            tasks.append({"id": str(i), "key": key, "secret": str(rng.randint(10000, 99999)),
                          "prompt": [{"role": "user", "content": prompt}]})
        return tasks

    def tools(self, task: dict) -> list[dict]:
        return [LOOKUP_TOOL]

    def run_tool(self, call: dict, task: dict) -> str:
        """The tool's answer: the secret for the task's key; an error text for anything else."""
        if call["name"] != "lookup":
            return f"error: unknown tool {call['name']!r}"
        key = call["arguments"].get("key")
        return task["secret"] if key == task["key"] else f"error: no code stored under {key!r}"

    def reward(self, completion: str, task: dict) -> float:
        """Of a final answer (the rollout also requires that the tool was called)."""
        return 1.0 if task["secret"] in completion else 0.0

    async def rollout(self, task: dict, ctx: RolloutContext) -> SampleGroup:
        episodes = [self.episode(task, ctx, k) for k in range(ctx.group_size)]
        return SampleGroup(samples=list(await asyncio.gather(*episodes)), task_id=self.task_id(task))

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        """Every task played as in training (tool calls answered, reminders given), with the eval
        sampling (greedy by default): the inherited single-turn eval would stop at the first tool
        call and score 0."""
        s = self.sampling
        ctx = RolloutContext(client=run.client, tokenizer=await run.client.tokenizer(),
                             sampling=TrainSampling(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                                    seed=s.seed),
                             group_size=self.samples_per_prompt, policy_version=run.step,
                             chat_template_kwargs=run.chat_template_kwargs)
        tasks = self.tasks()
        played = await asyncio.gather(*(asyncio.gather(*(self.episode(task, ctx, k) for k in range(self.samples_per_prompt)))
                                        for task in tasks))
        for task, samples in zip(tasks, played):
            run.traces += [{"prompt": self.prompt(task), "completions": sample.metadata["completions"],
                            "reward": sample.reward, "tool_called": sample.metadata["tool_called"]} for sample in samples]
        return eval_metrics([([sample.reward for sample in samples], {}) for samples in played], self.samples_per_prompt)

    async def episode(self, task: dict, ctx: RolloutContext, k: int = 0) -> Sample:
        """One multi-turn rollout: sample a turn; run a tool call, or remind the model to make
        one; stop after an answer that follows a tool call, or after `max_turns` model turns."""
        sampling = ctx.sampling.request_kwargs()
        if sampling["seed"] is not None:  # one request per episode: a shared seed would repeat episodes
            sampling["seed"] += k
        t = Transcript.from_messages(ctx.tokenizer, self.prompt(task), tools=self.tools(task),
                                     chat_template_kwargs=ctx.chat_template_kwargs)
        called, texts, call = False, [], None
        while t.num_turns < self.max_turns:
            try:
                completion = (await ctx.client.generate(t.prompt_ids, n=1, **sampling))[0]
            except ContextLengthError:  # the transcript fills the server's context: the episode ends here
                if not t.num_turns:
                    raise
                break
            t.add_completion(completion)
            texts.append(completion_text(ctx.tokenizer, completion))
            call = parse_tool_call(texts[-1])
            if (call is None and called) or t.num_turns == self.max_turns:
                break
            if call is None:
                t.add_messages([{"role": "user", "content": REMINDER}])
            else:
                called = True
                t.add_messages([{"role": "tool", "content": self.run_tool(call, task)}])
        answered = called and call is None
        reward = await self.score(texts[-1], task) if answered else 0.0
        return t.to_sample(reward=reward, metadata={"task_id": self.task_id(task), "completions": texts,
                                                    "tool_called": called})
