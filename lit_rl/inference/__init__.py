"""Inference for rollouts, teacher scoring and evals: a vLLM server in its own process and an async client.

    server.py   VLLMServer (start / health / stop of vLLM's OpenAI server, through vllm_main.py),
                open_endpoint (start one, or use an existing base_url)
    client.py   InferenceClient (generate / chat / score / reload_weights over the OpenAI API)
    gpus.py     plan_gpus (split one node's GPUs between training and the server)
"""

from lit_rl.inference.client import (
    Completion,
    InferenceClient,
    InferenceRequestError,
    InferenceServerError,
    ReloadRefused,
    chat_prompt_ids,
)
from lit_rl.inference.gpus import GPUPlan, plan_gpus, visible_gpus
from lit_rl.inference.server import Endpoint, ServerStartError, VLLMServer, open_endpoint

__all__ = [
    "Completion", "Endpoint", "GPUPlan", "InferenceClient", "InferenceRequestError", "InferenceServerError",
    "ReloadRefused", "ServerStartError", "VLLMServer", "chat_prompt_ids", "open_endpoint", "plan_gpus", "visible_gpus",
]
