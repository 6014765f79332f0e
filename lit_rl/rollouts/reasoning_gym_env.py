"""ReasoningGymEnv: any of reasoning-gym's procedural datasets, scored by the dataset's own `score_answer`.

    env:
      class_path: lit_rl.rollouts.ReasoningGymEnv
      init_args: {dataset: spell_backward, size: 2000, task_seed: 0, config: {max_word_len: 6}}

reasoning-gym generates tasks from a seed (`create_dataset(name, size=..., seed=..., **config)`),
so every process that builds the environment from the same arguments (trainer, evaluator) lists
the same tasks. Held-out tasks need a seed far away, not the next one: most of its generators
draw task i from `Random(seed + i)`, so seeds 0 and 1 share all but one task. Evals should use a
`task_seed` at least the training `size` beyond the training seed (`held_out_overlap` counts
the questions two environments share). The completion's answer is what
the model wrote inside ``<answer>...</answer>`` (reasoning-gym's `extract_answer`, the format
its system prompts ask for), or the whole stripped completion with ``answer_tag: null``.
Needs the optional `reasoning-gym` package (``pip install 'lit-rl[envs]'``).
"""

from __future__ import annotations

import logging
from typing import Any

from lit_rl.rewards.extras import require
from lit_rl.rollouts.envs import Environment

log = logging.getLogger(__name__)


class ReasoningGymEnv(Environment):
    """Tasks from a reasoning-gym dataset by name; reward: its `score_answer` of the extracted answer."""

    default_name = "reasoning_gym"

    def __init__(self, dataset: str, size: int = 1000, task_seed: int = 0, config: dict[str, Any] | None = None,
                 system_prompt: str | None = "default", answer_tag: str | None = "answer", **kwargs):
        """
        Args:
            dataset: a reasoning-gym dataset name (``spell_backward``, ``basic_arithmetic``, ...).
            size: how many tasks to generate.
            task_seed: the generator's seed (``seed`` is the eval sampling seed). Task i comes
                from seed + i in most generators: for held-out tasks take a seed at least ``size``
                beyond the training one (e.g. 1_000_000).
            config: the dataset's own options (its ``...Config`` fields, e.g. ``max_word_len``).
            system_prompt: a key of reasoning-gym's ``SYSTEM_PROMPTS`` (``default``, ``simple``,
                ``direct``, ...), a system prompt of your own, or None for none.
            answer_tag: the tag whose last occurrence holds the answer; None: the whole completion.
        """
        require("reasoning_gym", "ReasoningGymEnv")
        super().__init__(**kwargs)
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            close = sorted(n for n in DATASETS if dataset.split("_")[0] in n)[:8]
            raise ValueError(f"ReasoningGymEnv: no reasoning-gym dataset {dataset!r}"
                             + (f" (similar: {close})" if close else f" ({len(DATASETS)} exist, e.g. {sorted(DATASETS)[:5]})"))
        self.dataset, self.size, self.task_seed, self.config = dataset, size, task_seed, config
        self.system_prompt, self.answer_tag = system_prompt, answer_tag
        self._warned = False
        try:
            self._data = reasoning_gym.create_dataset(dataset, size=size, seed=task_seed, **(config or {}))
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"ReasoningGymEnv: {dataset} with size={size}, config={config}: {e}") from e
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self._system = SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt else None

    def load_tasks(self) -> list[dict]:
        tasks = []
        for i, entry in enumerate(self._data):
            prompt = [{"role": "user", "content": entry["question"]}]
            if self._system:
                prompt.insert(0, {"role": "system", "content": self._system})
            tasks.append({"id": str(i), "prompt": prompt, "entry": entry})
        return tasks

    def answer(self, completion: str) -> str | None:
        """The answer part of a completion (None when the tag is missing: scored as no answer)."""
        if self.answer_tag is None:
            return completion.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion, tag_name=self.answer_tag)

    def reward(self, completion: str, task: dict) -> float:
        """The dataset's score; 0.0 where its scorer raises on a malformed answer (some parse it
        unguarded: prime_factorization's int("2 x 3")), which is a wrong answer, not a failed group."""
        answer = self.answer(completion)
        try:
            return float(self._data.score_answer(answer, task["entry"]))
        except Exception as e:
            if not self._warned:
                self._warned = True
                log.warning("ReasoningGymEnv: %s's score_answer raised on the answer %.80r (%r); malformed answers "
                            "score 0.0 (said once)", self.dataset, answer, e)
            return 0.0


def held_out_overlap(train: ReasoningGymEnv, held_out: ReasoningGymEnv) -> int:
    """How many of `held_out`'s questions `train` also asks (0 for a clean held-out set)."""
    asked = {t["entry"]["question"] for t in train.tasks()}
    return sum(t["entry"]["question"] in asked for t in held_out.tasks())
