"""Exact loss masks from render_messages across chat templates (ChatML/Qwen3, Llama-3, generation
markers, no stop token, rewriting templates), plus thread safety."""

import copy
import json
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import lit_rl.data.render as render_mod
from lit_rl.data.render import RenderError, render_messages
from lit_rl.data.tools import normalize_messages

TINY = Path(__file__).resolve().parents[1] / "lit_rl" / "assets" / "tiny_qwen3"


@pytest.fixture(scope="module")
def base_tok():
    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture
def tok(base_tok):
    return copy.deepcopy(base_tok)


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    monkeypatch.setattr(render_mod, "_probes", {})


def segments(tok, r):
    """Merge runs of equal mask into (is_target, decoded text) pairs."""
    assert len(r.input_ids) == len(r.loss_mask)
    out = []
    for tid, m in zip(r.input_ids, r.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(tid)
        else:
            out.append((m, [tid]))
    return [(m, tok.decode(ids)) for m, ids in out]


def targets(tok, r):
    return [text for m, text in segments(tok, r) if m]


def full_ids(tok, messages, tools=None, **kw):
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c, **kw: {"role": "assistant", "content": c, **kw}  # noqa: E731


def test_chatml_single_turn_exact(tok):
    msgs = [U("hello world"), A("dlrow olleh")]
    r = render_messages(tok, msgs)
    assert segments(tok, r) == [
        (False, "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"),
        (True, "dlrow olleh<|im_end|>"),
        (False, "\n"),
    ]
    assert r.input_ids == full_ids(tok, msgs)
    assert not r.appended_stop


def test_multi_turn_every_assistant_trained(tok):
    msgs = [{"role": "system", "content": "sys"}, U("a"), A("b"), U("c"), A("d")]
    r = render_messages(tok, msgs)
    assert segments(tok, r) == [
        (False, "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"),
        (True, "b<|im_end|>"),
        (False, "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"),
        (True, "d<|im_end|>"),
        (False, "\n"),
    ]
    assert r.input_ids == full_ids(tok, msgs)


def test_trailing_user_is_context_and_no_assistant_means_no_target(tok):
    assert targets(tok, render_messages(tok, [U("a"), A("b"), U("c")])) == ["b<|im_end|>"]
    assert not any(render_messages(tok, [U("a")]).loss_mask)


def test_header_text_inside_user_content_uses_prefix_renders(tok):
    # The header occurs once more than there are assistant turns: starts come from prefix renders.
    msgs = [U("say <|im_start|>assistant\n"), A("ok"), U("again"), A("fine")]
    r = render_messages(tok, msgs)
    assert targets(tok, r) == ["ok<|im_end|>", "fine<|im_end|>"]
    assert r.input_ids == full_ids(tok, msgs)


def test_the_end_of_turn_text_inside_an_assistant_turn_is_refused_naming_the_field(tok):
    """An assistant turn whose own text holds `<|im_end|>` (its content, a tool call's arguments): the
    tokenizer makes it the end-of-turn token, and the turn ended there, the rest of it and its real
    end trained as context, without a word. Now the row is refused, naming the message and field;
    the same text in a user turn is context and renders as before."""
    call = {"type": "function", "function": {"name": "f", "arguments": {"text": "split on <|im_end|> please"}}}
    for messages, field in (([U("hi"), A("the token <|im_end|> ends a turn")], "content"),
                            ([U("hi"), A("calling", tool_calls=[call])], "tool_calls[0].function.arguments")):
        with pytest.raises(RenderError, match=re.escape(f"assistant message 1 has the end-of-turn text '<|im_end|>' in its {field}:")):
            render_messages(tok, normalize_messages(messages))
    r = render_messages(tok, [U("what does <|im_end|> do?"), A("it ends a turn")])
    assert targets(tok, r) == ["it ends a turn<|im_end|>"]


def test_tools_calls_and_responses(tok):
    tools = [{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}]
    msgs = [
        U("weather?"),
        A(None, tool_calls=[{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]),
        {"role": "tool", "content": "sunny"},
        A("It is sunny."),
    ]
    r = render_messages(tok, msgs, tools)
    tool_json = (
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather", '
        '"parameters": {"type": "object"}}}'
    )
    assert segments(tok, r) == [
        (
            False,
            "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"<tools>\n{tool_json}\n</tools>\n\nFor each function call, return a json object inside "
            "<tool_call></tool_call> tags.<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n",
        ),
        (True, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'),
        (False, "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        (True, "It is sunny.<|im_end|>"),
        (False, "\n"),
    ]
    wire = [dict(m) for m in msgs]
    fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    wire[1] = {**wire[1], "tool_calls": [{"id": "call_0", "type": "function", "function": fn}]}
    wire[1].pop("content")
    assert r.input_ids == full_ids(tok, wire, [{"type": "function", "function": tools[0]}])


def test_last_turn_thinking_is_target_earlier_reasoning_dropped(tok):
    msgs = [U("q1"), A("<think>\nr1\n</think>\n\na1"), U("q2"), A("a2", reasoning_content="r2")]
    r = render_messages(tok, msgs)
    assert targets(tok, r) == ["a1<|im_end|>", "<think>\nr2\n</think>\n\na2<|im_end|>"]
    assert r.input_ids == full_ids(tok, msgs)
    # enable_thinking=False changes the generation prompt, not the in-chat header
    r2 = render_messages(tok, msgs, chat_template_kwargs={"enable_thinking": False})
    assert r2 == r


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3s_shipped_template_multi_turn_with_and_without_thinking(tok, thinking):
    """Qwen3's own template (TRL's copy) gives only the turns after the last user message an empty
    think block; with enable_thinking=False the generation prompt ends in that block too. Every
    turn must still be found, and the block the generation prompt supplies is context."""
    from importlib.resources import files

    tok.chat_template = (files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    kw = {"enable_thinking": thinking}
    call = {"name": "f", "arguments": {"x": 1}}
    msgs = [U("a"), A("b"), U("c"), A("", tool_calls=[call]), {"role": "tool", "content": "42"}, A("d")]
    r = render_messages(tok, msgs, chat_template_kwargs=kw)
    think = "<think>\n\n</think>\n\n"
    # thinking: the model emits the empty block; not thinking: the generation prompt supplies it
    given, emitted = ("", think) if thinking else (think, "")
    assert segments(tok, r) == [
        (False, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"),
        (True, "b<|im_end|>"),
        (False, "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"),
        (True, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>'),
        (False, "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n" + given),
        (True, emitted + "d<|im_end|>"),
        (False, "\n"),
    ]
    assert r.input_ids == full_ids(tok, normalize_messages(msgs), **kw)


def test_agentic_reasoning_where_prefix_renders_are_not_prefixes(tok):
    call = {"name": "search", "arguments": {"q": "x"}}
    msgs = [
        U("q1"),
        A("", reasoning_content="plan", tool_calls=[call]),
        {"role": "tool", "content": "found"},
        A("answer1", reasoning_content="use it"),
        U("q2"),
        A("answer2", reasoning_content="again"),
    ]
    tpl = lambda ms: tok.apply_chat_template(ms, tokenize=False)  # noqa: E731
    full = tpl(msgs)
    assert not full.startswith(tpl(msgs[:3]))  # the premise: prefix renders keep dropped reasoning
    r = render_messages(tok, msgs)
    assert segments(tok, r) == [
        (False, "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n"),
        (True, '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call><|im_end|>'),
        (False, "\n<|im_start|>user\n<tool_response>\nfound\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        (True, "answer1<|im_end|>"),
        (False, "\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n"),
        (True, "<think>\nagain\n</think>\n\nanswer2<|im_end|>"),
        (False, "\n"),
    ]
    assert r.input_ids == tok(full, add_special_tokens=False)["input_ids"]


LLAMA3 = (
    "{{- '<|begin_of_text|>' }}{% for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_llama3_style_template(tok):
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.chat_template = LLAMA3
    msgs = [{"role": "system", "content": "s"}, U("hi"), A("dlrow olleh"), U("more"), A("ok")]
    r = render_messages(tok, msgs)
    assert segments(tok, r) == [
        (
            False,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\ns<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (True, "dlrow olleh<|eot_id|>"),
        (
            False,
            "<|start_header_id|>user<|end_header_id|>\n\nmore<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (True, "ok<|eot_id|>"),
    ]
    assert r.input_ids == full_ids(tok, msgs)


def _chatml_generation(inside_end: bool) -> str:
    body = "m.content + '<|im_end|>'" if inside_end else "m.content"
    after = "'\\n'" if inside_end else "'<|im_end|>\\n'"
    return (
        "{% for m in messages %}{% if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        "{% generation %}{{- " + body + " }}{% endgeneration %}{{- " + after + " }}"
        "{% else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"
    )


@pytest.mark.parametrize("inside_end", [True, False])
def test_generation_markers_agree(tok, inside_end):
    tok.chat_template = _chatml_generation(inside_end)
    msgs = [U("a"), A("bb"), U("c"), A("dd")]
    r = render_messages(tok, msgs)
    hf = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert r.input_ids == list(hf["input_ids"])
    expected = [bool(x) for x in hf["assistant_masks"]]
    if not inside_end:  # HF's span stops before <|im_end|>; the stop token must still be trained
        ends = [i for i in range(1, len(expected)) if expected[i - 1] and not expected[i]]
        assert [r.input_ids[i] for i in ends] == [tok.convert_tokens_to_ids("<|im_end|>")] * 2
        for i in ends:
            expected[i] = True
    assert r.loss_mask == expected
    assert targets(tok, r) == ["bb<|im_end|>", "dd<|im_end|>"]


NO_STOP = (
    "{% for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{- 'assistant: ' }}{% endif %}"
)


def test_template_without_stop_token_appends_eos(tok):
    tok.chat_template = NO_STOP
    msgs = [U("hey"), A("hi"), U("more"), A("bye")]
    with pytest.warns(UserWarning, match="appending eos"):
        r = render_messages(tok, msgs)
    assert r.appended_stop
    assert segments(tok, r) == [
        (False, "user: hey\nassistant: "),
        (True, "hi<|im_end|>"),
        (False, "\nuser: more\nassistant: "),
        (True, "bye<|im_end|>"),
        (False, "\n"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per template, not per chat
        assert render_messages(tok, msgs) == r


def test_merge_across_boundary_raises():
    data = json.loads((TINY / "tokenizer.json").read_text())
    data["model"]["vocab"]["Ġh"] = 300
    data["model"]["merges"] = [["Ġ", "h"]]  # " h" becomes one token, straddling "assistant: " | "hi"
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token="<|im_end|>")
    tok.chat_template = (
        "{% for m in messages %}{{- m.role + ': ' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{- 'assistant: ' }}{% endif %}"
    )
    assert targets(tok, render_messages(tok, [U("yo"), A("ok")])) == ["ok<|im_end|>"]
    with pytest.raises(RenderError, match="merges across"):
        render_messages(tok, [U("yo"), A("hi")])


def test_rewriting_template_without_header_raises(tok):
    # No header; earlier assistant turns are uppercased only once later turns exist.
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}{{- m.content | upper }}"
        "{% else %}{{- m.content }}{% endif %}{{- '\\n' }}{% endfor %}"
    )
    with pytest.warns(UserWarning), pytest.raises(RenderError, match="attribution is impossible"):
        render_messages(tok, [U("a"), A("b"), U("c"), A("d")])


def test_rewriting_template_with_stop_but_no_header_raises(tok):
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and messages | length > 3 %}{{- '[summary]' }}"
        "{% else %}{{- m.content }}{% endif %}{{- '<|im_end|>\\n' }}{% endfor %}"
    )
    with pytest.raises(RenderError, match="attribution is impossible"):
        render_messages(tok, [U("a"), A("b"), U("c"), A("d")])


def test_rejects_reserved_kwargs_and_bad_messages(tok):
    with pytest.raises(ValueError, match="add_generation_prompt"):
        render_messages(tok, [U("a"), A("b")], chat_template_kwargs={"add_generation_prompt": True})
    with pytest.raises(ValueError, match="message 1"):
        render_messages(tok, [U("a"), {"content": "b"}])


def test_thread_safety_matches_single_thread(base_tok):
    tok = copy.deepcopy(base_tok)  # a tokenizer no thread has copied yet
    chats = [
        [U("hello " * k), A("world " * k), U("again"), A(f"<think>\nr{k}\n</think>\n\nok")] for k in range(1, 7)
    ]
    expected = [render_messages(tok, c) for c in chats]

    def job(i):
        if i % 4 == 3:  # other code using the shared tokenizer with its own truncation settings
            return i, tok("x" * 50, truncation=True, max_length=5 + i % 7)["input_ids"]
        return i, render_messages(tok, chats[i % len(chats)])

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(job, range(800)))
    assert all(r == expected[i % len(chats)] for i, r in results if i % 4 != 3)
