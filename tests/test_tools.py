"""Normalisation of tool calls, tool definitions and messages to the OpenAI wire shape."""

import json

import pytest

from lit_rl.data.tools import normalize_messages, normalize_tool_calls, normalize_tools

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
FN = {"name": "get_weather", "description": "Weather", "parameters": PARAMS}


def test_tool_calls_nested_flattened_and_ids():
    calls = [
        {"id": "abc", "type": "function", "function": {"name": "f", "arguments": {"city": "Zürich"}}},
        {"name": "g", "arguments": '{"x": 1}', "id": None},  # flattened, Arrow-padded id
        {"function": {"name": "h"}, "id": ""},
    ]
    assert normalize_tool_calls(calls) == [
        {"id": "abc", "type": "function", "function": {"name": "f", "arguments": '{"city": "Zürich"}'}},
        {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "h", "arguments": "{}"}},
    ]


def test_tool_call_string_arguments_kept_verbatim_and_none_keys_dropped():
    out = normalize_tool_calls([{"function": {"name": "f", "arguments": "not json {"}}])
    assert out[0]["function"]["arguments"] == "not json {"
    # Arrow struct padding: absent argument keys arrive as None
    out = normalize_tool_calls([{"function": {"name": "f", "arguments": {"city": "Paris", "unit": None}}}])
    assert json.loads(out[0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize(
    "bad, match",
    [
        ([{"function": {"arguments": "{}"}}], "missing function name"),
        ([{"arguments": "{}"}], "missing function name"),
        (["f"], "expected a dict"),
        ([{"type": "code", "name": "f"}], "unsupported type"),
        ([{"name": "f", "arguments": 3}], "arguments must be"),
    ],
)
def test_bad_tool_calls(bad, match):
    with pytest.raises(ValueError, match=match):
        normalize_tool_calls(bad)


def test_tools_shapes():
    wrapped = [{"type": "function", "function": FN}]
    assert normalize_tools(wrapped) == wrapped
    assert normalize_tools([FN]) == wrapped
    assert normalize_tools([json.dumps(FN)]) == wrapped
    assert normalize_tools(json.dumps([FN])) == wrapped  # tool_defs-style JSON text
    assert normalize_tools(json.dumps(wrapped[0])) == wrapped
    assert normalize_tools(None) is None
    assert normalize_tools([]) is None
    assert normalize_tools("  ") is None


def test_tools_drop_none_recursively_keep_parameters():
    padded_fn = {**FN, "strict": None, "parameters": {**PARAMS, "required": None}}
    padded = {"type": "function", "function": padded_fn}
    assert normalize_tools([padded]) == [{"type": "function", "function": FN}]


@pytest.mark.parametrize(
    "bad, match", [([{"description": "x"}], "missing function name"), ("{oops", "not valid JSON"), (3, "must be a list")]
)
def test_bad_tools(bad, match):
    with pytest.raises(ValueError, match=match):
        normalize_tools(bad)


def test_messages_normalised():
    msgs = [
        {"role": "system", "content": None, "tool_calls": None},
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2", "tool_call_id": None},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {}}]},
        {"role": "tool", "content": None},
        {"role": "assistant", "content": "done"},
    ]
    out = normalize_messages(msgs)
    assert out[0] == {"role": "system", "content": ""}
    assert out[1] == {"role": "user", "content": "hi"}
    assert "content" not in out[2]
    assert [c["id"] for c in out[2]["tool_calls"]] == ["call_0", "call_1"]
    assert out[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert [out[3]["tool_call_id"], out[4]["tool_call_id"]] == ["call_0", "call_1"]
    assert out[5]["tool_calls"][0]["id"] == "call_2"  # ids unique across the chat
    assert out[6] == {"role": "tool", "content": "", "tool_call_id": "call_2"}
    assert msgs[0]["tool_calls"] is None  # input not mutated


@pytest.mark.parametrize(
    "bad, match",
    [
        ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1 has no 'role'"),
        ([{"role": "developer", "content": "a"}], "message 0 has unsupported role 'developer'"),
        ([{"role": "user", "content": 5}], "message 0 .*content"),
        ([{"role": "user", "content": "a", "tool_calls": [{"name": "f"}]}], "only assistant"),
        (["hi"], "message 0: expected a dict"),
        ([], "empty"),
        ({"role": "user"}, "must be a list"),
    ],
)
def test_bad_messages(bad, match):
    with pytest.raises(ValueError, match=match):
        normalize_messages(bad)


def test_an_empty_tool_calls_list_on_any_message_is_dropped():
    """Exports that write `"tool_calls": []` (or null) on every message: the user's and the tool's are
    read as having none (they were refused, "only assistant messages may have tool_calls", so every
    row of such a file was), and a non-empty list there is still refused."""
    out = normalize_messages([{"role": "user", "content": "hi", "tool_calls": []},
                              {"role": "assistant", "content": "a", "tool_calls": []},
                              {"role": "user", "content": "more", "tool_calls": None}])
    assert out == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "more"}]
