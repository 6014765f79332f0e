"""Render a chat with any HF chat template into token ids plus a per-token loss mask.

SFT must train exactly the tokens the model emits as the assistant: each assistant body (content,
the reasoning the template keeps for that turn, tool calls) and the end-of-turn token that makes
it stop. Scaffolding (``<|im_start|>assistant\\n``), system/user/tool turns and whatever follows
the end-of-turn token (``\\n``) are context. Few templates carry ``{% generation %}`` markers, so
the mask is derived from the template's own behaviour instead:

1. Probe the template once (per tokenizer and template): the assistant header ``H`` (what the
   generation prompt adds), the closer ``C`` (what follows an assistant body) and the stop text
   ``S`` (``C``'s leading special token, e.g. ``<|im_end|>``).
2. Render the whole chat once: ``F``. Tokens are attributed against ``F`` only, because
   templates such as Qwen3's drop reasoning from earlier turns, so the render of a prefix of the
   chat is not always a prefix of ``F``. A turn starts after the k-th occurrence of ``H`` when
   ``H`` occurs once per assistant message (cross-checked against prefix renders that are prefixes
   of ``F``; where one is, what its generation prompt adds after ``H``, such as the empty think
   block of ``enable_thinking=False``, is context too), else after the prefix render with a
   generation prompt, which must then be a prefix. ``H`` is the scaffold common to the generation
   prompt, a last turn and an earlier turn (Qwen3 gives only turns after the last user message a
   think block).
3. A turn ends after the first ``S`` that follows its start. A template with no stop token gets
   the body end from the prefix render and the tokenizer's eos appended as a trained target.
4. ``F`` is cut into context/target pieces, each tokenized alone; the concatenation must equal the
   tokenization of ``F``, otherwise a token straddles a boundary and ``RenderError`` is raised.
   Masks are never guessed: any inconsistency raises ``RenderError``.

HF fast tokenizers are not safe to share between threads, so each thread renders with its own
deep copy of the tokenizer.
"""

from __future__ import annotations

import copy
import json
import threading
import warnings
import weakref
from dataclasses import dataclass
from os.path import commonprefix
from typing import Any

from jinja2.exceptions import TemplateError

from lit_rl.data.tools import normalize_messages, normalize_tools

_SENTINEL = "Zq7SentinelQ9x"
_RESERVED = {"add_generation_prompt", "tokenize", "tools", "chat_template", "continue_final_message"}


def chat_template_kwargs_problem(kwargs: dict | None) -> str | None:
    """The variables a caller may not pass to the chat template: those lit-rl sets itself (the
    generation prompt, the tools) or that would change what a render returns."""
    if bad := _RESERVED & dict(kwargs or {}).keys():
        return f"chat_template_kwargs may not set {sorted(bad)}"
    return None


class RenderError(ValueError):
    """A chat cannot be rendered, or its tokens cannot be attributed to turns with certainty."""


@dataclass
class RenderedChat:
    input_ids: list[int]
    loss_mask: list[bool]  # True where the token is a trained target
    appended_stop: bool  # the tokenizer's eos was appended because the template emits no stop token


@dataclass(frozen=True)
class _Probe:
    header: str  # H: scaffold before an assistant body ("" if the template has none)
    closer: str  # C: everything the template emits after an assistant body
    stop: str | None  # S: the end-of-turn text the model must emit, None if the template has none


_local = threading.local()
_copy_lock = threading.Lock()
_probes: dict[tuple, _Probe] = {}
_probe_lock = threading.Lock()


def _thread_tokenizer(tokenizer):
    """This thread's private deep copy of ``tokenizer`` (fast tokenizers fail when shared)."""
    copies = getattr(_local, "copies", None)
    if copies is None:
        copies = _local.copies = weakref.WeakKeyDictionary()
    tok = copies.get(tokenizer)
    if tok is None:
        with _copy_lock:  # copying reads the Rust tokenizer; serialise against other copies
            tok = copy.deepcopy(tokenizer)
        copies[tokenizer] = tok
    return tok


class _Renderer:
    def __init__(self, tok, template: str, tools: list[dict] | None, kwargs: dict):
        self.tok, self.template, self.tools, self.kwargs = tok, template, tools, kwargs

    def __call__(self, messages: list[dict], gen: bool = False, tools: Any = "default") -> str:
        try:
            return self.tok.apply_chat_template(
                messages,
                tools=self.tools if tools == "default" else tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=gen,
                **self.kwargs,
            )
        except TemplateError as err:
            raise RenderError(f"chat template failed: {err}") from err
        except Exception as err:
            # A template's own bug (a TypeError on a row's values) is still this row's failure: it
            # must name the row and obey bad_rows, not end the run with a traceback.
            raise RenderError(f"chat template failed: {type(err).__name__}: {err}") from err


