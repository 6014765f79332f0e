"""The checks of the options of a server lit-rl starts that need no server: what `extra_args` may say."""

from __future__ import annotations

import pytest

from lit_rl.inference.server import VLLMServer
from lit_rl.server_options import server_option_problems


@pytest.mark.parametrize("extra, flag, fix", [
    (["--host", "0.0.0.0"], "--host", "use the host option instead"),
    (["--port=8123"], "--port (as '--port=8123')", "use the port option instead"),
    (["--max-num-seqs", "4", "--api_key", "k"], "--api-key (as '--api_key')", "use the api_key option instead"),
    (["--hos", "0.0.0.0"], "--host (as '--hos')", "use the host option instead"),  # argparse's unique prefix
    (["--model", "other"], "--model", "use the model option instead"),
    (["-tp", "2"], "-tp", "use the tensor_parallel_size option instead"),
    (["--worker-extension-cls", "my.Ext"], "--worker-extension-cls", "lit-rl's worker extension"),
    (["--logprobs-mode", "raw_logprobs"], "--logprobs-mode", "always use processed_logprobs"),
])
def test_extra_args_may_not_set_a_flag_the_server_passes_itself(extra, flag, fix):
    """vLLM takes the last copy of a flag, and extra_args come last: before, `--host 0.0.0.0` there
    bound every interface without the non-loopback warning, `--port` left lit-rl polling its own
    port for the whole startup_timeout, `--api-key` put the key on the process list."""
    with pytest.raises(ValueError, match="extra_args must not set") as err:
        VLLMServer("m", extra_args=extra)
    assert f"extra_args must not set {flag}: lit-rl passes it to vLLM itself" in str(err.value), err.value
    assert fix in str(err.value), err.value
    # a training config's server options, checked before anything starts
    [problem] = server_option_problems({"extra_args": extra}, where="inference.server.")
    assert problem.startswith(f"inference.server.extra_args must not set {flag}"), problem


def test_other_vllm_arguments_pass_through():
    for extra in (["--max-num-seqs", "4", "--seed=1"], ["--data-parallel-size-local", "1"], ["--model-impl", "vllm"],
                  ["--distributed-executor-backend", "mp", "--enable-lora", "--max-loras", "1"], ["--served-model-name", "x"]):
        assert VLLMServer("m", port=9, extra_args=extra).command()[-len(extra):] == extra
        assert server_option_problems({"extra_args": extra}, where="inference.server.") == []


def test_a_worker_extension_of_ones_own_is_allowed_when_lit_rl_passes_none():
    """With dev_mode off (no weight reloads) lit-rl passes no --worker-extension-cls, so a user's own
    in extra_args overrides nothing: it reaches vLLM once. Before, it was refused as lit-rl's flag."""
    extra = ["--worker-extension-cls", "my.Ext"]
    cmd = VLLMServer("m", port=9, dev_mode=False, extra_args=extra).command()
    assert cmd[-2:] == extra and cmd.count("--worker-extension-cls") == 1, cmd
    assert server_option_problems({"dev_mode": False, "extra_args": extra}, where="inference.server.") == []
