"""LoRA (lit_rl.lora): only the adapter trains; its exports load in peft, transformers and vLLM;
the merged export equals the adapted model; bad options fail before training."""

import asyncio
import json
import math

import lightning as L
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from lit_rl.callbacks import HFExport
from lit_rl.data.datamodules import StaticDataModule
from lit_rl.errors import ConfigError
from lit_rl.inference.client import ContextLengthError
from lit_rl.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRAOptions, adapter_disabled
from lit_rl.modules.sft import SFT
from lit_rl.run_dir import STABLE, base_dir, step_dir
from helpers import TINY_MODEL, reverse_rows, write_jsonl


def lora_sft(tmp_path, steps, callbacks=(), lora=LoRAOptions(rank=8, alpha=16), lr=1e-2, **trainer_kw):
    L.seed_everything(0)
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    module = SFT(model=TINY_MODEL, random_init=True, lora=lora, optimizer=lambda p: torch.optim.AdamW(p, lr=lr))
    dm = StaticDataModule(data, batch_size=4, num_workers=0, max_length=64, micro_batch_tokens=256)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=str(tmp_path / "run"),
        callbacks=list(callbacks), **trainer_kw,
    )
    trainer.fit(module, datamodule=dm)
    return module, trainer, tmp_path / "run"


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


IDS = [5, 17, 60, 101, 33, 2, 250, 9]


# all-linear, and an adapter on the embedding that the tiny Qwen3's head is tied to: its merged export
# had the delta in the head too (PEFT's merge of the shared tensor), 2.6 off the trained model's logits
@pytest.mark.parametrize("targets", ["all-linear", ["embed_tokens", "q_proj"]])
def test_only_the_adapter_trains_and_its_exports_load_as_the_trained_model(tmp_path, targets):
    module, trainer, root = lora_sft(tmp_path, 3, [HFExport(merged=True)],
                                     lora=LoRAOptions(rank=8, alpha=16, target_modules=targets))
    model = module.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    optimizer = trainer.optimizers[0]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in optimizer.state} == in_optimizer  # AdamW state for the adapter only

    # the base did not move: it equals a fresh build of the same seed
    L.seed_everything(0)
    fresh = SFT(model=TINY_MODEL, random_init=True)
    fresh.configure_model()
    with adapter_disabled(model):
        torch.testing.assert_close(logits(model, IDS), logits(fresh.model, IDS), atol=0, rtol=0)
    trained = logits(model, IDS)
    assert not torch.allclose(trained, logits(fresh.model, IDS), atol=1e-3)  # ... and the adapter did

    final = step_dir(root, 3)
    assert (final / STABLE).is_file() and (base_dir(root) / STABLE).is_file()
    assert not (final / "model.safetensors").exists()  # the adapter only
    config = json.loads((final / ADAPTER_CONFIG).read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["base_model_name_or_path"] == str(base_dir(root).resolve())
    with safe_open(final / ADAPTER_WEIGHTS, "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.") and ".lora_" in k for k in keys)

    # peft's own loader, transformers' from_pretrained of the adapter directory, and the merged checkpoint
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir(root))
    torch.testing.assert_close(logits(PeftModel.from_pretrained(base, final), IDS), trained, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(final), IDS), trained, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(final / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, IDS), trained, atol=1e-4, rtol=0)
    # untied only where the adapter is on the embedding (the head keeps the base weight)
    assert json.loads((final / "merged" / "config.json").read_text())["tie_word_embeddings"] == (targets == "all-linear")


