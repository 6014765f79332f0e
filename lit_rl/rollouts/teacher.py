"""What a teacher must share with the student for its token scores to mean anything.

A teacher scores the student's sampled token ids as they are, so both must read the same ids
as the same text: the same vocabulary, special tokens included, and the same chat template
(else the prompt the teacher conditions on is not the one it was trained to answer).
"""

from __future__ import annotations

from typing import Any


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """None when the two tokenizers agree on every id and the chat template; otherwise what
    differs, as the end of a sentence ("has another vocabulary: ...")."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours != theirs:
        differ = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
        return (f"has another vocabulary than the policy ({len(theirs)} tokens vs {len(ours)}; {len(differ)} differ, "
                f"e.g. {differ[:5]}): a teacher must share the student's tokenizer")
    if getattr(student, "chat_template", None) != getattr(teacher, "chat_template", None):
        return "has another chat template than the policy: a teacher must share the student's tokenizer and template"
    return None
