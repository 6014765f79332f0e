"""Built-in reward functions for `DatasetEnv`, in TRL's signature (`fn(prompts, completions, **columns)`).

    rewards:
      - {function: lit_rl.rewards.math_verify, kwargs: {answer_column: answer}}
      - {function: lit_rl.rewards.regex_match, weight: 0.1, name: format, kwargs: {pattern: '\\\\boxed\\{'}}

Each names the columns it reads (`required_columns`), so a missing column is an error when the
environment loads its rows. `math_verify` needs the optional `math-verify` package (`lit-rl[envs]`).
"""

from lit_rl.rewards.math_answers import math_verify
from lit_rl.rewards.text import exact_match, length_penalty, normalize_answer, regex_match

__all__ = ["exact_match", "length_penalty", "math_verify", "normalize_answer", "regex_match"]