@pytest.mark.parametrize("targets", [["c_attn", "c_fc"], ["wte", "c_proj"]])
def test_the_merged_weights_give_the_adapted_models_logits_for_conv1d_layers_and_a_tied_embedding(targets):
    """GPT-2 stores its Conv1D weights as (in, out) (PEFT's fan_in_fan_out) and ties its head to the
    embedding: the merge of the gathered state dict (HFExport's `merged: true`) failed on the first.
    An adapter on the tied embedding changes its lookups, not the head: PEFT's merge_and_unload
    merges the shared tensor, moving the head too, so the merge keeps the head's base weight and
    the merged weights are untied. Compared with the adapted (unmerged) model's logits."""
    import copy

    import transformers
    from peft import LoraConfig, get_peft_model

    from lit_rl.lora import merged_state, unties

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = get_peft_model(transformers.GPT2LMHeadModel(config),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    state = {k.removeprefix("base_model.model."): v for k, v in model.state_dict().items()}
    merged = merged_state(model, state)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for name in want:  # PEFT's merge, but for the head tied to an adapted embedding
        expected = state["transformer.wte.base_layer.weight"] if "wte" in targets and name == "lm_head.weight" else want[name]
        torch.testing.assert_close(merged[name], expected, atol=1e-5, rtol=0, msg=name)
    assert unties(model, merged) == ("wte" in targets)
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config.to_dict(), "tie_word_embeddings": False}))
    plain.load_state_dict(merged)
    torch.testing.assert_close(logits(plain, IDS), logits(model, IDS), atol=1e-5, rtol=0)


