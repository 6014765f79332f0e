"""Token-exact rollout samples: the model's turns are targets, everything else is context.

GRPO's importance ratio compares the trainer's logprob of each sampled token with the logprob
the server sampled it at, so a model turn must reach training as the exact ids and logprobs the
server returned (DESIGN.md, RL samples). Decoding a completion and re-rendering it through the
chat template can give other ids (byte-level merges, whitespace the template strips, special
tokens), so model output here is only ever appended as ids. Text is rendered only for what the
environment adds between model turns (tool results, user messages) and the template's
scaffolding around them; all of it is context (masked, logprob 0).

    t = Transcript.from_messages(tokenizer, prompt, tools=tools)
    for _ in range(max_turns):
        try:
            completion = (await client.generate(t.prompt_ids, n=1, **sampling.request_kwargs()))[0]
        except ContextLengthError:  # the transcript fills the server's context (after a first turn)
            break
        t.add_completion(completion)
        text = completion_text(tokenizer, completion)  # decoded from ids, for the env
        ...
        t.add_messages([{"role": "tool", "content": result}])
    sample = t.to_sample(reward=r)

How the context after a model turn is rendered (`Transcript.add_messages`): the template is
asked what it emits after an assistant turn (its closer, e.g. ``<|im_end|>\\n``, whose leading
special token is the end-of-turn the model emits, e.g. ``<|im_end|>``), and what a fixed short
conversation grows by when the new messages and a generation prompt are added (the delta). A
fixed conversation, not the real one, is rendered because templates such as Qwen3's rewrite
earlier assistant turns depending on later messages, so the render of the real history is not
always a prefix of the render with the new messages; the delta of a fixed conversation is what
the template puts between one assistant turn and the next. Even the fixed turn is rewritten:
Qwen3's template gives the last assistant turn an empty ``<think>`` block that it drops once a
message follows. So the delta is read after the fixed turn's body (a sentinel) and its closer in
the grown render, not as what the grown render adds to the shorter one. The context appended is
the rest of the closer after the end-of-turn token (the ``\\n`` after ``<|im_end|>``) plus the delta.

A model turn that did not end with the template's end-of-turn token (it hit ``max_tokens``, or
stopped on a string or on another eos) gets the whole closer as context: the conversation stays
well formed for the next turn, and the closing token, which the model did not sample, is not
trained. Such a transcript's sample is marked ``truncated`` when any turn hit ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

from lit_rl.data.render import _SENTINEL, RenderError, _get_probe, _Renderer, _thread_tokenizer
from lit_rl.data.samples import Sample
from lit_rl.data.tools import normalize_messages, normalize_tools
from lit_rl.inference.client import Completion, chat_prompt_ids

# The fixed conversation whose growth gives the context between two assistant turns.
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]


def completion_text(tokenizer, completion: Completion) -> str:
    """The completion as the environment should score it: decoded here from the returned ids,
    special tokens skipped (the server's `text` may be cut by stop strings or detokenisation)."""
    return tokenizer.decode(completion.completion_ids, skip_special_tokens=True)


def _check_completion(completion: Completion, prompt_ids: Sequence[int], where: str) -> None:
    if len(completion.logprobs) != len(completion.completion_ids):
        raise ValueError(f"{where}: completion has {len(completion.completion_ids)} completion_ids "
                         f"but {len(completion.logprobs)} logprobs")
    if list(completion.prompt_ids) != list(prompt_ids):
        raise ValueError(f"{where}: completion.prompt_ids ({len(completion.prompt_ids)} tokens) are not the "
                         f"prompt_ids it is appended to ({len(prompt_ids)} tokens); generate from those ids")


def completion_sample(prompt_ids: Sequence[int], completion: Completion, *, reward: float | None = None,
                      metadata: dict | None = None) -> Sample:
    """One single-turn rollout sample: prompt (context, logprob 0) + the completion's exact ids
    (targets, with the server's logprobs). `truncated` means it hit max_tokens."""
    _check_completion(completion, prompt_ids, "completion_sample")
    n, m = len(prompt_ids), len(completion.completion_ids)
    return Sample(
        input_ids=[*prompt_ids, *completion.completion_ids],
        loss_mask=[False] * n + [True] * m,
        logprobs=[0.0] * n + [float(x) for x in completion.logprobs],
        reward=None if reward is None else float(reward),
        source="policy",
        truncated=completion.finish_reason == "length",
        finish_reason=completion.finish_reason,
        metadata=dict(metadata or {}),
    )


class Transcript:
    """A multi-turn rollout assembled token by token (see the module docstring).

    Start from prompt ids (already ending with the generation prompt) or from messages, then
    alternate `add_completion` (a model turn, targets) and `add_messages` (tool results or user
    turns, context, ending with the next generation prompt); generate from `prompt_ids`.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], *, tools: Sequence[dict] | None = None,
                 chat_template_kwargs: dict | None = None):
        """
        Args:
            tokenizer: the policy's tokenizer (its chat template renders the context turns).
            prompt_ids: the first prompt, ending with the generation prompt of the first model turn.
            tools: the tool definitions the prompt was rendered with (templates may render turns
                differently with tools).
            chat_template_kwargs: as used for the prompt (e.g. ``{"enable_thinking": False}``).
        """
        if not prompt_ids:
            raise ValueError("Transcript: prompt_ids is empty")
        self.tokenizer = tokenizer
        self.tools = normalize_tools(tools)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.input_ids: list[int] = [int(t) for t in prompt_ids]
        self.loss_mask: list[bool] = [False] * len(self.input_ids)
        self.logprobs: list[float] = [0.0] * len(self.input_ids)
        self.completions: list[Completion] = []
        self._model_end = 0  # where the last model turn ends in input_ids
        self._awaiting_model = True  # the ids end with a generation prompt (or a model turn to continue)

    @classmethod
    def from_messages(cls, tokenizer, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                      chat_template_kwargs: dict | None = None) -> Transcript:
        """A transcript whose prompt is `messages` rendered with a generation prompt."""
        ids = chat_prompt_ids(tokenizer, messages, tools, chat_template_kwargs)
        return cls(tokenizer, ids, tools=tools, chat_template_kwargs=chat_template_kwargs)

    @property
    def prompt_ids(self) -> list[int]:
        """The ids to generate the next model turn from (a copy)."""
        return list(self.input_ids)

    @property
    def num_turns(self) -> int:
        """Model turns appended so far."""
        return len(self.completions)

    def add_completion(self, completion: Completion) -> None:
        """Append a model turn: its exact ids as targets with the server's logprobs.

        The completion must have been generated from `prompt_ids` (checked), so a turn is never
        trained under a context other than the one it was sampled in.
        """
        _check_completion(completion, self.input_ids, "Transcript.add_completion")
        self.input_ids += completion.completion_ids
        self.loss_mask += [True] * len(completion.completion_ids)
        self.logprobs += [float(x) for x in completion.logprobs]
        self._model_end = len(self.input_ids)
        self.completions.append(completion)
        self._awaiting_model = False

    def add_messages(self, messages: Sequence[dict]) -> None:
        """Append tool results or user turns after a model turn as context, followed by the
        generation prompt of the next model turn (see the module docstring for how)."""
        if self._awaiting_model:
            raise ValueError("Transcript.add_messages: the transcript ends with a generation prompt; "
                             "add the model's turn (add_completion) before the next messages")
        if not messages:
            raise ValueError("Transcript.add_messages: messages is empty")
        ids = self._context_ids(list(messages), closed=self._ended_with_stop())
        self.input_ids += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self._awaiting_model = True

    def to_sample(self, *, reward: float | None = None, metadata: dict | None = None) -> Sample:
        """The transcript up to its last model turn as one Sample: context added after it (a tool
        result no turn answered, when the episode ended on a full context) trains nothing and is
        left out. `finish_reason` is the last model turn's; `truncated` is True if any model turn
        hit max_tokens."""
        if not self.completions:
            raise ValueError("Transcript.to_sample: no model turn was added (nothing to train)")
        reasons = [c.finish_reason for c in self.completions]
        meta = {"turns": len(self.completions), "finish_reasons": reasons, **(metadata or {})}
        end = self._model_end
        return Sample(
            input_ids=self.input_ids[:end], loss_mask=self.loss_mask[:end], logprobs=self.logprobs[:end],
            reward=None if reward is None else float(reward), source="policy",
            truncated="length" in reasons, finish_reason=reasons[-1], metadata=meta,
        )

    # ---- rendering the context --------------------------------------------------------------------
    def _renderer(self):
        tok = _thread_tokenizer(self.tokenizer)
        template = self.tokenizer.get_chat_template(None, self.tools)
        render = _Renderer(tok, template, self.tools, self.chat_template_kwargs)
        return tok, render, _get_probe(tok, render)

    def _ended_with_stop(self) -> bool:
        """Whether the last model turn ends with the template's end-of-turn token."""
        tok, _, probe = self._renderer()
        if probe.stop is None or not self.completions[-1].completion_ids:
            return False
        stop_id = tok.convert_tokens_to_ids(probe.stop.lstrip())
        return self.completions[-1].completion_ids[-1] == stop_id

    def _context_ids(self, messages: list[dict], *, closed: bool) -> list[int]:
        tok, render, probe = self._renderer()
        grown = render(normalize_messages(_BASE + messages), gen=True)
        anchor = _SENTINEL + probe.closer
        if grown.count(anchor) != 1:
            raise RenderError(
                "Transcript.add_messages: the chat template does not close an assistant turn with "
                f"{probe.closer!r} when messages follow it, so the context between model turns cannot be derived"
            )
        closer = probe.closer[len(probe.stop):] if closed and probe.stop else probe.closer
        return tok(closer + grown[grown.index(anchor) + len(anchor):], add_special_tokens=False)["input_ids"]
