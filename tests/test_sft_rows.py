"""Rows that used to train on the wrong tokens or end a run with a traceback: content given as a
list of parts, and chat templates that raise something other than a jinja TemplateError."""

import pytest
from transformers import AutoTokenizer

from lit_rl.data.datamodules import StaticDataModule
from lit_rl.data.render import RenderError, render_messages
from helpers import TINY_MODEL, reverse_rows, write_jsonl


def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


def trained_text(tok, rendered):
    return tok.decode([t for t, m in zip(rendered.input_ids, rendered.loss_mask) if m])


def test_text_parts_render_as_the_joined_string_and_other_parts_are_refused(tmp_path):
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    as_parts = [{"role": "user", "content": parts("what is", "2+2")}, {"role": "assistant", "content": parts("4", "!")}]
    as_text = [{"role": "user", "content": "what is\n2+2"}, {"role": "assistant", "content": "4\n!"}]
    got, want = render_messages(tok, as_parts), render_messages(tok, as_text)
    assert (got.input_ids, got.loss_mask) == (want.input_ids, want.loss_mask)  # joined with "\n", as vLLM does
    assert trained_text(tok, got) == "4\n!<|im_end|>"
    # a non-text part is one error naming the row, the column, the message and the part's type
    image = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x.png"}}]
    rows = reverse_rows(3) + [{"messages": [{"role": "user", "content": image}, {"role": "assistant", "content": "a cat"}]}]
    dm = StaticDataModule(write_jsonl(tmp_path / "img.jsonl", rows), tokenizer=TINY_MODEL, batch_size=4,
                          shuffle=False, num_workers=0)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"row 3, column 'messages': message 0 \(user\): content part 1 is a 'image_url' part"):
        next(iter(dm.train_dataloader()))


RAISING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content + m.get('suffix', '') }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_raising_a_type_error_is_a_bad_row(tmp_path):
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.chat_template = RAISING_TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    rows = reverse_rows(4)
    rows[2]["messages"][0]["suffix"] = 5  # str + int: the template raises TypeError on this row only
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(RenderError, match="chat template failed: TypeError"):
        render_messages(tok, rows[2]["messages"])
    kw = {"tokenizer": str(tmp_path / "tok"), "batch_size": 4, "shuffle": False, "num_workers": 0}
    dm = StaticDataModule(path, **kw)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"row 2: chat template failed: TypeError: .*bad_rows: skip"):
        next(iter(dm.train_dataloader()))
    dm = StaticDataModule(path, bad_rows="skip", **kw)
    dm.setup("fit")
    stats = next(iter(dm.train_dataloader()))["stats"]
    assert stats["skipped_rows"] == 1 and stats["rows"] == 3


def test_a_chat_that_opens_with_the_assistant_trains_every_assistant_turn():
    """A greeting before the user's first message: the check of each turn's start rendered the
    messages before it, none here, which templates refuse ("Cannot apply chat template to an empty
    conversation"), so the row was refused."""
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    chat = [{"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}]
    rendered = render_messages(tok, chat)
    assert rendered.input_ids == tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert trained_text(tok, rendered) == "Hi, how can I help?<|im_end|>a<|im_end|>"