def test_a_target_module_that_matches_nothing_names_the_flag_and_the_layers(tmp_path):
    with pytest.raises(ConfigError, match=r"model.lora.target_modules \['qproj'\].*q_proj"):
        lora_sft(tmp_path, 1, lora=LoRAOptions(rank=4, target_modules=["qproj"]))
    # the head is applied by the losses themselves: an adapter there stayed at B = 0 (its norm 0.0 after 2 steps)
    with pytest.raises(ConfigError, match=r"takes in the output head \(lm_head\).*would not train; leave it out"):
        lora_sft(tmp_path, 1, lora=LoRAOptions(rank=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="model.lora: rank must be an int >= 1"):
        LoRAOptions(rank=0)
    # not numbers, or not finite: rank True was taken as rank 1, alpha inf made every update infinite
    with pytest.raises(ValueError, match=r"rank must be an int >= 1, got True; alpha must be a finite number > 0, "
                                         r"got inf; dropout must be in \[0, 1\), got '0.1'"):
        LoRAOptions(rank=True, alpha=math.inf, dropout="0.1")
    with pytest.raises(ValueError, match="alpha must be a finite number > 0, got '16'"):
        LoRAOptions(alpha="16")
    assert LoRAOptions(rank=12).server_max_rank == 16 and LoRAOptions(rank=8).server_max_rank == 8


@pytest.mark.slow
@pytest.mark.long
def test_grpo_with_lora_serves_the_trained_adapter_and_its_online_evals_score_each_step(tmp_path, tiny_model_path):
    """The policy's managed server starts on the base with LoRA on and every sync loads the new
    adapter: at staleness 0 the sampler's logprobs equal the trainer's at every step
    (mismatch_kl ~ 0) while the policy moves away from its base (kl_to_reference > 0, the
    reference being the adapter switched off). The online evals' own managed server serves each
    exported step's adapter on the same base: the served log-probabilities of fixed ids at steps 0
    and 3 are those of each step's adapted model in peft."""
    import csv
    import os
    import subprocess

    import yaml
    from peft import PeftModel

    from helpers import REPO
    from lit_rl.eval.logging import read_eval_metrics
    from online_eval_helpers import ScoreFixedIds
    from test_cli import run
    from test_grpo_cli import CONFIG, grpo_args

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(40))
    root = tmp_path / "run"
    config = yaml.safe_load(open(CONFIG))
    config["trainer"]["callbacks"].append({"class_path": "lit_rl.callbacks.OnlineEval", "init_args": {
        "server": {"dtype": "float32", "max_model_len": 256, "enforce_eager": True}, "final_timeout": 300,
        "envs": [{"class_path": "online_eval_helpers.ScoreFixedIds"},
                 {"class_path": "lit_rl.rollouts.ReverseTextEnv",  # the built-in eval: chat, the base's tokenizer
                  "init_args": {"path": write_jsonl(tmp_path / "held_out.jsonl", reverse_rows(2, offset=50)),
                                "max_tokens": 8}}]}})
    (tmp_path / "grpo_lora.yaml").write_text(yaml.safe_dump(config))
    args = grpo_args(root, data, tiny_model_path, 3, "--model.init_args.random_init", "true",
                     "--model.init_args.lora.rank", "8", "--model.init_args.lora.alpha", "16",
                     "--model.init_args.kl_coef", "0.05", "--model.init_args.optimizer.init_args.lr", "0.02",
                     "--data.init_args.max_staleness", "0", "--seed_everything", "7")
    args[args.index(CONFIG)] = str(tmp_path / "grpo_lora.yaml")
    result = run(args, env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [r for path in root.glob("logs/version_*/metrics.csv") for r in csv.DictReader(open(path))
            if r.get("train/mismatch_kl")]
    assert len(rows) == 3
    assert all(float(r["train/mismatch_kl"]) < 1e-3 for r in rows), [r["train/mismatch_kl"] for r in rows]
    assert float(rows[-1]["train/kl_to_reference"]) > 1e-4  # the served adapter is not the base
    assert all(float(r["train/weight_sync_s"]) > 0 for r in rows[:-1])
    base_bytes = (base_dir(root) / "model.safetensors").stat().st_size
    synced = sorted((root / "sync").glob("step_*"))
    assert synced
    for path in synced:
        assert not (path / "model.safetensors").exists(), path
        assert (path / ADAPTER_WEIGHTS).stat().st_size * 5 < base_bytes, path
    assert "lit-rl-policy" in (root / "vllm.log").read_text()
    assert "seed=7," in (root / "vllm.log").read_text()  # the policy's sampler follows the run's seed

    (log_dir,) = [p.parent for p in root.glob("logs/version_*/eval_metrics.csv")]  # beside the trainer's metrics
    served = {r["step"]: r["value"] for r in read_eval_metrics(log_dir) if r["name"] == "eval/score/logprob_sum"}
    assert sorted(served) == [0, 3], served
    ids = ScoreFixedIds.IDS
    for step, value in served.items():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir(root)), step_dir(root, step))
        lp = torch.log_softmax(logits(model, ids)[0].double(), -1)
        assert value == pytest.approx(sum(lp[i - 1, ids[i]].item() for i in range(1, len(ids))), abs=1e-3), step
    assert abs(served[0] - served[3]) > 1e-2  # a stale adapter (or the base) at step 3 would show
    rewards = {r["step"] for r in read_eval_metrics(log_dir) if r["name"] == "eval/reverse_text/reward"}
    assert rewards == {0, 3}, (root / "evals" / "done.jsonl").read_text() if (root / "evals" / "done.jsonl").exists() else ""
    left = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"


