"""VerifiersEnv: a `verifiers` environment (0.4, `verifiers.v1`) as a lit-rl environment.

verifiers runs a rollout through its own machinery: each agent turn is a program (a harness)
that talks to an interception server, which calls a client of its own. lit-rl trains on the
exact ids and logprobs its server sampled, so here lit-rl plays the agents itself. The
taskset, the `Task` with its `@vf.reward` / `@vf.metric` functions and the `Env` (its
`setup`, `run` and `finalize`: who speaks when, multi-turn and multi-agent) are verifiers' own
and run unchanged; every agent `run(task)` and `interaction(task).turn(...)` the env makes is
answered by lit-rl: the turn's context is appended as ids (`lit_rl.rollouts.turns.Transcript`),
the reply generated from those ids by lit-rl's client, and the turn committed to the agent's
verifiers `Trace` with those ids and logprobs (`verifiers.v1.graph.prepare_turn(...).commit`).
When the agent's run ends, the task scores the trace (`Task.score`, as verifiers does after a
rollout) and the env's `finalize` sees the episode.

One episode is one training sample: the transcript of its one trainable agent (an env with
untrainable agents, such as verifiers' `user-sim`, generates their turns on the same server and
trains none of them), rewarded with the trace's weighted reward sum; each named reward is logged
on its own (``train/reward/<name>``). Not supported, refused at load with the reason: harness
programs and runtimes (there is no program: lit-rl generates), tool servers (MCP toolsets),
tasks that need a container, and an episode with other than one trainable agent. A reward that
needs a runtime is skipped by verifiers itself (`Task.score` without one, logged). `@vf.stop`
hooks are not run; each agent stops at its `max_turns` (this environment's `max_turns` when the
agent config sets none).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from lit_rl.data.samples import SampleGroup
from lit_rl.inference.client import ContextLengthError
from lit_rl.rewards.extras import require
from lit_rl.rollouts.context import RolloutContext
from lit_rl.rollouts.envs import Environment, EvalRun, eval_metrics
from lit_rl.rollouts.reward_functions import RewardFunctionError
from lit_rl.rollouts.turns import Transcript, completion_text


class VerifiersEnv(Environment):
    default_name = "verifiers"

    def __init__(self, taskset: str, taskset_args: dict[str, Any] | None = None, env: str | None = None,
                 env_args: dict[str, Any] | None = None, max_turns: int = 8, **kwargs):
        """
        Args:
            taskset: the verifiers taskset id: an installed module exporting its `Taskset`
                subclass in `__all__` (as `verifiers eval <id>` takes it).
            taskset_args: the taskset's config fields (its `TasksetConfig` subclass).
            env: a verifiers `Env` id (an installed module exporting an `Env` subclass); default:
                the taskset's own, else verifiers' `SingleAgentEnv`.
            env_args: the env's config fields (its agents' `max_turns`, say).
            max_turns: model turns of an agent whose config sets no `max_turns`.
        """
        require("verifiers", "VerifiersEnv")
        super().__init__(**kwargs)
        if max_turns < 1:
            raise ValueError(f"VerifiersEnv: max_turns must be >= 1, got {max_turns}")
        self.taskset, self.taskset_args, self.env = taskset, dict(taskset_args or {}), env
        self.env_args, self.max_turns = dict(env_args or {}), max_turns
        self._vf_env = None
        self._vf_tasks: list | None = None

    # ---- loading ------------------------------------------------------------------------------
    def vf_env(self):
        """The verifiers `Env` (built once, from the taskset and env ids)."""
        if self._vf_env is None:
            from verifiers.v1.configs.env import EnvConfig
            from verifiers.v1.env import Env
            from verifiers.v1.utils.generic import concrete_type
            from verifiers.v1.utils.loaders import environment_class

            env_cls = environment_class(self.taskset, self.env or "")
            config_cls = concrete_type(env_cls, EnvConfig, origin=Env) or EnvConfig
            config = config_cls.model_validate({**self.env_args, "id": self.env or "",
                                                "taskset": {**self.taskset_args, "id": self.taskset}})
            vf_env = env_cls(config)
            refused = _unsupported(vf_env)
            if refused:
                raise ValueError(f"VerifiersEnv {self.taskset!r}: {refused}, which lit-rl does not run "
                                 "(docs/environments.md, verifiers)")
            self._vf_env = vf_env
        return self._vf_env

    def load_tasks(self) -> list[dict]:
        tasks = list(self.vf_env().taskset)
        if not tasks:
            raise ValueError(f"VerifiersEnv: taskset {self.taskset!r} yields no task")
        for task in tasks:
            if task.NEEDS_CONTAINER or task.toolsets(task.config):
                raise ValueError(f"VerifiersEnv {self.taskset!r}: task {task.data.idx} needs "
                                 f"{'a container' if task.NEEDS_CONTAINER else 'tool servers'}, which lit-rl does not run")
        self._vf_tasks = tasks
        return [{"id": str(task.data.id if task.data.id is not None else task.data.idx), "index": i}
                for i, task in enumerate(tasks)]

    def vf_task(self, task: dict):
        if self._vf_tasks is None:
            self.tasks()
        return self._vf_tasks[task["index"]]

    def prompt(self, task: dict) -> list[dict]:
        """The task's opening messages (system prompt, then its prompt), as chat dicts."""
        return _opening(self.vf_task(task).data)

    def reward(self, completion: str, task: dict) -> float:
        raise TypeError("VerifiersEnv scores whole episodes (the verifiers task's rewards), not a completion")

    # ---- rollouts and evals -------------------------------------------------------------------
    async def episode(self, task: dict, client, tokenizer, sampling: dict, chat_template_kwargs: dict | None = None):
        """Play one episode of `task`: the env's `setup`, `run` and `finalize` with lit-rl's
        agents. Returns the trainable agent's `(Transcript, Trace)`."""
        from verifiers.v1.episode import EnvInfo, Episode
        from verifiers.v1.errors import TaskError
        from verifiers.v1.trace import TraceTask

        vf_env, vf_task = self.vf_env(), self.vf_task(task)
        episode = Episode(env=EnvInfo(id=vf_env.config.env_id),
                          task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash))
        play = _Play(client, tokenizer, sampling, dict(chat_template_kwargs or {}), self.max_turns, episode)
        agents = _Agents(vf_env, play)
        try:
            await vf_env.setup(agents)
            await vf_env.run(vf_task, agents)
            await vf_env.finalize(vf_task, episode)
        except TaskError as e:  # the task's scoring raised: retried, then the task rejected, as a reward function's
            raise RewardFunctionError(f"VerifiersEnv {self.taskset!r}, task {task['id']}: {e}") from e
        trained = [(t, trace) for t, trace in play.played if trace.agent.trainable]
        if len(trained) != 1:
            raise ValueError(f"VerifiersEnv {self.taskset!r}: an episode gave {len(trained)} trainable agent runs; "
                             "lit-rl trains one per episode (mark the others untrainable in the env's setup)")
        return trained[0]

    async def rollout(self, task: dict, ctx: RolloutContext) -> SampleGroup:
        """`ctx.group_size` episodes of `task`; each is one sample of exact ids and logprobs."""
        played = await asyncio.gather(*(
            self.episode(task, ctx.client, ctx.tokenizer, ctx.sampling.request_kwargs(), ctx.chat_template_kwargs)
            for _ in range(ctx.group_size)))
        task_id = self.task_id(task)
        rewards = self.checked_rewards([trace.reward for _, trace in played], len(played), task)
        samples = [transcript.to_sample(reward=reward, metadata=_metadata(task_id, trace))
                   for (transcript, trace), reward in zip(played, rewards)]
        return SampleGroup(samples=samples, task_id=task_id)

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        """Every task played `samples_per_prompt` times with the eval sampling; mean reward (and
        pass@k), and each named reward on its own. Episode k sends seed + k: its requests are its
        own, and one shared seed would repeat one sample k times (pass@k would be pass@1)."""
        tokenizer = await run.client.tokenizer()  # the served model's, as `chat` renders with
        tasks = self.tasks()
        results = await asyncio.gather(*(
            asyncio.gather(*(self.episode(task, run.client, tokenizer, self._eval_sampling(k), run.chat_template_kwargs)
                             for k in range(self.samples_per_prompt)))
            for task in tasks))
        scored = []
        for task, played in zip(tasks, results):
            traces = [trace for _, trace in played]
            parts = [_reward_parts(trace) for trace in traces]
            rewards = self.checked_rewards([trace.reward for trace in traces], len(traces), task)  # NaN: named, not dropped
            scored.append((rewards, {name: [p.get(name) for p in parts] for name in parts[0]}))
            run.traces += [{"prompt": self.prompt(task), "completion": trace.last_reply, "reward": trace.reward,
                            "rewards": part} for trace, part in zip(traces, parts)]
        return eval_metrics(scored, self.samples_per_prompt)

    def _eval_sampling(self, k: int) -> dict:
        """The eval sampling of a task's episode k (its seed offset by k, as `LookupEnv`'s)."""
        s = self.sampling
        return {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                "seed": None if s.seed is None else s.seed + k}


