"""The environment variables through which lit-rl's server processes are set up (vllm_main.py).

Apart from vllm_main.py because that module is run with `python -m`: the package's own import
(server.py, cpu_engine.py) would otherwise have imported it first, and Python then runs it a second
time as `__main__`, warning so at the top of every server log (runpy's RuntimeWarning)."""

SPIN_ENV = "LIT_RL_VLLM_SPIN_S"
FORK_ENV = "LIT_RL_VLLM_FORK_ENGINE"
START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"
FORKED = "lit-rl: vLLM's engine core starts by fork (its executor is the single-process one)"
LAUNCHER_ENV = "LIT_RL_VLLM_LAUNCHER"  # the socket of a vLLM launcher (launcher.py), when servers are forked by one