def test_lora_with_a_server_that_cannot_load_adapters_fails_before_training(vllm_server, tmp_path):
    """An existing server (inference.base_url) started without runtime LoRA loading."""
    from test_cli import run
    from test_grpo_cli import grpo_args, shared

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    root = tmp_path / "run"
    result = run(grpo_args(root, data, str(vllm_server.model_dir), 2, *shared(vllm_server),
                           "--model.init_args.lora.rank", "8"))
    assert result.returncode == 1
    error = [line for line in result.stderr.splitlines() if line.startswith("lit-rl fit: error:")]
    assert len(error) == 1 and "model.lora" in error[0] and "--enable-lora" in error[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not list(root.glob("rollouts/trained.jsonl"))  # nothing trained


def resume_lora_sft(tmp_path, ckpt, seed=0, lora=LoRAOptions(rank=8, alpha=16), steps=4, callbacks=()):
    """A fresh module (its base a random init from `seed`) fitted from `ckpt` to `steps`."""
    L.seed_everything(seed)
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    resumed = SFT(model=TINY_MODEL, random_init=True, lora=lora, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = StaticDataModule(data, batch_size=4, num_workers=0, max_length=64, micro_batch_tokens=256)
    L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, use_distributed_sampler=False,
              default_root_dir=str(tmp_path / "split" / "run"), callbacks=list(callbacks)).fit(resumed, datamodule=dm,
                                                                                              ckpt_path=ckpt)
    return resumed


def test_a_resumed_lora_run_continues_exactly_from_a_checkpoint_without_the_base(tmp_path):
    """Two steps, a checkpoint, two more from it: the adapter and the AdamW state come back exactly.
    The checkpoint holds the adapter and a fingerprint of the frozen base, not the base: the resumed
    run loads the base again (here the same random init), and a run on another base, or without
    the adapter, is refused with one message before anything trains."""
    straight, _, _ = lora_sft(tmp_path / "straight", 4)
    first, trainer, root = lora_sft(tmp_path / "split", 2, callbacks=[HFExport(every_n_steps=2)])
    base_written = (base_dir(root) / "model.safetensors").stat().st_mtime_ns
    ckpt = tmp_path / "split.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False, map_location="cpu")  # written by this test
    adapter = {n for n, p in first.named_parameters() if p.requires_grad}
    assert set(saved["state_dict"]) == adapter  # no frozen tensor, the tied head's second name included
    assert set(saved["lit_rl"]["frozen_base"]) == {n for n, p in first.named_parameters() if not p.requires_grad}
    whole = sum(t.numel() for t in first.state_dict().values())
    assert sum(t.numel() for t in saved["state_dict"].values()) < whole / 10

    resumed = resume_lora_sft(tmp_path, ckpt, callbacks=[HFExport(every_n_steps=2)])
    # the resumed run exports its adapter over the base its first launch wrote, which it keeps as it was
    assert (step_dir(root, 4) / ADAPTER_WEIGHTS).is_file()
    assert (base_dir(root) / "model.safetensors").stat().st_mtime_ns == base_written
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for name in a:  # the adapter as trained straight through, and the base as built
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=name)

    with pytest.raises(ConfigError, match=r"trained on another base than this run's model .*differs \(L2 norm"):
        resume_lora_sft(tmp_path, ckpt, seed=1)
    with pytest.raises(ConfigError, match="holds a LoRA adapter without its base .*model.init_args.lora"):
        resume_lora_sft(tmp_path, ckpt, lora=None)
    # another alpha resumed silently, rescaling the trained adapter 4x (the resumed step's loss 6.73, not 4.87); another
    # rank stopped in Lightning's state-dict load, other targets as "another base": each is named, before training
    with pytest.raises(ConfigError, match=r"another model.init_args.lora than this run's: alpha 16.0 in the checkpoint, "
                                          r"64.0 here; resume with the checkpoint's"):
        resume_lora_sft(tmp_path, ckpt, lora=LoRAOptions(rank=8, alpha=64))
    with pytest.raises(ConfigError, match=r"rank 8 in the checkpoint, 16 here, target_modules 'all-linear' in the "
                                          r"checkpoint, \['q_proj'\] here"):
        resume_lora_sft(tmp_path, ckpt, lora=LoRAOptions(rank=16, alpha=16, target_modules=["q_proj"]))
    resume_lora_sft(tmp_path, ckpt, lora=LoRAOptions(rank=8, alpha=16, dropout=0.1), steps=3)  # dropout may change
    # a full fine-tuning checkpoint resumed with an adapter: Lightning's "Missing key(s)" of every adapter tensor
    _, full, _ = lora_sft(tmp_path / "full", 1, lora=None)
    full.save_checkpoint(tmp_path / "full.ckpt")
    with pytest.raises(ConfigError, match=r"holds no LoRA adapter .*resume it without model.init_args.lora"):
        resume_lora_sft(tmp_path, tmp_path / "full.ckpt")


