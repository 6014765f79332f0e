"""`lit-rl serve`: the vLLM server lit-rl would start, in the foreground, for a server you manage.

    lit-rl serve --model runs/x/weights/step_0 --port 8000 --max-model-len 4096
    lit-rl serve --model Qwen/Qwen3-0.6B --tensor-parallel-size 2 -- --enable-lora   # after --: to vLLM

Then give `base_url: http://127.0.0.1:8000/v1` to any lit-rl config that takes a server; lit-rl
starts nothing and reloads weights into this one (dev mode is on unless --no-dev-mode). Options
lit-rl does not know are passed to vLLM as they are. Ctrl-C or SIGTERM stops the server and its
whole process group. The API key can come from $VLLM_API_KEY instead of the command line.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Iterable

from lit_rl.errors import UserError
from lit_rl.model_names import local_model_problem
from lit_rl.server_options import loads_weights


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="lit-rl serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (e.g. <root>/weights/step_0) or hub name")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others are warned about)")
    p.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="Bearer key for /v1/* (default $VLLM_API_KEY)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="fraction of each GPU for vLLM")
    p.add_argument("--devices", default=None, help="GPU ids for the server, comma separated (its CUDA_VISIBLE_DEVICES)")
    p.add_argument("--num-infer-gpus", type=int, default=None,
                   help="serve on the last N visible GPUs, leaving the others to training; GPUs beyond "
                        "--tensor-parallel-size become data-parallel ranks")
    p.add_argument("--enforce-eager", action="store_true", help="no compilation: faster start, slower decoding")
    p.add_argument("--generation-config", default="vllm", help="'vllm' (requests say all) or 'auto' (model defaults)")
    p.add_argument("--no-dev-mode", action="store_true", help="no /collective_rpc: weights cannot be reloaded")
    p.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    args, rest = p.parse_known_args(argv)
    return args, [a for a in rest if a != "--"]


def flag_names(message: str, options: Iterable[str]) -> str:
    """A refusal of VLLMServer's (or plan_gpus's) with the flags of this command in it: each flag is
    the name of the parameter it sets, with dashes (`tensor_parallel_size` -> `--tensor-parallel-size`),
    and `extra_args` are the options this command passes on to vLLM."""
    names = "|".join(sorted(options, key=len, reverse=True))
    # a whole word only: not the `log` of "log-probabilities" nor the `generation_config` of "generation_config.json"
    message = re.sub(rf"(?<![-\w.])({names})(?![-.\w])", lambda m: "--" + m[1].replace("_", "-"), message)
    return message.replace("extra_args", "the options passed on to vLLM")


def vllm_server(args: argparse.Namespace, extra: list[str]):
    """The VLLMServer the flags describe (not started)."""
    from lit_rl.inference.server import VLLMServer

    if args.num_infer_gpus is not None:
        from lit_rl.inference.gpus import plan_gpus, visible_gpus

        if args.devices or args.data_parallel_size != 1:
            raise SystemExit("lit-rl serve: --num-infer-gpus chooses --devices and --data-parallel-size; give neither")
        plan = plan_gpus(visible_gpus(), args.num_infer_gpus, args.tensor_parallel_size)
        args.devices, args.data_parallel_size = ",".join(plan.infer_devices), plan.data_parallel_size
        print(f"lit-rl serve: GPUs {args.devices} serve (tp {plan.tensor_parallel_size} x dp {plan.data_parallel_size}); "
              f"train on devices {plan.train_devices}", flush=True)
    return VLLMServer(
        args.model, host=args.host, port=args.port, api_key=args.api_key, max_model_len=args.max_model_len,
        dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        devices=args.devices.split(",") if args.devices else None, generation_config=args.generation_config,
        dev_mode=not args.no_dev_mode, extra_args=extra, log_path=args.log, startup_timeout=args.startup_timeout,
    )


def main(argv: list[str] | None = None) -> None:
    from lit_rl.inference.server import ServerStartError

    args, extra = parse(sys.argv[1:] if argv is None else argv)
    problems, server = [], None
    try:
        server = vllm_server(args, extra)
    except ValueError as e:  # a value it refuses, said with the flag that gave it
        problems.append(flag_names(str(e).removeprefix("VLLMServer: "), vars(args)))
    if problem := local_model_problem(args.model, weights=loads_weights(extra)):
        problems.append(f"--model {args.model}{problem}")
    if problems:  # every one at once, before anything starts
        raise UserError("; ".join(problems))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if started with SIGINT ignored
    print(f"lit-rl serve: starting vLLM for {args.model} (log: {server.log_path or 'a temporary file'}) ...", flush=True)
    # One try from the start: a Ctrl-C at any moment (while starting, while the ready line is being
    # written) is a clean stop with exit 130, never a traceback.
    try:
        try:
            server.start()
        except ServerStartError as e:
            print(f"lit-rl serve: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        print(f"lit-rl serve: ready after {server.startup_seconds:.0f} s at base_url {server.base_url} "
              f"(log: {server.log_path}); Ctrl-C stops it", flush=True)
        while server.alive():
            time.sleep(1.0)
        print(f"lit-rl serve: {server.diagnose()}", file=sys.stderr)
        raise SystemExit(1)
    except KeyboardInterrupt:
        print("lit-rl serve: stopping", flush=True)
        raise SystemExit(130) from None
    finally:
        server.stop()