def _stop_text(tok, closer: str) -> str | None:
    """The closer's leading special token (after optional whitespace), else None."""
    specials = {t.content for t in tok.added_tokens_decoder.values()} | set(tok.all_special_tokens)
    if tok.eos_token:
        specials.add(str(tok.eos_token))
    body = closer.lstrip()
    for text in sorted(specials, key=len, reverse=True):
        if text and body.startswith(text):
            return closer[: len(closer) - len(body) + len(text)]
    return None


def _probe(tok, render: _Renderer) -> _Probe:
    user = [{"role": "user", "content": "x"}]
    base, gen = render(user, tools=None), render(user, gen=True, tools=None)
    chat = render(user + [{"role": "assistant", "content": _SENTINEL}], tools=None)
    if chat.count(_SENTINEL) != 1:
        raise RenderError("chat template does not render assistant content verbatim; cannot attribute tokens")
    before, closer = chat.split(_SENTINEL)
    h_gen = gen[len(base) :] if gen.startswith(base) else ""
    h_chat = before[len(base) :] if before.startswith(base) else ""
    # The same turn followed by another user turn: Qwen3's template gives only the turns after the
    # last user message an (empty) think block, so an earlier turn's header lacks it.
    try:
        earlier = render(user + [{"role": "assistant", "content": _SENTINEL}, {"role": "user", "content": "y"}], tools=None)
    except RenderError:
        earlier = ""
    h_earlier = earlier.split(_SENTINEL)[0][len(base) :] if earlier.count(_SENTINEL) == 1 and earlier.startswith(base) else ""
    # With e.g. enable_thinking=False the generation prompt carries an empty think block that
    # in-chat turns lack; the common prefix is the scaffold every assistant turn starts with.
    seen = [h for h in (h_gen, h_chat, h_earlier) if h]
    header = commonprefix(seen) if seen else ""
    return _Probe(header=header, closer=closer, stop=_stop_text(tok, closer))


def _get_probe(tok, render: _Renderer) -> _Probe:
    kw = json.dumps(render.kwargs, sort_keys=True, default=repr)
    key = (tok.name_or_path, len(tok), str(tok.eos_token), render.template, kw)
    probe = _probes.get(key)
    if probe is None:
        probe = _probe(tok, render)
        with _probe_lock:
            fresh = key not in _probes
            probe = _probes.setdefault(key, probe)
        if fresh and probe.stop is None:
            warnings.warn(
                f"chat template of {tok.name_or_path!r} emits no end-of-turn token after assistant turns "
                f"(closer {probe.closer!r}); appending eos {tok.eos_token!r} as a trained target "
                "so the model learns to stop",
                stacklevel=3,
            )
    return probe


def _impossible(i: int, why: str) -> RenderError:
    return RenderError(
        f"cannot attribute tokens to the assistant turn at message {i}: {why}; "
        "the chat template rewrites earlier turns, so attribution is impossible"
    )


def _find_all(text: str, sub: str) -> list[int]:
    out, pos = [], text.find(sub)
    while pos >= 0:
        out.append(pos)
        pos = text.find(sub, pos + len(sub))
    return out


def _turn_starts(full: str, messages: list[dict], asst: list[int], probe: _Probe, render: _Renderer) -> list[int]:
    """Character offset in ``full`` where each assistant body starts."""
    h = probe.header
    occ = _find_all(full, h) if h else []
    if h and len(occ) == len(asst):
        starts = [o + len(h) for o in occ]
        for k, i in enumerate(asst):  # cross-check with prefix renders that are prefixes of F
            if i == 0:  # a chat that opens with the assistant: nothing before it to render (templates refuse [])
                continue
            p = render(messages[:i], gen=True)
            if full.startswith(p):
                if sum(o + len(h) <= len(p) for o in occ) != k + 1:
                    raise _impossible(i, f"the assistant header {h!r} is ambiguous")
                # what the generation prompt adds after the header (enable_thinking=False's empty
                # think block) is context: the model is given it, it does not emit it
                starts[k] = max(starts[k], len(p))
        return starts
    starts = []
    for i in asst:
        p = render(messages[:i], gen=True)
        if not full.startswith(p):
            raise _impossible(
                i,
                f"the assistant header {h!r} occurs {len(occ)} times for {len(asst)} assistant messages and "
                f"the render of messages[:{i}] with a generation prompt is not a prefix of the full render",
            )
        start = len(p)
        if h and not p.endswith(h) and full.startswith(h, start):
            start += len(h)  # the template's generation prompt omits the header
        starts.append(start)
    return starts


