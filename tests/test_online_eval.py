"""Online evals with a real vLLM server: the demo learns and the evals show it, a vanished
checkpoint is skipped without hurting training, a trainer crash takes the evaluator and
its server down, and the plan's bookkeeping (due steps, done log) by hand."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lit_rl.eval.logging import read_eval_metrics
from lit_rl.eval.plan import DoneLog, EvalPlan
from helpers import REPO
from online_eval_helpers import evaluator_processes
from test_cli import run
from wandb_records import history, records, run_id

EXAMPLE = REPO / "examples" / "reverse_text" / "sft_online_eval.yaml"


def test_plan_due_steps():
    plan = EvalPlan(envs=[], interval=50, intervals={"b": 20}, eval_base=True)
    assert plan.due(0, ["a", "b"], None) == ["a", "b"]
    assert plan.due(40, ["a", "b"], None) == ["b"]
    assert plan.due(50, ["a", "b"], None) == ["a"]
    assert plan.due(51, ["a", "b"], 51) == ["a", "b"]  # the final step runs every eval
    assert plan.due(7, ["a", "b"], None) == []
    assert EvalPlan(envs=[], eval_base=False).due(0, ["a"], None) == []


def test_evaluator_can_be_pinned_to_cores_training_leaves_free():
    """OnlineEval(cpus=...): the evaluator process (and the vLLM CPU server it starts, through
    VLLM_CPU_OMP_THREADS_BIND) keeps to the given cores; a core the machine lacks is refused."""
    from lit_rl.callbacks.online_eval import check_cpus, pinned_environment
    from lit_rl.child_process import dies_with_parent

    core = max(os.sched_getaffinity(0))
    cpus = check_cpus([core])
    probe = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['VLLM_CPU_OMP_THREADS_BIND'])"
    out = subprocess.run(dies_with_parent([sys.executable, "-c", probe], cpus), env={**os.environ, **pinned_environment(cpus)},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == [f"[{core}]", str(core)]
    with pytest.raises(ValueError, match="OnlineEval.cpus"):
        check_cpus([core + 1000])
    with pytest.raises(ValueError, match="OnlineEval.cpus"):
        check_cpus([])


def test_the_evaluator_beside_training_runs_torch_on_one_thread(monkeypatch):
    import torch

    from lit_rl.commands.evaluate import parse, share_cores_with_training

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        share_cores_with_training(parse(["--run-dir", "run"]))  # a finished run: nothing trains beside it
        assert torch.get_num_threads() == 2
        share_cores_with_training(parse(["--run-dir", "run", "--follow"]))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # set by the user, or by OnlineEval's `cpus`
        share_cores_with_training(parse(["--run-dir", "run", "--follow"]))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_an_evaluator_that_exits_is_started_again_until_no_restart_is_left(tmp_path, caplog):
    """The runtime's check after each step, on a real process that exits at once (code 3): it is
    started again (one restart of the run's), and with none left it is given up: a warning, and
    training goes on (an eval never stops training)."""
    from types import SimpleNamespace

    from lit_rl.inference.runtime import InferenceRuntime

    runtime = InferenceRuntime(max_server_restarts=1)
    trainer = SimpleNamespace(received_sigterm=False)
    log_path = tmp_path / "evals" / "evaluator.log"
    first = runtime.start_evaluator([sys.executable, "-c", "print('evaluating'); raise SystemExit(3)"], env=dict(os.environ),
                                    log_path=log_path)
    first_pid = first.pid
    assert first.wait(30) == 3
    with caplog.at_level("INFO"), pytest.warns(UserWarning) as warned:
        runtime._keep_evaluator(trainer)
        assert runtime.server_restarts == 1 and first.pid != first_pid and not first.given_up
        assert first.wait(30) == 3
        runtime._keep_evaluator(trainer)
        runtime._keep_evaluator(trainer)  # given up: once
    assert first.given_up and runtime.server_restarts == 1
    assert caplog.text.count("the evaluator exited (code 3); restarting it (restart 1 of at most 1)") == 1, caplog.text
    gave_up = [str(w.message) for w in warned if "without online evals" in str(w.message)]
    assert gave_up == [f"InferenceRuntime: the evaluator exited (code 3), and no restart is left (inference."
                       f"max_server_restarts=1, 1 used); training goes on without online evals (its log: {log_path})"], gave_up
    assert log_path.read_text().count("evaluating") == 2  # both runs appended to its log
    assert runtime.finish_evaluator(5) == 3 and runtime.evaluator is None


def test_an_eval_row_cut_short_is_never_read_and_the_next_one_is(tmp_path):
    """A row of eval_metrics.csv cut short (a full disk while it was appended; the evaluator goes on):
    the next row was appended onto it, read as one made-up row (0.7 and a lost step 20) or one that
    stopped `lit-rl report` (a name where the value goes). Now the next row starts its own line and the
    cut one is not read. A file left empty gets its header."""
    from lit_rl.eval.logging import EvalLogger

    for torn in ("10,eval/rt/reward,0.7", "10,eval/rt/rew"):
        root = tmp_path / torn.replace("/", "_")
        logger = EvalLogger(root)
        logger.log(0, {"eval/rt/reward": 0.25})
        with open(root / "eval_metrics.csv", "a") as f:
            f.write(torn)  # the write of step 10's row stopped there
        logger.log(20, {"eval/rt/reward": 0.5})
        assert read_eval_metrics(root) == [{"step": 0, "name": "eval/rt/reward", "value": 0.25},
                                           {"step": 20, "name": "eval/rt/reward", "value": 0.5}]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "eval_metrics.csv").write_text("")
    EvalLogger(empty).log(5, {"eval/rt/reward": 1.0})
    assert read_eval_metrics(empty) == [{"step": 5, "name": "eval/rt/reward", "value": 1.0}]


def test_done_log_survives_restart_and_forgets_the_future(tmp_path):
    log = DoneLog(tmp_path)
    log.record(0, "a", "ok")
    log.record(100, "a", "failed", error="x")
    log.record(200, "a", "skipped")
    again = DoneLog(tmp_path)
    assert again.handled(100, "a") and again.handled(200, "a")
    again.forget_after(100)  # a resume from step 100
    assert not DoneLog(tmp_path).handled(200, "a") and DoneLog(tmp_path).handled(100, "a")
    assert DoneLog(tmp_path).records[(100, "a")]["error"] == "x"  # the failure's error stays for the end-of-run warning
    # an evaluator killed while writing a line: that eval is due again, nothing else is lost, and nothing raises
    with open(again.path, "a") as f:
        f.write('{"step": 300, "env": "a", "sta')
    torn = DoneLog(tmp_path)
    assert torn.entries == {(0, "a"): "ok", (100, "a"): "failed"}
    torn.record(300, "a", "ok")
    assert DoneLog(tmp_path).entries == {(0, "a"): "ok", (100, "a"): "failed", (300, "a"): "ok"}


def test_the_evaluator_of_a_run_waits_for_its_first_checkpoint_as_long_as_the_trainer_lives(tmp_path):
    """Without eval_base the first checkpoint comes at the first eval interval, maybe hours in:
    OnlineEval's evaluator (--parent-pid) must not give up after --start-timeout, an exit that
    would be counted as a crash and restarted; standing alone, it still does."""
    import threading

    from lit_rl.commands.evaluate import first_checkpoint
    from vllm_fixtures import write_tiny_checkpoint

    def later():
        time.sleep(1.5)
        write_tiny_checkpoint(tmp_path / "weights" / "step_100", seed=0)

    threading.Thread(target=later, daemon=True).start()
    assert first_checkpoint(tmp_path, 0.2, os.getpid()) == tmp_path / "weights" / "step_100"
    with pytest.raises(SystemExit, match="no STABLE checkpoint appeared under .* in 0 s"):
        first_checkpoint(tmp_path / "elsewhere", 0.2, None)


def test_evaluate_on_a_finished_run_exits_1_naming_what_failed_and_a_rerun_tries_it_again(tmp_path, vllm_server,
                                                                                          monkeypatch, caplog):
    """`lit-rl evaluate` on a finished run, against the session's server. Before: an eval that
    failed on every step (here vLLM's 400 for a max_tokens above its max_model_len) was logged and
    the command exited 0; the rerun after the fix found those evals in done.jsonl (status failed),
    evaluated nothing and exited 0 too, without a word. Now the run exits 1 naming the evals and the
    error, a rerun evaluates what failed, and one more rerun says there is nothing left."""
    from lit_rl import cli
    from helpers import reverse_rows, write_jsonl

    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    data = write_jsonl(tmp_path / "test.jsonl", reverse_rows(2))

    def evaluate(max_tokens: int) -> None:
        env_args = {"path": data, "name": "rt", "max_tokens": max_tokens}
        cli.main(["evaluate", "--run-dir", str(run_root), "--base-url", vllm_server.base_url,
                  "--env", "lit_rl.rollouts.ReverseTextEnv", "--env-args", json.dumps(env_args)])

    def logged_steps() -> list[int]:
        return sorted(int(r["step"]) for r in read_eval_metrics(run_root / "evals") if r["name"] == "eval/rt/reward")

    with vllm_server.run_dir(steps=(0, 1)) as run_root:
        with pytest.raises(SystemExit) as failed:
            evaluate(2000)  # the session server's max_model_len is 1024
        message = str(failed.value.code)
        assert message.startswith("lit-rl evaluate: 2 of 2 evals failed (a rerun tries them again): rt at steps 0, 1: "
                                  "InferenceRequestError"), message
        assert "max_tokens=2000 cannot be greater than max_model_len=1024" in message, message
        assert logged_steps() == []
        evaluate(8)  # fixed: what failed is evaluated, and the command ends normally
        assert logged_steps() == [0, 1]
        assert DoneLog(run_root).entries == {(0, "rt"): "ok", (1, "rt"): "ok"}
        caplog.clear()
        with caplog.at_level("INFO", logger="lit_rl.evaluator"):
            evaluate(8)
        assert "nothing to evaluate: every due eval of the checkpoints" in caplog.text, caplog.text
        assert logged_steps() == [0, 1]  # nothing evaluated twice


def test_an_eval_that_raises_fails_alone_and_metrics_are_logged_as_numbers(vllm_server, monkeypatch):
    """Custom evals against the session's server. Before: an eval that raised failed every eval after
    it at that step, recorded as failed with its error without being run (`served` here: 4 of 4 evals
    failed); and a metric returned as a torch scalar (a torchmetrics `compute()`) went into
    eval_metrics.csv as `tensor(0.5000)`, which `read_eval_metrics` (so `lit-rl report`) could not
    read. Now the eval that raised fails alone, and metrics are logged as numbers."""
    from lit_rl import cli

    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    with vllm_server.run_dir(steps=(0, 1)) as run_root:
        with pytest.raises(SystemExit) as failed:
            cli.main(["evaluate", "--run-dir", str(run_root), "--base-url", vllm_server.base_url,
                      "--env", "online_eval_helpers.RaisingEval", "--env", "online_eval_helpers.ServedVersion"])
        assert failed.value.code == ("lit-rl evaluate: 2 of 4 evals failed (a rerun tries them again): raises at steps "
                                     "0, 1: ValueError: a bug in this eval"), failed.value.code
        assert DoneLog(run_root).entries == {(0, "raises"): "failed", (0, "served"): "ok",
                                             (1, "raises"): "failed", (1, "served"): "ok"}
        metrics = {(r["step"], r["name"]): r["value"] for r in read_eval_metrics(run_root / "evals")}
        assert metrics == {(s, f"eval/served/{name}"): value for s in (0, 1)
                           for name, value in (("version", s), ("half", 0.5), ("policy_version", s))}, metrics


def test_an_eval_past_its_timeout_fails_alone_and_the_evaluator_goes_on(vllm_server, monkeypatch):
    """An eval that never ends, against the session's server with `--eval-timeout 1`: it is recorded
    as failed at each step, naming the limit, and the eval after it runs at both steps. Before, the
    first step's hanging eval held the evaluator for good (no later eval, and beside training the
    trainer's wait for the final eval ran out)."""
    from lit_rl import cli

    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    with vllm_server.run_dir(steps=(0, 1)) as run_root:
        started = time.monotonic()
        with pytest.raises(SystemExit) as failed:
            cli.main(["evaluate", "--run-dir", str(run_root), "--base-url", vllm_server.base_url, "--eval-timeout", "1",
                      "--env", "online_eval_helpers.HangingEval", "--env", "online_eval_helpers.ServedVersion"])
        assert failed.value.code == ("lit-rl evaluate: 2 of 4 evals failed (a rerun tries them again): hangs at steps "
                                     "0, 1: EvalTimeout: did not finish in 1 s (OnlineEval.eval_timeout, lit-rl "
                                     "evaluate --eval-timeout)"), failed.value.code
        assert DoneLog(run_root).entries == {(0, "hangs"): "failed", (0, "served"): "ok",
                                             (1, "hangs"): "failed", (1, "served"): "ok"}
        assert time.monotonic() - started < 60


def test_an_evaluator_behind_skips_each_eval_only_for_a_newer_step_of_its_own(vllm_server):
    """`lit-rl evaluate --follow` (OnlineEval's evaluator) that finds steps 2 and 3 waiting, with
    `fast` due at every step and `slow` every 2nd. Before: it skipped to step 3 and skipped step 2 for
    both, though step 3 has no `slow` eval: `slow` lost step 2, and an evaluator that stays one export
    behind never ran `slow` before the final step. Now each eval skips only to a newer step of its own."""
    from lit_rl.commands.evaluate import parse, run

    trainer = subprocess.Popen([sys.executable, "-c", "pass"])  # a trainer that is gone: one pass, then stop
    trainer.wait()
    with vllm_server.run_dir(steps=(2, 3)) as run_root:
        EvalPlan(envs=[{"class_path": "online_eval_helpers.ServedVersion", "init_args": {"name": name}}
                       for name in ("fast", "slow")], interval=1, intervals={"slow": 2}, eval_base=False).save(run_root)
        run(parse(["--run-dir", str(run_root), "--base-url", vllm_server.base_url, "--follow",
                   "--parent-pid", str(trainer.pid)]))
        assert DoneLog(run_root).entries == {(2, "fast"): "skipped", (2, "slow"): "ok", (3, "fast"): "ok"}
        served = {(r["step"], r["name"]): r["value"] for r in read_eval_metrics(run_root / "evals")
                  if r["name"].endswith("/version")}
        assert served == {(2, "eval/slow/version"): 2.0, (3, "eval/fast/version"): 3.0}, served


def test_eval_prompts_are_rendered_as_training_renders_them(tmp_path, vllm_server, monkeypatch):
    """Before: an eval's prompts were rendered without the training data's chat template variables
    (a model trained with `enable_thinking: false` was evaluated on prompts that open a thinking
    block) and without the task's tools (DatasetEnv's `tools_column`), both of which its rollouts
    have. Now the plan carries the variables (OnlineEval takes them from the training data, `lit-rl
    evaluate --chat-template-kwargs` sets them) and evals render prompts with them and the tools.
    The prompts are read where the client sends them to the real server."""
    from transformers import AutoTokenizer

    from lit_rl import cli
    from lit_rl.inference.client import InferenceClient, chat_prompt_ids
    from helpers import TINY_MODEL, write_jsonl

    tool = {"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"type": "object"}}}
    rows = [{"prompt": "What is 2 + 2?", "answer": "4", "tools": json.dumps([tool])}]
    env_args = {"path": write_jsonl(tmp_path / "rows.jsonl", rows), "rewards": ["lit_rl.rewards.exact_match"],
                "tools_column": "tools", "max_tokens": 4, "name": "calc"}
    sent = []
    generate = InferenceClient.generate

    async def recording(self, prompt_ids, **kwargs):
        sent.append(list(prompt_ids))
        return await generate(self, prompt_ids, **kwargs)

    monkeypatch.setattr(InferenceClient, "generate", recording)
    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    with vllm_server.run_dir() as run_root:
        cli.main(["evaluate", "--run-dir", str(run_root), "--base-url", vllm_server.base_url,
                  "--env", "lit_rl.rollouts.DatasetEnv", "--env-args", json.dumps(env_args),
                  "--chat-template-kwargs", '{"enable_thinking": false}'])
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    expected = chat_prompt_ids(tokenizer, messages, [tool], {"enable_thinking": False})
    assert sent == [expected], tokenizer.decode(sent[0])
    assert expected != chat_prompt_ids(tokenizer, messages, None, None)  # neither is a no-op for this template
    assert expected != chat_prompt_ids(tokenizer, messages, [tool], None)


@pytest.fixture(scope="module")
def reverse_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("reverse_data")
    subprocess.run([sys.executable, "examples/reverse_text/make_data.py", "--out", str(out), "--train", "4000",
                    "--test", "40"], cwd=REPO, check=True, capture_output=True)
    return out


def write_config(tmp_path, data, *, steps, interval, envs, server=None, base_url=None, extra_callbacks=()):
    config = yaml.safe_load(EXAMPLE.read_text())
    config["trainer"].update(max_steps=steps, default_root_dir=str(tmp_path / "run"), log_every_n_steps=5)
    export, online = config["trainer"]["callbacks"][:2]
    online["init_args"].update(interval=interval, envs=envs)
    online["init_args"]["final_timeout"] = 300
    if base_url:
        online["init_args"]["base_url"] = base_url
        online["init_args"].pop("server", None)
    elif server:
        online["init_args"]["server"] = server
    config["trainer"]["callbacks"] = [export, online, *extra_callbacks]
    config["model"]["init_args"]["lr_scheduler"]["init_args"]["total_steps"] = steps
    config["data"]["init_args"].update(path=str(data / "train.jsonl"), num_workers=0)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def lit_rl(*args, timeout=900):
    return run(list(args), env={"PYTHONPATH": str(REPO / "tests")}, timeout=timeout)


def eval_metrics(root: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for path in root.glob("logs/version_*/eval_metrics.csv"):
        for row in csv.DictReader(open(path)):
            out.setdefault(row["name"], {})[int(row["step"])] = float(row["value"])
    return out


def restore_shared_server(vllm_server):
    import asyncio

    async def reload():
        async with vllm_server.client() as client:
            await client.reload_weights(vllm_server.model_dir)

    asyncio.run(reload())


def fit_on_shared_server(config, vllm_server, *args):
    """`lit-rl fit` whose evaluator uses the session's server; the server gets its weights back."""
    try:
        out = lit_rl("fit", "--config", str(config), *args)
    finally:
        restore_shared_server(vllm_server)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.long
def test_sft_with_online_evals_learns_and_logs_every_due_step(tmp_path, reverse_data, vllm_server):
    envs = [
        {"class_path": "lit_rl.rollouts.ReverseTextEnv",
         "init_args": {"path": str(reverse_data / "test.jsonl"), "num_examples": 40}},
        {"class_path": "examples.reverse_text.held_out_loss.HeldOutLoss",
         "init_args": {"path": str(reverse_data / "test.jsonl"), "num_examples": 20}},
    ]
    pace = {"class_path": "online_eval_helpers.WaitForEval", "init_args": {"step": 25, "wait_at": 49}}
    # step 0 evaluated (both envs), then the evaluator is SIGKILLed at step 10
    first = {"class_path": "online_eval_helpers.WaitForEval", "init_args": {"step": 0, "wait_at": 10,
                                                                            "env": "held_out_loss"}}
    kill = {"class_path": "online_eval_helpers.KillEvaluatorAt", "init_args": {"step": 10}}
    config = write_config(tmp_path, reverse_data, steps=50, interval=25, envs=envs, base_url=vllm_server.base_url,
                          extra_callbacks=[first, kill, pace])
    out = fit_on_shared_server(config, vllm_server)
    root = tmp_path / "run"
    # the evaluator, SIGKILLed at step 10, is started again at a later step, counted among the run's
    # restarts; the new one evaluates what was due and not done (below: every due step, none twice)
    assert "the evaluator exited (code -9); restarting it (restart 1 of at most 3)" in out.stderr, out.stderr[-4000:]
    assert "the evaluator is started again" in out.stderr, out.stderr[-4000:]
    assert (root / "killed_evaluator").is_file()
    done = [json.loads(line) for line in open(root / "evals" / "done.jsonl")]
    ok = [(d["step"], d["env"]) for d in done if d["status"] == "ok"]
    assert len(ok) == len(set(ok)) and {s for s, _ in ok} == {0, 25, 50}, done
    metrics = eval_metrics(root)
    reward, loss = metrics["eval/reverse_text/reward"], metrics["eval/held_out_loss/loss"]
    assert sorted(reward) == sorted(loss) == [0, 25, 50]  # base model, interval, final step
    assert metrics["eval/reverse_text/policy_version"] == {0: 0.0, 25: 25.0, 50: 50.0}
    print("held-out reward by step:", reward)
    assert reward[50] > reward[0] + 0.2  # the model learns, and the eval sees it
    assert loss[50] < loss[0]  # the subclassed eval produced its metric, and it moved the right way
    traces = [json.loads(line) for line in open(root / "evals" / "step_50" / "reverse_text.jsonl")]
    assert len(traces) == 40 and {"prompt", "completion", "reward"} <= set(traces[0])
    report = lit_rl("report", str(root))
    assert report.returncode == 0 and (root / "report.png").stat().st_size > 10_000


@pytest.mark.slow
def test_online_evals_under_fsdp2_run_once_from_rank_zero(tmp_path, reverse_data, vllm_server):
    """Two sharded CPU ranks (configs/strategies/fsdp2.yaml): every rank takes part in each
    export, rank 0 alone starts the evaluator, and it scores each due step exactly once."""
    envs = [{"class_path": "lit_rl.rollouts.ReverseTextEnv",
             "init_args": {"path": str(reverse_data / "test.jsonl"), "num_examples": 5}}]
    config = write_config(tmp_path, reverse_data, steps=4, interval=2, envs=envs, base_url=vllm_server.base_url)
    out = fit_on_shared_server(config, vllm_server, "--config", str(REPO / "configs" / "strategies" / "fsdp2.yaml"))
    assert "Starting with 2 processes" in out.stdout + out.stderr
    root = tmp_path / "run"
    versions = eval_metrics(root)["eval/reverse_text/policy_version"]
    assert versions[0] == 0.0 and versions[4] == 4.0 and set(versions) <= {0, 2, 4}  # base model and final step
    done = [json.loads(line) for line in open(root / "evals" / "done.jsonl")]
    steps = [d["step"] for d in done]
    assert len(steps) == len(set(steps)) and {0, 4} <= set(steps), done  # one evaluator: no step scored twice
    # a step the evaluator was too busy for is skipped, as in one process
    assert all(d["status"] == "ok" or (d["step"] == 2 and d["status"] == "skipped") for d in done), done
    assert (root / "evals" / "evaluator.log").read_text().count("evaluator: serving step 0 ") == 1  # one evaluator


@pytest.mark.slow
def test_vanished_checkpoint_is_skipped_and_training_succeeds(tmp_path, reverse_data, vllm_server):
    envs = [{"class_path": "online_eval_helpers.DeleteFinalStepAtBase",
             "init_args": {"path": str(reverse_data / "test.jsonl"), "num_examples": 5}}]
    config = write_config(tmp_path, reverse_data, steps=6, interval=3, envs=envs, base_url=vllm_server.base_url)
    settings = yaml.safe_load(config.read_text())
    settings["data"]["init_args"]["chat_template_kwargs"] = {"enable_thinking": False}
    config.write_text(yaml.safe_dump(settings))
    out = fit_on_shared_server(config, vllm_server)
    root = tmp_path / "run"
    # the training data's chat template variables go to the evaluator, whose prompts render with them
    assert json.loads((root / "evals" / "plan.json").read_text())["chat_template_kwargs"] == {"enable_thinking": False}
    done = [json.loads(line) for line in open(root / "evals" / "done.jsonl")]
    status = {d["step"]: d["status"] for d in done}
    assert status[0] == "ok" and status[6] == "failed"
    assert status.get(3) in ("ok", "skipped")
    # said at the end of the trainer's output, not only in evaluator.log
    assert "OnlineEval: 1 eval(s) failed (reverse_text at step 6)" in out.stderr, out.stderr[-3000:]
    log = (root / "evals" / "evaluator.log").read_text()
    # The evaluator either finds the directory already gone (the announced final step is
    # missing) or loses the race while leasing it (vanished under it): both skip step 6.
    assert ("final step 6 has no STABLE checkpoint" in log
            or ("step 6 failed (FileNotFoundError" in log and "skipping its evals" in log)), log


@pytest.mark.slow
@pytest.mark.long
def test_a_dead_evaluator_server_is_restarted_and_a_trainer_crash_takes_both_down(tmp_path, reverse_data):
    """The evaluator's own server, SIGKILLed after step 0's eval, is restarted by the evaluator: the
    eval that found it dead is made again and recorded as done. Then the trainer crashes: the
    evaluator and its server are gone within 30 s. (An evaluator process that is SIGKILLed is
    started again by the trainer: test_sft_with_online_evals_learns_and_logs_every_due_step; the
    socket directory its server leaves is removed by the next start: test_inference.py.)"""
    envs = [{"class_path": "lit_rl.rollouts.ReverseTextEnv",
             "init_args": {"path": str(reverse_data / "test.jsonl"), "num_examples": 5}}]
    killed, crash_now = tmp_path / "server_killed", str(tmp_path / "crash_now")
    # Training holds at step 1 until the server is killed (so step 10's export comes after the
    # kill), then at step 12 until the test has seen the eval made again; then it crashes.
    holds = [{"class_path": "online_eval_helpers.HoldAtStep", "init_args": {"step": 1, "until": str(killed)}},
             {"class_path": "online_eval_helpers.HoldAtStep", "init_args": {"step": 12, "until": crash_now}}]
    crash = {"class_path": "online_eval_helpers.CrashAtStep", "init_args": {"when": crash_now}}
    config = write_config(tmp_path, reverse_data, steps=1000, interval=10, envs=envs,
                          server={"max_model_len": 512, "dtype": "float32", "enforce_eager": True},
                          extra_callbacks=[*holds, crash])
    root = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "tests")}
    proc = subprocess.Popen([sys.executable, "-m", "lit_rl.cli", "fit", "--config", str(config)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300  # the evaluator's own server is up and has evaluated step 0
        while not (root / "evals" / "done.jsonl").is_file():
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.time() < deadline, "the evaluator never finished step 0"
            time.sleep(0.5)
        assert evaluator_processes(root), "evaluator or server not found while training"
        server = subprocess.run(["pgrep", "-f", f"vllm_main --model {root}"], capture_output=True, text=True).stdout.split()
        os.killpg(os.getpgid(int(server[0])), signal.SIGKILL)  # the evaluator's server crashes
        killed.touch()
        done = root / "evals" / "done.jsonl"

        def made_again() -> bool:  # the first eval after the crash failed, then was recorded ok
            records = [json.loads(line) for line in done.read_text().splitlines()]
            failed = [r["step"] for r in records if r["status"] == "failed"]
            return bool(failed) and any(r["step"] == failed[0] and r["status"] == "ok" for r in records)

        while not made_again():
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.time() < deadline + 300, f"no eval made again after the server's crash: {done.read_text()}"
            time.sleep(0.5)
        log = (root / "evals" / "evaluator.log").read_text()
        assert "restarting it (restart 1 of at most 3)" in log and "evaluating step" in log, log[-3000:]
        ok = [json.loads(line)["step"] for line in done.read_text().splitlines() if json.loads(line)["status"] == "ok"]
        assert len(ok) == len(set(ok)), ok  # no step evaluated twice
        Path(crash_now).touch()  # the trainer, held at step 12, fails
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0 and "deliberate crash" in output
        gone_by = time.time() + 30
        while evaluator_processes(root) and time.time() < gone_by:
            time.sleep(0.5)
        assert not evaluator_processes(root), "evaluator or its vLLM server outlived the crashed trainer by 30 s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_evaluator_writes_into_the_trainers_wandb_run_and_a_resume_repeats_no_eval(tmp_path, reverse_data, vllm_server):
    """With W&B on (offline here: no W&B server is reachable), the evaluator writes into the
    trainer's run id, beside the trainer's files, with eval metrics against the policy version.
    The run is then resumed to twice its length: the evaluator repeats no step the first one did."""
    envs = [{"class_path": "lit_rl.rollouts.ReverseTextEnv",
             "init_args": {"path": str(reverse_data / "test.jsonl"), "num_examples": 5}}]
    pace = {"class_path": "online_eval_helpers.WaitForEval", "init_args": {"step": 2, "wait_at": 3}}
    path = write_config(tmp_path, reverse_data, steps=4, interval=2, envs=envs, base_url=vllm_server.base_url,
                        extra_callbacks=[pace])
    config = yaml.safe_load(path.read_text())
    config["trainer"]["log_every_n_steps"] = 1
    config["trainer"]["logger"] = {"class_path": "lightning.pytorch.loggers.WandbLogger",
                                   "init_args": {"offline": True, "project": "lit-rl-test", "save_dir": str(tmp_path)}}
    path.write_text(yaml.safe_dump(config))
    fit_on_shared_server(path, vllm_server)
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files  # the trainer's and the evaluator's, ...
    assert len({run_id(f) for f in files}) == 1, files  # ... for one run id
    trainer, evaluator = sorted((history(f) for f in files), key=lambda rows: any("eval/policy_version" in r for r in rows))
    assert [r["trainer/global_step"] for r in trainer if "train/loss" in r] == [0, 1, 2, 3]
    evals = [(r["eval/policy_version"], r["trainer/global_step"], r["eval/reverse_text/policy_version"]) for r in evaluator]
    assert evals == [(0, 0, 0), (2, 2, 2), (4, 4, 4)]  # base model, interval, final step
    assert all(0 <= r["eval/reverse_text/reward"] <= 1 for r in evaluator)
    for f in files:  # both writers finished their part cleanly (the trainer last: it waits for the evaluator)
        assert any(r.WhichOneof("record_type") == "exit" for r in records(f)), f

    fit_on_shared_server(path, vllm_server, "--trainer.max_steps", "8", "--ckpt_path", "last")
    steps = [r["step"] for r in read_eval_metrics(tmp_path / "run" / "evals") if r["name"] == "eval/reverse_text/reward"]
    assert len(steps) == len(set(steps)), f"an eval was repeated: {steps}"
    assert steps[:3] == [0, 2, 4] and 8 in steps and set(steps) <= {0, 2, 4, 6, 8}, steps


def test_evals_go_on_without_wandb_when_joining_the_run_fails(tmp_path, caplog):
    from lit_rl.eval.logging import EvalLogger

    logger = EvalLogger(tmp_path, {"id": "not/a/run/id", "project": "p", "mode": "offline", "dir": str(tmp_path)})
    logger.log(3, {"eval/x/reward": 0.5})
    logger.close()
    assert "could not join the trainer's W&B run not/a/run/id" in caplog.text
    assert read_eval_metrics(tmp_path) == [{"step": 3, "name": "eval/x/reward", "value": 0.5}]


def test_online_wandb_run_is_made_shared_with_the_trainer_primary():
    """Online W&B cannot run here; what can be checked is the request the trainer's logger
    will make: W&B shared mode, trainer primary, user settings kept; offline left alone."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    from lit_rl.eval.wandb_shared import make_trainer_primary

    online = WandbLogger(project="p", settings={"x_label": "mine", "console": "off"})
    assert make_trainer_primary(online)
    settings = wandb.Settings(**online._wandb_init["settings"])
    assert (settings.mode, settings.x_primary, settings.x_label, settings.console) == ("shared", True, "mine", "off")
    offline = WandbLogger(project="p", offline=True)
    assert not make_trainer_primary(offline) and "settings" not in offline._wandb_init
