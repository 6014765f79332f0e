"""Shared fixtures: the built-in tiny model, its tokenizer, a seeded random-init model."""

from __future__ import annotations

import pytest
from helpers import TINY_MODEL

@pytest.fixture
def tiny_model_path() -> str:
    return TINY_MODEL


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture
def tiny_model():
    from lit_rl.modules.model_loading import load_causal_lm

    return load_causal_lm(TINY_MODEL, random_init=True, seed=0)
from vllm_fixtures import *  # noqa: F401,F403