def _holding(message, text: str, where: str = "") -> str | None:
    """The first field of `message` (content, reasoning, a tool call's arguments...) whose string holds
    `text`, named as a path (``tool_calls[0].function.arguments``); None if none does."""
    if isinstance(message, str):
        return where or "content" if text in message else None
    items = message.items() if isinstance(message, dict) else enumerate(message) if isinstance(message, (list, tuple)) else ()
    for key, value in items:
        if key == "role":
            continue
        path = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else str(key)
        if found := _holding(value, text, path):
            return found
    return None


def _turn_ends(full, messages, asst, starts, probe, render) -> list[int]:
    """Character offset in ``full`` where each trained span ends (after the stop text if any)."""
    ends = []
    for k, (i, start) in enumerate(zip(asst, starts)):
        limit = starts[k + 1] if k + 1 < len(asst) else len(full)
        r = render(messages[: i + 1])
        is_prefix = full.startswith(r)
        if probe.stop is not None:
            if field := _holding(messages[i], probe.stop):
                raise RenderError(
                    f"assistant message {i} has the end-of-turn text {probe.stop!r} in its {field}: the tokenizer "
                    "reads it as the turn's end, so the turn would be trained to stop there and the rest of it "
                    "would not be trained; remove the text from the row, or skip such rows (bad_rows)"
                )
            pos = full.find(probe.stop, start)
            end = pos + len(probe.stop)
            if pos < 0 or end > limit or (is_prefix and end > len(r)):
                raise RenderError(
                    f"assistant turn at message {i} has no end-of-turn {probe.stop!r} before the next turn"
                )
        else:
            if not is_prefix or not r.endswith(probe.closer):
                raise _impossible(i, f"the render of messages[:{i + 1}] is not a prefix of the full render")
            end = len(r) - len(probe.closer)
        if end < start or (ends and start < ends[-1]):
            raise RenderError(f"assistant turn at message {i} overlaps the previous turn")
        ends.append(end)
    return ends


def render_messages(
    tokenizer, messages, tools=None, *, chat_template_kwargs: dict | None = None, train_from: int = 0
) -> RenderedChat:
    """Tokenize a chat with ``tokenizer``'s chat template and mark every assistant turn as target.

    Assistant turns before message index ``train_from`` (e.g. few-shot turns inside a prompt
    of a prompt/completion row) stay context.

    Safe to call from several threads with the same tokenizer. Raises ``ValueError`` for bad
    messages or tools and ``RenderError`` when the mask cannot be derived with certainty.
    """
    messages = normalize_messages(messages)
    tools = normalize_tools(tools)
    kwargs = dict(chat_template_kwargs or {})
    if problem := chat_template_kwargs_problem(kwargs):
        raise ValueError(problem)
    template = tokenizer.get_chat_template(None, tools)  # read from the caller's (shared) tokenizer
    tok = _thread_tokenizer(tokenizer)
    render = _Renderer(tok, template, tools, kwargs)
    probe = _get_probe(tok, render)

    full = render(messages)
    asst = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    starts = _turn_starts(full, messages, asst, probe, render)
    ends = _turn_ends(full, messages, asst, starts, probe, render)
    trained = [i >= train_from for i in asst]

    pieces, pos = [], 0
    for start, end, train in zip(starts, ends, trained):
        if not train:  # context: the turn's text joins the context piece around it
            continue
        pieces += [full[pos:start], full[start:end]]
        pos = end
    pieces.append(full[pos:])
    encoded = tok(pieces, add_special_tokens=False)["input_ids"]
    expected = tok(full, add_special_tokens=False)["input_ids"]
    if [t for ids in encoded for t in ids] != expected:
        raise RenderError(
            "tokenizing the context/target pieces separately differs from tokenizing the full render "
            "(a token merges across a turn boundary); refusing to guess the mask"
        )

    append = probe.stop is None
    if append and tok.eos_token_id is None:
        raise RenderError("chat template emits no end-of-turn token and the tokenizer has no eos token")
    input_ids: list[int] = []
    loss_mask: list[bool] = []
    for n, ids in enumerate(encoded):
        target = n % 2 == 1
        if append and target:
            ids = ids + [tok.eos_token_id]
        input_ids += ids
        loss_mask += [target] * len(ids)
    return RenderedChat(input_ids=input_ids, loss_mask=loss_mask, appended_stop=append and any(trained))
