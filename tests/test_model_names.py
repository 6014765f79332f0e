"""Built-in model names (`lit-rl:tiny_qwen3`) resolve from any directory, at every place a name is loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_rl.errors import UserError
from lit_rl.model_names import ASSETS, builtin_models, resolve_model_name

TINY = "lit-rl:tiny_qwen3"


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """Every test runs outside the repository, where `lit_rl/assets/...` is no relative path."""
    monkeypatch.chdir(tmp_path)


def test_builtin_name_is_the_installed_packages_directory():
    path = Path(resolve_model_name(TINY))
    assert path == ASSETS / "tiny_qwen3" and (path / "config.json").is_file()
    assert TINY in builtin_models()


def test_other_names_are_left_alone(tmp_path):
    assert resolve_model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert resolve_model_name(str(tmp_path)) == str(tmp_path)


def test_old_relative_path_still_works_from_anywhere(tmp_path):
    assert resolve_model_name("lit_rl/assets/tiny_qwen3") == str(ASSETS / "tiny_qwen3")
    (tmp_path / "lit_rl" / "assets" / "tiny_qwen3").mkdir(parents=True)  # but a user's own copy there wins
    assert resolve_model_name("lit_rl/assets/tiny_qwen3") == "lit_rl/assets/tiny_qwen3"


def test_unknown_builtin_name_says_which_exist():
    with pytest.raises(UserError, match=r"unknown built-in model 'lit-rl:nope'.*lit-rl:tiny_qwen3"):
        resolve_model_name("lit-rl:nope")


def test_every_loading_place_takes_the_builtin_name():
    from lit_rl.callbacks.export import HFExport
    from lit_rl.data.steps import RowRenderer
    from lit_rl.inference.client import InferenceClient
    from lit_rl.inference.server import VLLMServer
    from lit_rl.modules import SFT
    from lit_rl.modules.model_loading import load_causal_lm

    assert load_causal_lm(TINY, random_init=True).config.model_type == "qwen3"
    assert SFT().model_name == TINY  # the default, kept portable in saved configs
    renderer = RowRenderer(None, tokenizer=TINY, row_format="messages", columns={}, max_length=8)
    assert renderer.tokenizer.eos_token == "<|im_end|>"
    module = SimpleNamespace(tokenizer_name=TINY, trust_remote_code=False)
    assert HFExport()._tokenizer(module).eos_token == "<|im_end|>"
    assert VLLMServer(TINY).model == str(ASSETS / "tiny_qwen3")  # what vLLM is started with (not started here)
    client = InferenceClient("http://127.0.0.1:9/v1", tokenizer=TINY)
    assert asyncio.run(client.tokenizer()).eos_token == "<|im_end|>"


def test_a_name_that_cannot_be_loaded_is_a_user_error_naming_it():
    from lit_rl.model_names import load_tokenizer
    from lit_rl.modules.model_loading import load_causal_lm

    with pytest.raises(UserError, match=r"cannot load the model config 'no-such-org/x': it is not a local directory(.|\n)*fix:"):
        load_causal_lm("no-such-org/x", random_init=True)
    with pytest.raises(UserError, match=r"cannot load the tokenizer 'no-such-org/x'"):
        load_tokenizer("no-such-org/x")
