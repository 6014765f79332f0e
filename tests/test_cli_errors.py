"""A user's mistake prints one message and exits 1; LIT_RL_DEBUG=1 and internal errors keep the traceback.

One case runs the real entry point in a subprocess (what a user sees on the terminal); the
others call `lit_rl.cli.main` in this process, which is the same code minus the start-up time.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from helpers import REPO, TINY_MODEL, reverse_rows, write_jsonl
from lit_rl import cli
from lit_rl.errors import UserError, user_message

from test_cli import CONFIG, fit_args, run


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    """In-process calls see sys.argv as `lit-rl` would, without pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lit-rl"])


def user_error(args, capsys) -> str:
    """stderr of a command that must fail as a user error: exit 1, one message, no traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 1, err[-3000:]
    assert "Traceback" not in err and "LIT_RL_DEBUG=1" in err
    return err


def test_missing_data_file_as_the_user_sees_it(tmp_path, monkeypatch):
    args = fit_args(tmp_path, str(tmp_path / "no_such_file.jsonl"))
    out = run(args)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "lit-rl fit: error: StaticDataModule: 1 problem(s)" in out.stderr
    assert "no such file " in out.stderr and "no_such_file.jsonl" in out.stderr
    # LIT_RL_DEBUG=1: the error is not caught, so the interpreter prints its traceback (the same code in-process)
    monkeypatch.setenv("LIT_RL_DEBUG", "1")
    monkeypatch.setattr(sys, "argv", ["lit-rl"])
    with pytest.raises(ValueError, match="no_such_file.jsonl"):
        cli.main(args)


def test_missing_column(tmp_path, capsys):
    """...and the refused run leaves no empty `logs/version_N` (Lightning makes it before the
    datamodule's setup), while an earlier run's logs stay as they are."""
    earlier = tmp_path / "run" / "logs" / "version_0"
    earlier.mkdir(parents=True)
    (earlier / "metrics.csv").write_text("step,train/loss\n0,1.0\n")
    data = write_jsonl(tmp_path / "wrong.jsonl", [{"question": "hi", "answer": "ho"}] * 8)
    err = user_error(fit_args(tmp_path, data), capsys)
    assert "'messages'" in err and "'prompt'" in err and "question" in err, err
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == ["version_0"]
    assert (earlier / "metrics.csv").read_text() == "step,train/loss\n0,1.0\n"
    # the same refusal in a fresh directory leaves no logs/ at all
    err = user_error(fit_args(tmp_path / "fresh", data), capsys)
    assert not (tmp_path / "fresh" / "run" / "logs").exists()


def test_validate_with_ckpt_path_last_and_no_checkpoint_is_refused(tmp_path, capsys):
    """`lit-rl validate --ckpt_path last` in a run directory without a checkpoint took fit's rule
    ("starting from step 0") and reported the loss of the untrained model the config builds."""
    data = write_jsonl(tmp_path / "val.jsonl", reverse_rows(8))
    err = user_error(["validate", "--config", CONFIG, "--data.init_args.path", data, "--data.init_args.val_path", data,
                      "--data.init_args.num_workers", "0", "--trainer.default_root_dir", str(tmp_path / "run"),
                      "--ckpt_path", "last"], capsys)
    assert f"--ckpt_path last found no checkpoint in the run directory {tmp_path / 'run'} (none in " in err, err
    assert "`lit-rl validate` would run the model the config builds, untrained" in err, err


def test_a_bad_held_out_row_is_one_message_naming_the_validation_data(tmp_path, capsys):
    """A held-out row with no assistant token within max_length: Lightning's sanity check (before
    training) stopped with a traceback, and "row 3" read as the training data's. Now one message
    names the validation file; a max_length that no row can fit is refused with the options."""
    train = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    rows = reverse_rows(4, offset=100)
    rows[3]["messages"][0]["content"] = "word " * 200  # the prompt alone is longer than max_length
    val = write_jsonl(tmp_path / "val.jsonl", rows)
    args = fit_args(tmp_path, train, steps=1) + ["--data.init_args.val_path", val, "--data.init_args.max_length", "128"]
    err = user_error(args, capsys)
    assert f"error: validation data ({val}): row 3: no assistant token to train on within max_length=128 " \
           "(set data bad_rows: skip to skip such rows)" in err, err
    err = user_error(fit_args(tmp_path, train, steps=1) + ["--data.init_args.max_length=-5"], capsys)
    assert "data.max_length must be >= 2 tokens, got -5" in err, err


def test_a_row_that_is_not_json_is_named(tmp_path, capsys):
    """datasets says only "An error occurred while generating the dataset"; the row is in its cause."""
    good = write_jsonl(tmp_path / "good.jsonl", reverse_rows(2))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(good).read() + '{"messages": [{"role": "user", "content": "x"}\n')
    err = user_error(["data", "preview", "--config", CONFIG, "--data.init_args.path", str(bad),
                      "--data.init_args.val_path", ""], capsys)
    assert f"cannot load '{bad}'" in err and "(cause: ArrowInvalid: JSON parse error" in err and "in row 2" in err, err


def test_hub_model_without_network(tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(4))
    err = user_error(["data", "preview", "--config", CONFIG, "--data.init_args.path", data,
                      "--model.init_args.model", "no-such-org/no-such-model"], capsys)
    assert "cannot load the tokenizer 'no-such-org/no-such-model': it is not a local directory and the hub is " \
           "switched off (HF_HUB_OFFLINE=1)" in err, err
    assert "fix:" in err and "lit-rl:tiny_qwen3" in err and "hf download no-such-org/no-such-model" in err


def test_a_model_path_that_is_missing_or_holds_no_model_is_one_message(tmp_path, capsys):
    """Before: a missing path was told to `hf download` itself, and an empty directory was
    transformers' "Couldn't instantiate the backend tokenizer" traceback."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(4))
    (tmp_path / "empty").mkdir()
    preview = ["data", "preview", "--config", CONFIG, "--data.init_args.path", data, "--model.init_args.model"]
    err = user_error([*preview, str(tmp_path / "missing")], capsys)
    assert f"cannot load the tokenizer '{tmp_path / 'missing'}': no such directory" in err and "hf download" not in err, err
    err = user_error([*preview, str(tmp_path / "empty")], capsys)
    assert f"cannot load the tokenizer in directory '{tmp_path / 'empty'}'" in err, err
    assert "fix: point to a complete HF checkpoint directory" in err, err


