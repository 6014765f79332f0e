"""A custom eval by subclassing: score the checkpoint directory with your own code.

`HeldOutLoss` overrides one method, `evaluate`, and gets the exported checkpoint of
the step being evaluated. It never touches processes, ranks or weight reloads: the
evaluator calls it once per due step, after its server serves that step.

    - class_path: examples.reverse_text.held_out_loss.HeldOutLoss
      init_args: {path: examples/reverse_text/data/test.jsonl, num_examples: 50}

Logged as `eval/held_out_loss/loss` and `eval/held_out_loss/policy_version`.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_rl.data import render_messages
from lit_rl.data.sources import open_split
from lit_rl.losses import masked_cross_entropy_sum
from lit_rl.rollouts.envs import Environment, EvalRun


class HeldOutLoss(Environment):
    """Cross-entropy per trained token of held-out chats, computed from the checkpoint files."""

    default_name = "held_out_loss"

    def __init__(self, path: str = "examples/reverse_text/data/test.jsonl", **kwargs):
        super().__init__(**kwargs)
        self.path = path

    def load_tasks(self) -> list[dict]:
        return [{"messages": row["messages"]} for row in open_split(self.path)]

    async def evaluate(self, run: EvalRun) -> dict[str, float]:
        tokenizer = AutoTokenizer.from_pretrained(run.step_dir)
        model = AutoModelForCausalLM.from_pretrained(run.step_dir).eval()
        total, tokens = 0.0, 0
        with torch.no_grad():
            for task in self.tasks():
                chat = render_messages(tokenizer, task["messages"], chat_template_kwargs=run.chat_template_kwargs)
                ids = torch.tensor([chat.input_ids])
                mask = torch.tensor([chat.loss_mask])
                total += masked_cross_entropy_sum(model(input_ids=ids, use_cache=False).logits, ids, mask).item()
                tokens += int(mask[:, 1:].sum())
        return {"loss": total / max(tokens, 1)}