def _reward_parts(trace) -> dict[str, float]:
    return {name: float(r.score) for name, r in trace.rewards.items() if r is not None}


def _metadata(task_id, trace) -> dict:
    return {"task_id": task_id, "completion": trace.last_reply, "rewards": _reward_parts(trace),
            "metrics": {name: float(v) for name, v in trace.metrics.items() if isinstance(v, int | float)}}


def _unsupported(vf_env) -> str | None:
    """Why lit-rl cannot play this env, or None."""
    taskset = vf_env.taskset
    if type(taskset).toolsets(taskset.config):
        return "its taskset runs tool servers (MCP toolsets)"
    return None


def _opening(data) -> list[dict]:
    """A task's system prompt and prompt as chat dicts (an empty list for a prompt-less task)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [_chat_dict(m) for m in data.prompt]
    return messages


def _chat_dict(message) -> dict:
    """A verifiers message (pydantic) or a wire dict, as a chat dict."""
    return message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)


class _Play:
    """What the agents of one episode share: the client and sampling, and the runs played."""

    def __init__(self, client, tokenizer, sampling: dict, chat_template_kwargs: dict, max_turns: int, episode):
        self.client, self.tokenizer, self.sampling = client, tokenizer, sampling
        self.chat_template_kwargs, self.max_turns, self.episode = chat_template_kwargs, max_turns, episode
        self.played: list[tuple[Transcript, Any]] = []


class _Agents:
    """Stands in for verifiers' `Agents`: `agents.<role>` is lit-rl's agent for that role of
    the env's config (one object per role and episode)."""

    def __init__(self, vf_env, play: _Play):
        from verifiers.v1.configs.agent import agent_config_fields

        self._specs, self._play, self._made = agent_config_fields(vf_env.config), play, {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._specs:
            raise AttributeError(f"the env declares no agent {name!r} (agents: {sorted(self._specs)})")
        if name not in self._made:
            self._made[name] = _Agent(name, self._specs[name], self._play)
        return self._made[name]


class _Agent:
    """Stands in for a verifiers `Agent`: `run(task)` plays one segment (the model answers the
    task's prompt), `interaction(task)` holds the exchange open turn by turn."""

    def __init__(self, name: str, config, play: _Play):
        self.name, self.config, self._play = name, config, play
        self.trainable = True

    async def run(self, task, **_):
        async with self.interaction(task) as exchange:
            await exchange.turn()
        return exchange.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_):
        exchange = _Exchange(self, task)
        try:
            yield exchange
        finally:
            await exchange.close()