def test_option_that_is_not_accepted(capsys):
    with pytest.raises(SystemExit) as e:  # jsonargparse's own message: names the option, no traceback
        cli.main(["fit", "--config", CONFIG, "--data.init_args.no_such_field", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no_such_field" in err and "Traceback" not in err


def test_option_value_that_a_class_rejects(capsys):
    err = user_error(["fit", "--config", CONFIG, "--model.init_args.head_chunk_size", "0"], capsys)
    assert "invalid config: model.head_chunk_size must be >= 1, got 0" in err
    # HF Trainer's "no clipping" is 0, which here zeroed every update (and a negative norm trained uphill)
    for value in ("0", "-1.0"):
        err = user_error(["fit", "--config", CONFIG, "--model.init_args.max_grad_norm", value], capsys)
        assert "invalid config: model.max_grad_norm must be > 0, or null to disable clipping (HF Trainer's 0)" in err, err


def test_a_dtype_that_is_not_one_is_refused_when_the_config_is_read(tmp_path, capsys):
    """Before: `bf16` passed the config, the data loaded, and the model's load was a ValueError traceback."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    err = user_error([*fit_args(tmp_path, data), "--model.init_args.dtype", "bf16"], capsys)
    assert "invalid config: model.init_args.dtype must be one of ['bfloat16', 'float16', 'float32'], got 'bf16'" in err, err


@pytest.mark.parametrize("module", ["GRPO", "OPD"])
def test_a_loss_on_the_policys_samples_refuses_dataset_rows_before_the_model_loads(module, tmp_path, capsys):
    """Before: the model loaded, training started, and its first step failed on a ValueError."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    args = [*fit_args(tmp_path, data), "--model", f"lit_rl.modules.{module}", "--model.init_args.model", TINY_MODEL,
            "--model.init_args.random_init", "true"]
    if module == "OPD":
        args += ["--model.init_args.teacher_model", TINY_MODEL]
    err = user_error(args, capsys)
    assert f"lit-rl fit: error: {module} trains on the policy's own samples, with the logprobs they were sampled " \
           "with, and data is a StaticDataModule of dataset rows" in err, err


def test_grpo_options_that_would_do_nothing_are_refused(tmp_path, capsys):
    """A YAML `.nan` passes jsonargparse's float (the command line's `nan` does not): NaN turned the KL
    penalty off without a word. A reference without the penalty was never loaded, and TRL's
    max_completion_length (its generation limit) was dapo's unused constant here."""
    grpo = ["fit", "--config", str(REPO / "examples" / "reverse_text" / "grpo.yaml"), "--model.init_args.model", TINY_MODEL,
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "0"]
    nan = tmp_path / "nan.yaml"
    nan.write_text("model:\n  init_args:\n    kl_coef: .nan\n")
    err = user_error([*grpo, "--config", str(nan)], capsys)
    assert "invalid config: GRPO: kl_coef must be a finite number >= 0, got nan" in err, err
    err = user_error([*grpo, "--model.init_args.reference_model", TINY_MODEL], capsys)
    assert f"GRPO: reference_model '{TINY_MODEL}' is the reference of the KL penalty, which kl_coef 0 turns off" in err, err
    err = user_error([*grpo, "--model.init_args.max_completion_length", "256"], capsys)
    assert "GRPO: max_completion_length (256) is dr_grpo's constant only, unused by loss_type 'dapo'; completions " \
           "are limited by data.init_args.max_tokens" in err, err


def test_opd_options_its_divergence_does_not_use_are_refused(tmp_path, capsys):
    """OPD's options belong to some divergences only (jsd's beta, the sampled-token estimator's weight,
    baseline and clip, a teacher server's top k): set for another, they changed nothing, silently."""
    opd = ["fit", "--config", str(REPO / "examples" / "reverse_text" / "opd.yaml"), "--model.init_args.model", TINY_MODEL,
           "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "0"]
    err = user_error([*opd, "--model.init_args.divergence", "reverse_kl", "--model.init_args.beta", "0.2",
                      "--model.init_args.advantage_clip", "0.5"], capsys)
    assert "beta 0.2 does nothing with divergence 'reverse_kl': it is jsd's mixture weight" in err, err
    assert "advantage_clip 0.5 does nothing with divergence 'reverse_kl': the dense divergence 'reverse_kl' has no " \
           "sampled-token advantage" in err, err
    err = user_error([*opd, "--model.init_args.divergence", "sampled_reverse_kl", "--model.init_args.teacher_top_k", "5"],
                     capsys)
    assert "teacher_top_k 5 does nothing with divergence 'sampled_reverse_kl'" in err, err
    assert not (tmp_path / "run").exists()


def test_bad_sampling_options_are_named_by_their_flags_before_any_server(tmp_path, capsys):
    """Named as the config spells them (data.temperature), not as a TrainSampling's fields; a top_k
    vLLM refuses was found only at the first request (or, with a processed distribution, was a
    ValueError's traceback), and a YAML `.nan` temperature passed."""
    grpo = ["fit", "--config", str(REPO / "examples" / "reverse_text" / "grpo.yaml"), "--model.init_args.model", TINY_MODEL,
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "1",
            "--data.init_args.env.init_args.path", write_jsonl(tmp_path / "d.jsonl", reverse_rows(4))]
    started = time.monotonic()
    err = user_error([*grpo, "--data.init_args.temperature", "-1", "--data.init_args.top_k", "-5",
                      "--data.init_args.top_p", "0"], capsys)
    assert "data.temperature must be >= 0, got -1.0" in err and "data.top_p must be in (0, 1], got 0.0" in err, err
    assert "data.top_k must be -1, 0 (both: off), >= 1 or null, got -5" in err and "TrainSampling" not in err, err
    nan = tmp_path / "nan.yaml"
    nan.write_text("data:\n  init_args:\n    temperature: .nan\n")
    err = user_error([*grpo, "--config", str(nan)], capsys)
    assert "data.temperature must be >= 0, got nan" in err, err
    assert time.monotonic() - started < 60 and not (tmp_path / "run" / "vllm.log").exists()  # no server started


def test_a_data_tokenizer_must_have_the_models_vocabulary(tmp_path, capsys):
    """`data.tokenizer` names another tokenizer than the model's: a copy of the model's (same
    vocabulary) trains; one with a token added (an id the tiny model's embeddings still hold, so
    nothing else would fail) is refused before the model loads, naming the flag and the token."""
    from transformers import AutoTokenizer

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    tokenizer.save_pretrained(tmp_path / "copy")
    tokenizer.add_tokens(["<lit_rl_extra>"])
    tokenizer.save_pretrained(tmp_path / "extra")
    cli.main(fit_args(tmp_path / "a", data, steps=1) + ["--data.init_args.tokenizer", str(tmp_path / "copy")])
    assert (tmp_path / "a" / "run" / "checkpoints" / "last.ckpt").is_file()  # trained its step
    err = user_error(fit_args(tmp_path / "b", data, steps=1) + ["--data.init_args.tokenizer", str(tmp_path / "extra")], capsys)
    assert f"data.init_args.tokenizer {str(tmp_path / 'extra')!r} has another vocabulary than the model's tokenizer" in err, err
    assert "the first '<lit_rl_extra>' = " in err and "in the data's" in err, err
    assert not (tmp_path / "b" / "run" / "weights").exists()


def test_unknown_command_suggests_the_closest(capsys):
    err = user_error(["fitt", "--config", CONFIG], capsys)
    assert "unknown command 'fitt' (did you mean 'fit'?)" in err
    err = user_error(["data", "previw", "--config", CONFIG], capsys)  # was a usage with exit 2, no hint
    assert "unknown command 'previw' of lit-rl data (did you mean 'preview'?)" in err, err


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_RL_DEBUG", "1")
    with pytest.raises(UserError, match="unknown command"):
        cli.main(["fitt"])


def test_internal_errors_keep_their_traceback(monkeypatch):
    def bug(argv):
        raise KeyError("a bug in lit-rl")

    monkeypatch.setattr("lit_rl.commands.report.main", bug)
    with pytest.raises(KeyError, match="a bug in lit-rl"):
        cli.main(["report", "runs/x"])


def test_only_known_user_errors_are_classified():
    assert user_message(UserError("fix me")) == "fix me"
    assert user_message(ValueError("StaticDataModule: 1 problem(s): ...")).startswith("StaticDataModule")
    assert user_message(ValueError("shapes do not match")) is None  # a bug somewhere: keep the traceback
    assert user_message(OSError("disk full")) is None  # raised outside transformers/huggingface_hub
    assert user_message(FileNotFoundError("x")) is None


def test_raw_hub_oserror_from_other_code_is_classified_too():
    # e.g. a user's environment calling transformers itself: the innermost frame is in transformers
    try:
        exec(compile("raise OSError(\"We couldn't connect to 'https://huggingface.co'\")", "/x/transformers/hub.py", "exec"))
    except OSError as e:
        message = user_message(e)
    assert message.startswith("cannot load a model or tokenizer: We couldn't connect") and "fix:" in message


def test_a_bug_inside_a_configured_class_keeps_its_traceback(monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    def broken(self):  # what jsonargparse raises when a class's __init__ has a bug
        try:
            raise TypeError("unsupported operand")
        except TypeError as e:
            raise ValueError("Does not validate against any of the Union subtypes") from e

    monkeypatch.setattr(LightningCLI, "instantiate_classes", broken)
    with pytest.raises(ValueError, match="Union subtypes"):
        cli.main(["fit", "--config", CONFIG])


@pytest.mark.parametrize("args", [["fit", "--config"], ["validate", "-c"], ["data", "preview", "--config"]])
def test_a_config_file_that_is_not_there_is_one_line(args, tmp_path, capsys):
    """Not jsonargparse's refusal after the command's usage (every flag of the config, some 200 lines)."""
    err = user_error([*args, str(tmp_path / "nope.yaml")], capsys)
    assert f"--config {tmp_path / 'nope.yaml'}: no such file" in err and len(err.splitlines()) == 2, err[:3000]


def test_an_inline_config_is_not_taken_for_a_missing_file(capsys):
    with pytest.raises(SystemExit) as e:  # jsonargparse's --config takes YAML text too
        cli.main(["fit", "--config", CONFIG, "--config", "{trainer: {max_steps: 1}}", "--print_config"])
    out = capsys.readouterr()
    assert e.value.code == 0 and "max_steps: 1\n" in out.out, out.err[-2000:]


def test_preview_option_that_is_not_accepted(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["data", "preview", "--config", CONFIG, "--bogus", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in err and "dotted" in err
    assert len(err.splitlines()) <= 3 and "Traceback" not in err, err


def test_evaluate_on_a_run_without_checkpoints_fails_at_once(tmp_path):
    """A finished run's evaluator has nothing to wait for: an empty weights/ is an error, not an
    hour's silent wait (it waits only with --follow, for a run still training)."""
    (tmp_path / "weights").mkdir()
    env = ["--env", "lit_rl.rollouts.ReverseTextEnv", "--env-args",  # its rows are read first (a fresh clone has no demo data)
           json.dumps({"path": write_jsonl(tmp_path / "test.jsonl", reverse_rows(2))})]
    started = time.monotonic()
    with pytest.raises(SystemExit) as e:
        cli.main(["evaluate", "--weights-dir", str(tmp_path / "weights"), *env])
    assert time.monotonic() - started < 30
    assert f"no STABLE checkpoint under {tmp_path / 'weights'}" in str(e.value.code)
    assert "give --follow" in str(e.value.code)
    # on a server of the user's: before, it evaluated nothing and exited 0 (no server is reached here)
    with pytest.raises(SystemExit) as e:
        cli.main(["evaluate", "--weights-dir", str(tmp_path / "weights"), *env, "--base-url", "http://127.0.0.1:9/v1"])
    assert f"no STABLE checkpoint under {tmp_path / 'weights'}" in str(e.value.code)


def test_a_dataset_env_with_a_missing_column_and_a_bad_reward_is_one_message(tmp_path, capsys):
    """A bad reward path, then a missing column, of a GRPO config's DatasetEnv: each one message when the run is
    set up, before any server starts (not jsonargparse's dump of the whole data config)."""
    import json

    from helpers import REPO

    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "hi", "answer": "ho"}] * 4)
    env = {"class_path": "lit_rl.rollouts.DatasetEnv", "init_args": {"path": data, "rewards": ["no_such_module.fn"]}}
    err = user_error(["fit", "--config", str(REPO / "examples/reverse_text/grpo.yaml"), "--model.init_args.model",
                      "lit-rl:tiny_qwen3", "--trainer.default_root_dir", str(tmp_path / "run"),
                      "--data.init_args.env", json.dumps(env), "--data.init_args.max_consecutive_failures", "0",
                      "--data.init_args.packing", "packed", "--data.init_args.pack_length", "9000",
                      "--data.init_args.scale", "grup", "--data.init_args.on_failure", "retry"], capsys)
    assert "RolloutDataModule: 5 problem(s)" in err and "Errors:" not in err, err
    # the rollout buffer's own options, named as flags, before any server starts
    assert "data.scale must be one of ('group', 'batch', 'none'), got 'grup'" in err, err
    assert "data.on_failure must be one of ('reject', 'raise'), got 'retry'" in err, err
    assert "data.pack_length (9000) exceeds data.micro_batch_tokens (" in err, err
    assert "data.env (DatasetEnv): DatasetEnv rewards[0]: cannot import module 'no_such_module'" in err, err
    assert "data.max_consecutive_failures must be an int >= 1 or null, got 0" in err, err
    env["init_args"]["rewards"] = ["lit_rl.rewards.exact_match"]
    err = user_error(["fit", "--config", str(REPO / "examples/reverse_text/grpo.yaml"), "--model.init_args.model",
                      "lit-rl:tiny_qwen3", "--trainer.default_root_dir", str(tmp_path / "run"),
                      "--data.init_args.env", json.dumps(env)], capsys)
    assert "has no column 'prompt' (for prompt_column); its columns: ['question', 'answer']" in err, err


def test_two_hfexport_callbacks_are_refused(tmp_path, capsys):
    """Two exported every step twice, each with its own retention; the syncs and online evals used the first."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    second = '{"class_path": "lit_rl.callbacks.HFExport", "init_args": {"every_n_steps": 1}}'
    err = user_error(fit_args(tmp_path, data) + ["--trainer.callbacks+", second], capsys)
    assert "trainer.callbacks has more than one lit_rl.callbacks.HFExport" in err, err
    assert not (tmp_path / "run" / "weights").exists()


def test_lightnings_accumulation_and_clipping_flags_name_lit_rls_own(tmp_path, capsys):
    """Lightning's own refusal (manual optimization) was a traceback that said to switch to
    automatic optimization; lit-rl names the options that do the job, before anything is written."""
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    err = user_error(fit_args(tmp_path, data) + ["--trainer.accumulate_grad_batches", "4"], capsys)
    assert "trainer.accumulate_grad_batches (4)" in err and "raise data.batch_size" in err, err
    err = user_error(fit_args(tmp_path, data) + ["--trainer.gradient_clip_val", "0.5",
                                                  "--trainer.gradient_clip_algorithm", "value"], capsys)
    assert "trainer.gradient_clip_val (0.5), trainer.gradient_clip_algorithm (value)" in err, err
    assert "model.init_args.max_grad_norm" in err and "automatic optimization" not in err, err
    assert not (tmp_path / "run").exists()


def test_evaluate_and_serve_name_a_missing_directory_or_a_bad_env_before_any_server(tmp_path, capsys):
    """Before: a missing --weights-dir was reported under '/weights', a bad --env was a traceback after
    the evaluator's server had started (25 s here), and `serve` quoted the hub's error about
    repository ids from vLLM's log."""
    weights = tmp_path / "run" / "weights"
    weights.mkdir(parents=True)
    env = ["--env", "lit_rl.rollouts.ReverseTextEnv"]
    err = user_error(["evaluate", "--weights-dir", str(tmp_path / "nope"), *env], capsys)
    assert f"--weights-dir {tmp_path / 'nope'}: no such directory" in err, err
    err = user_error(["evaluate", "--weights-dir", str(tmp_path / "run"), *env], capsys)
    assert "not a run's weights/ directory" in err and "--run-dir" in err, err
    err = user_error(["evaluate", "--weights-dir", str(weights), "--env", "lit_rl.rollouts.NoSuchEnv"], capsys)
    assert "--env / --env-args" in err and "has no callable 'NoSuchEnv'" in err, err
    err = user_error(["evaluate", "--weights-dir", str(weights), *env, "--env-args", '{"nope": 1}'], capsys)
    assert "unexpected keyword argument 'nope'" in err, err
    assert not (tmp_path / "run" / "evals").exists()  # no server, no log
    err = user_error(["serve", "--model", str(tmp_path / "nope")], capsys)
    assert f"--model {tmp_path / 'nope'}: no such directory (a hub name is ORG/NAME)" in err, err
    # a directory that is no model: vLLM said so after its start-up (15 s here), in its own traceback
    err = user_error(["serve", "--model", str(tmp_path / "run")], capsys)
    assert f"--model {tmp_path / 'run'} has no config.json: not a model directory" in err, err
    for step in (2, 10):
        (weights / f"step_{step}").mkdir()
        (weights / f"step_{step}" / "config.json").write_text("{}")
    (weights / "step_11").mkdir()  # no config.json: not a checkpoint to name
    err = user_error(["serve", "--model", str(weights)], capsys)
    assert f"--model {weights} holds checkpoints, not a model: give one of them, e.g. {weights / 'step_10'}" in err, err
    # the built-in model is a config and a tokenizer: vLLM said "Cannot find any model weights" after its start-up
    err = user_error(["serve", "--model", "lit-rl:tiny_qwen3"], capsys)
    assert "--model lit-rl:tiny_qwen3 has no weights (no *.safetensors, *.bin, *.pt files)" in err, err
    assert "random_init" in err, err


def test_a_misspelt_server_option_is_named_before_any_server_starts(tmp_path, capsys):
    """Before: `inference.server: {tensor_parallel_sizes: 2}` reached VLLMServer(**options) when the run
    started its server, a TypeError in a traceback after the model had loaded. Now each place that
    takes server options names the option and the closest one there is, before anything starts.
    `lit-rl evaluate`'s JSON flags that are not a JSON object were a JSONDecodeError's traceback."""
    from lit_rl.callbacks import OnlineEval
    from lit_rl.rollouts import ReverseTextEnv

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    grpo = ["fit", "--config", "examples/reverse_text/grpo.yaml", "--data.init_args.env.init_args.path", data,
            "--trainer.default_root_dir", str(tmp_path / "run")]
    err = user_error([*grpo, "--inference.server", '{"dtype": "float32", "tensor_parallel_sizes": 2, "api_key": "k"}'],
                     capsys)
    assert "inference.server.tensor_parallel_sizes is not a server option (did you mean tensor_parallel_size?)" in err, err
    assert "inference.server.api_key is not a server option here: lit-rl sets it" in err, err
    err = user_error([*grpo, "--inference.server", '{"dtype": "fp32", "max_model_len": 0}'], capsys)  # vLLM's own
    assert "inference.server.dtype must be one of auto, bfloat16" in err and "inference.server.max_model_len must be >= 1" \
        in err, err  # refusal came after its start-up; 0 served the model's whole length
    assert not (tmp_path / "run").exists()  # nothing started, nothing written

    with pytest.raises(ValueError, match=r"OnlineEval: server.enforce_eagr is not a server option \(did you mean enforce_eager\?\)"):
        OnlineEval(envs=[ReverseTextEnv(path=data, num_examples=2)], server={"enforce_eagr": True})
    OnlineEval(envs=[ReverseTextEnv(path=data, num_examples=2)], server={"enforce_eager": True, "num_infer_gpus": 1})

    weights = tmp_path / "evaluated" / "weights"
    weights.mkdir(parents=True)
    env = ["--env", "lit_rl.rollouts.ReverseTextEnv", "--env-args", json.dumps({"path": data})]
    err = user_error(["evaluate", "--weights-dir", str(weights), *env, "--server", '{"max_model_length": 512}'], capsys)
    assert "--server max_model_length is not a server option (did you mean max_model_len?)" in err, err
    for flag, value, said in (("--server", "{max_model_len: 512}", "not JSON"), ("--env-args", "[1]", "give a JSON object"),
                              ("--wandb", "{'id': 'x'}", "not JSON")):  # a usage error, as argparse says it
        with pytest.raises(SystemExit) as e:
            cli.main(["evaluate", "--weights-dir", str(weights), *env, flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: {said}" in err and "Traceback" not in err, err
    # Options that were ignored without a word (the second --env-args' environment never evaluated,
    # --server beside --base-url never used, a negative restart count): one usage error naming them all
    with pytest.raises(SystemExit) as e:
        cli.main(["evaluate", "--weights-dir", str(weights), *env, "--env-args", '{"name": "b"}', "--plan", "p.json",
                  "--base-url", "http://127.0.0.1:1/v1", "--server", '{"max_model_len": 512}', "--max-server-restarts", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    for said in ("2 --env-args for 1 --env", "--plan and --env: give one",
                 "--server: options of a server lit-rl starts, but --base-url names one", "--max-server-restarts must be >= 0"):
        assert said in err, err
    (tmp_path / "plan.json").write_text('{"envs": [')  # a plan that is not one: named, not a JSONDecodeError's traceback
    err = user_error(["evaluate", "--weights-dir", str(weights), "--plan", str(tmp_path / "plan.json")], capsys)
    assert f"--plan {tmp_path / 'plan.json'}: not an eval plan (JSONDecodeError" in err, err
    assert not (tmp_path / "evaluated" / "evals").exists()


def test_an_eval_completion_limit_with_no_room_for_a_prompt_is_named_before_any_server(tmp_path, capsys):
    """Before: `lit-rl evaluate --server '{"max_model_len": 48}'` with ReverseTextEnv (max_tokens 64)
    started its server (40 s here), then every step's eval failed on vLLM's 400 ("max_tokens=64
    cannot be greater than max_model_len=48") and the command exited 0; at max_model_len 64 vLLM cut
    every completion to what the prompt left, without a word. OnlineEval handed both to its evaluator.
    Training's sampler had this check; the evaluator's server now has it too."""
    from lit_rl.callbacks import OnlineEval
    from lit_rl.rollouts import ReverseTextEnv

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    for model_len in (48, 64):
        with pytest.raises(ValueError, match=rf"OnlineEval: environment held_out's max_tokens \(64\) leaves no room "
                                             rf"for a prompt in server.max_model_len \({model_len}\)"):
            OnlineEval(envs=[ReverseTextEnv(path=data, name="held_out", num_examples=2)], server={"max_model_len": model_len})
    OnlineEval(envs=[ReverseTextEnv(path=data, max_tokens=32, num_examples=2)], server={"max_model_len": 64})
    from online_eval_helpers import ScoreFixedIds

    OnlineEval(envs=[ScoreFixedIds()], server={"max_model_len": 64})  # its own evaluate samples nothing

    weights = tmp_path / "evaluated" / "weights"
    weights.mkdir(parents=True)
    env = ["--env", "lit_rl.rollouts.ReverseTextEnv", "--env-args", json.dumps({"path": data, "max_tokens": 100})]
    err = user_error(["evaluate", "--weights-dir", str(weights), *env, "--server", '{"max_model_len": 64, "dtype": "float32"}'],
                     capsys)
    assert "environment reverse_text's max_tokens (100) leaves no room for a prompt in --server max_model_len (64)" in err, err
    assert not (tmp_path / "evaluated" / "evals").exists()  # nothing started, nothing written
    # with room: past the check, to the missing checkpoint (no server either)
    with pytest.raises(SystemExit, match="no STABLE checkpoint"):
        cli.main(["evaluate", "--weights-dir", str(weights), *env, "--server", '{"max_model_len": 128}'])


def test_reverse_text_rows_without_a_chat_or_a_user_turn_are_named_before_any_server(tmp_path, capsys):
    """Before: a `prompt`/`completion` file was "data.env (ReverseTextEnv): 'messages'" (a bare KeyError),
    a row without a user turn a StopIteration traceback, and `lit-rl evaluate` read neither until its
    server had started (or, on a server of the user's, failed each step and exited 0)."""
    from helpers import TINY_MODEL

    completions = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "abc", "completion": "cba"}])
    no_user = write_jsonl(tmp_path / "no_user.jsonl", reverse_rows(2) + [{"messages": [{"role": "assistant", "content": "x"}]}])
    grpo = ["fit", "--config", "examples/reverse_text/grpo.yaml", "--model.init_args.model", TINY_MODEL,
            "--trainer.default_root_dir", str(tmp_path / "run")]
    err = user_error([*grpo, "--data.init_args.env.init_args.path", completions], capsys)
    assert f"ReverseTextEnv: {completions} has no 'messages' column (columns: ['prompt', 'completion'])" in err, err
    err = user_error([*grpo, "--data.init_args.env.init_args.path", no_user], capsys)
    assert f"ReverseTextEnv: row 2 of {no_user} has no user turn with text content" in err, err
    assert not list(tmp_path.glob("run/**/vllm*.log"))  # refused before any server started

    weights = tmp_path / "evaluated" / "weights"
    weights.mkdir(parents=True)
    for path, said in ((completions, "has no 'messages' column"), (no_user, "row 2 of")):
        err = user_error(["evaluate", "--weights-dir", str(weights), "--env", "lit_rl.rollouts.ReverseTextEnv",
                          "--env-args", json.dumps({"path": path}), "--base-url", "http://127.0.0.1:9/v1"], capsys)
        assert "--env / --env-args or the plan's environments: ReverseTextEnv:" in err and said in err, err
    assert not (tmp_path / "evaluated" / "evals").exists()


def test_eval_chat_template_variables_that_lit_rl_sets_itself_are_refused_before_any_server(tmp_path, capsys):
    """Otherwise every eval failed at its first prompt (a TypeError: the generation prompt or the tools given twice).
    Also an eval dataset that cannot be read."""
    from lit_rl.callbacks import OnlineEval
    from lit_rl.rollouts import ReverseTextEnv

    data = write_jsonl(tmp_path / "test.jsonl", reverse_rows(2))
    with pytest.raises(ValueError, match=r"OnlineEval: chat_template_kwargs may not set \['add_generation_prompt'\]"):
        OnlineEval(envs=[ReverseTextEnv(path=data)], chat_template_kwargs={"add_generation_prompt": False})
    OnlineEval(envs=[ReverseTextEnv(path=data)], chat_template_kwargs={"enable_thinking": False})
    # an eval's data is read when the callback is made: before, a missing file failed every eval, in evaluator.log only
    with pytest.raises(ValueError, match=r"OnlineEval: environment 'held_out': no such file .*nope.jsonl"):
        OnlineEval(envs=[ReverseTextEnv(path=str(tmp_path / "nope.jsonl"), name="held_out")])
    from online_eval_helpers import ScoreFixedIds

    OnlineEval(envs=[ScoreFixedIds()])  # a custom eval with `evaluate` alone has no rows to read
    weights = tmp_path / "run" / "weights"
    weights.mkdir(parents=True)
    err = user_error(["evaluate", "--weights-dir", str(weights), "--env", "lit_rl.rollouts.ReverseTextEnv",
                      "--env-args", json.dumps({"path": data}), "--chat-template-kwargs", '{"tools": []}'], capsys)
    assert "--chat-template-kwargs: chat_template_kwargs may not set ['tools']" in err, err
    assert not (tmp_path / "run" / "evals").exists()


def test_serve_names_the_flag_of_a_value_the_server_refuses(capsys):
    """Before: `--tensor-parallel-size 0` and `--gpu-memory-utilization 2` were a ValueError's
    traceback naming VLLMServer's parameter, `--port 70000` an OverflowError's, and `-- --host
    0.0.0.0` bound every interface without the warning (vLLM takes the last --host)."""
    model = ["serve", "--model", "lit-rl:tiny_qwen3"]
    for given, said in ((["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
                        (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be in (0, 1], got 2.0"),
                        (["--port", "70000"], "--port must be in 1-65535"),
                        # these three were vLLM's refusal after its start-up, or (max-model-len 0) the model's length
                        (["--dtype", "bf16"], "--dtype must be one of auto, bfloat16, float16, float32, half, float, "
                                              "got 'bf16'"),
                        (["--max-model-len", "0"], "--max-model-len must be >= 1 (None: the checkpoint's own), got 0"),
                        (["--generation-config", "nope"], "--generation-config must be vllm, auto or a directory "
                                                          "with a generation_config.json, got 'nope'"),
                        # the flags' names inside other words stay as they are
                        (["--no-dev-mode", "--", "--logprobs-mode", "raw_logprobs"],
                         "the options passed on to vLLM must not set --logprobs-mode: lit-rl passes it to vLLM itself, "
                         "and the last one given wins, unchecked; lit-rl's servers always use processed_logprobs, the "
                         "log-probabilities the trainer computes"),
                        (["--startup-timeout", "-5"], "--startup-timeout must be > 0 seconds, got -5.0"),
                        (["--", "--host", "0.0.0.0"], ("the options passed on to vLLM must not set --host: lit-rl "
                                                       "passes it to vLLM itself, and the last one given wins, "
                                                       "unchecked; use the --host option instead"))):
        err = user_error([*model, *given], capsys)
        assert f"lit-rl serve: error: {said}" in err, err


def test_serve_names_a_hub_model_it_cannot_get_offline_before_vllm_starts(capsys, monkeypatch):
    """With the hub switched off, a hub name that is not in the hub cache was vLLM's traceback some
    20 s into its start-up; docs/cli.md promises one message with the fix."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = user_error(["serve", "--model", "lit-rl-tests/no-such-model"], capsys)
    assert "--model lit-rl-tests/no-such-model is not a local directory, and the hub is switched off (HF_HUB_OFFLINE=1) " \
           "with no copy of it in the hub cache" in err, err


def test_evaluate_refuses_an_api_key_variable_that_is_not_set(tmp_path, capsys, monkeypatch):
    """Before: `--api-key-env NAME` with NAME unset sent no key, and every eval failed on a 401."""
    weights = tmp_path / "run" / "weights"
    (weights / "step_0").mkdir(parents=True)
    (weights / "step_0" / "STABLE").touch()
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    err = user_error(["evaluate", "--weights-dir", str(weights), "--env", "lit_rl.rollouts.ReverseTextEnv",
                      "--base-url", "http://127.0.0.1:9/v1", "--api-key-env", "NO_SUCH_KEY_VAR"], capsys)
    assert "--api-key-env NO_SUCH_KEY_VAR: the environment variable NO_SUCH_KEY_VAR is not set or is empty" in err, err