@pytest.mark.slow
@pytest.mark.long
def test_opd_with_lora_on_an_existing_server_trains_the_served_adapter_and_a_rank_above_its_max_is_refused(tmp_path):
    """OPD with LoRA against an existing server (inference.base_url) started on the student with
    run-time LoRA loading and `--max-lora-rank 8`. Rank 16 is refused before training, with one
    message naming model.lora and the server's limit. Rank 8 trains: every sync loads only the
    adapter, the sampler's logprobs are the trainer's at every step (mismatch_kl ~ 0 at staleness
    0: the sampled-token reverse KL to a teacher in the trainer's process reads them), and after
    the run the server gives fixed ids the log-probabilities of the last synced adapter in peft,
    far from the base's."""
    from peft import PeftModel

    from lit_rl.inference.server import VLLMServer
    from lit_rl.lora import lora_server_options
    from test_cli import metrics_rows, run
    from test_opd import opd_args
    from vllm_fixtures import write_tiny_checkpoint

    student = write_tiny_checkpoint(tmp_path / "student", seed=0)
    teacher = write_tiny_checkpoint(tmp_path / "teacher", seed=1, logit_scale=4.0)
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(16))
    server = VLLMServer(student, **lora_server_options(
        {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "startup_timeout": 300,
         "log_path": tmp_path / "vllm.log"}, 8))

    def opd(root, rank, steps):
        return run(opd_args(root, data, str(student), steps, "--inference.base_url", server.base_url, "--inference.server", "{}",
                            "--inference.teacher_model", "null", "--inference.teacher_server", "{}",
                            "--model.init_args.teacher_model", str(teacher),
                            "--model.init_args.divergence", "sampled_reverse_kl", "--model.init_args.lora.rank", str(rank), "--model.init_args.lora.alpha", str(2 * rank),
                            "--model.init_args.optimizer.init_args.lr", "0.05", "--data.init_args.max_staleness", "0",
                            "--trainer.log_every_n_steps", "1"))

    async def served_logprob_sums():  # of fixed ids, by the adapter the run loaded last and by the base
        async with server.client(model="lit-rl-policy") as adapted, server.client(model=str(student)) as base:
            # an adapter's card has no context length: the client takes its base's (a full transcript is refused)
            assert await adapted.max_model_len() == 256
            with pytest.raises(ContextLengthError):
                await adapted.generate([100] * 256, max_tokens=1)
            return sum(await adapted.score(IDS)), sum(await base.score(IDS))

    with server:
        refused, trained = opd(tmp_path / "rank16", 16, 2), opd(tmp_path / "rank8", 8, 3)
        by_adapter, by_base = asyncio.run(served_logprob_sums())
    assert refused.returncode == 1
    error = [line for line in refused.stderr.splitlines() if line.startswith("lit-rl fit: error:")]
    assert len(error) == 1 and "model.lora (rank 16)" in error[0] and "max_lora_rank" in error[0], refused.stderr[-3000:]
    assert not list((tmp_path / "rank16").glob("logs/version_*/metrics.csv"))  # nothing trained

    assert trained.returncode == 0, trained.stderr[-4000:]
    root = tmp_path / "rank8"
    rows = [r for r in metrics_rows(root) if r.get("train/reverse_kl")]
    assert len(rows) == 3
    assert all(float(r["train/mismatch_kl"]) < 1e-3 for r in rows), [r["train/mismatch_kl"] for r in rows]
    synced = sorted((root / "sync").glob("step_*"), key=lambda path: int(path.name[5:]))
    assert synced and all(not (path / "model.safetensors").exists() and (path / ADAPTER_WEIGHTS).is_file()
                          for path in synced), synced
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(student), synced[-1])
    lp = torch.log_softmax(logits(model, IDS)[0].double(), -1)
    assert by_adapter == pytest.approx(sum(lp[i - 1, IDS[i]].item() for i in range(1, len(IDS))), abs=1e-3)
    assert abs(by_adapter - by_base) > 1e-2  # the adapter moved: serving the base would have shown
