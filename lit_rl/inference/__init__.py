"""Inference for rollouts, teacher scoring and evals: a vLLM server in its own process and an async client.

    server.py   VLLMServer (start / health / stop of vLLM's OpenAI server, through vllm_main.py)
    server_env.py  the variables that set up vllm_main.py's process (apart: it runs as __main__)
    cpu_engine.py  on a CPU build, the worker in the engine core's process (one interpreter fewer)
    endpoint.py open_endpoint (start one, or use an existing base_url)
    worker_extension.py  WorkerExtension (runs inside vLLM's workers: reloads that repair a tied head)
    client.py   InferenceClient (generate / chat / score / reload_weights over the OpenAI API)
    gpus.py     plan_gpus (split one node's GPUs between training and the server)
    runtime.py  InferenceRuntime (the one owner of a training run's servers: start, weight sync, stop)
    restarts.py ServerRestarts (the runtime's: restarts a server it started that died or hangs)
"""

from lit_rl.inference.client import (
    Completion,
    ContextLengthError,
    InferenceClient,
    InferenceRequestError,
    InferenceServerError,
    ReloadRefused,
    chat_prompt_ids,
)
from lit_rl.inference.gpus import GPUPlan, plan_gpus, visible_gpus
from lit_rl.inference.endpoint import Endpoint, open_endpoint
from lit_rl.inference.server import ServerStartError, VLLMServer

__all__ = [
    "Completion", "ContextLengthError", "Endpoint", "GPUPlan", "InferenceClient", "InferenceRuntime", "InferenceRequestError", "InferenceServerError",
    "ReloadRefused", "ServerStartError", "VLLMServer", "chat_prompt_ids", "open_endpoint", "plan_gpus", "visible_gpus",
]


def __getattr__(name: str):
    # Lazily: the runtime imports Lightning, and vLLM's own processes import this package (the
    # server's entry point and worker extension live here) without needing it.
    if name == "InferenceRuntime":
        from lit_rl.inference.runtime import InferenceRuntime

        return InferenceRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