class _Exchange:
    """One agent's rollout of one task, turn by turn (verifiers' `Interaction`)."""

    def __init__(self, agent: _Agent, task):
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        self.agent, self.task, self.play = agent, task, agent._play
        info = AgentInfo(config=AgentConfig(model=getattr(agent.config, "model", None) or "lit-rl-policy"),
                         name=agent.name)
        self.trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                           agent=info)
        self.messages = _opening(task.data)  # the conversation so far, as chat dicts
        self.transcript: Transcript | None = None
        self.max_turns = getattr(agent.config, "max_turns", None) or self.play.max_turns
        self.closed = False

    async def turn(self, message=None):
        """The user's `message` (None: the task's prompt opens), then one model turn; a
        terminated segment once the agent's `max_turns` are used."""
        from verifiers.v1.agent import Segment
        from verifiers.v1.graph import prepare_turn
        from verifiers.v1.types import AssistantMessage, Response, TurnTokens

        if self.closed:
            raise RuntimeError("this interaction is closed")
        prompted = self.transcript is None and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: a bare turn() takes a prompted task's opening reply")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if self.trace.num_turns >= self.max_turns:
            self.trace.stop("max_turns")
            return Segment(messages=[], terminated=True)
        new = [] if message is None else _user_messages(message)
        self.messages += new
        if self.transcript is None:
            self.transcript = Transcript.from_messages(self.play.tokenizer, self.messages,
                                                       chat_template_kwargs=self.play.chat_template_kwargs)
        else:
            self.transcript.add_messages(new)
        prompt_ids = self.transcript.prompt_ids
        try:
            completion = (await self.play.client.generate(prompt_ids, n=1, **self.play.sampling))[0]
        except ContextLengthError:
            if not self.transcript.completions:
                raise
            self.trace.stop("prompt_too_long")  # the transcript fills the server's context: the episode ends
            return Segment(messages=[], terminated=True)
        self.transcript.add_completion(completion)
        text = completion_text(self.play.tokenizer, completion)
        reply = AssistantMessage(content=text)
        finish = completion.finish_reason if completion.finish_reason in ("stop", "length") else "stop"
        prepare_turn(self.trace, [_vf_message(m) for m in self.messages]).commit(Response(
            id=f"lit-rl-{self.trace.id}-{self.trace.num_turns}", created=int(time.time()), model=self.trace.agent.config.model,
            message=reply, finish_reason=finish,
            tokens=TurnTokens(prompt_ids=prompt_ids, completion_ids=list(completion.completion_ids),
                              completion_logprobs=[float(x) for x in completion.logprobs])))
        self.messages.append({"role": "assistant", "content": text})
        return Segment(messages=[reply])

    async def close(self):
        """End the exchange: the task scores the trace, and the run joins the episode."""
        if self.closed:
            return self.trace
        self.closed = True
        if self.transcript is None or not self.transcript.completions:
            raise ValueError(f"VerifiersEnv: agent {self.agent.name!r} ended its run without a model turn")
        self.trace.stop("user_closed")
        self.trace.agent.trainable = self.agent.trainable  # as the env's setup left it
        await self.task.score(self.trace)
        self.play.episode.traces.append(self.trace)
        self.play.played.append((self.transcript, self.trace))
        return self.trace


def _user_messages(message) -> list[dict]:
    if isinstance(message, str):
        return [{"role": "user", "content": message}]
    return [_chat_dict(m) for m in message]


def _vf_message(message: dict):
    from verifiers.v1.dialects import parse_message

    return parse_message(message)
