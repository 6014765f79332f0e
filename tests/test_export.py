"""HFExport: exact, complete, STABLE-marked HF checkpoints; retention; failures that name the path."""

import json
import resource
import signal
import subprocess
import sys

import lightning as L
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_rl.callbacks import HFExport
from lit_rl.data.datamodules import StaticDataModule
from lit_rl.modules.sft import SFT
from lit_rl.run_dir import lease, stable_steps, step_dir, unfinished
from helpers import TINY_MODEL, reverse_rows, write_jsonl


def train(tmp_path, steps, callbacks, **trainer_kw):
    L.seed_everything(0)
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(32))
    module = SFT(model=TINY_MODEL, random_init=True, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = StaticDataModule(data, batch_size=4, num_workers=0, max_length=64, micro_batch_tokens=256)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=str(tmp_path / "run"),
        callbacks=callbacks, **trainer_kw,
    )
    trainer.fit(module, datamodule=dm)
    return module, tmp_path / "run"


def test_export_is_exact_complete_and_marked(tmp_path):
    module, root = train(tmp_path, 3, [HFExport(every_n_steps=2)])
    assert sorted(stable_steps(root)) == [2, 3]  # every 2 steps, and after the last one
    final = step_dir(root, 3)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", "STABLE"):
        assert (final / name).is_file(), name
    loaded = AutoModelForCausalLM.from_pretrained(final).eval()
    module.model.eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(final)("hello world").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, module.model(ids).logits, atol=1e-6, rtol=0)
    # tied embeddings round-trip: one stored tensor, the same values in both places
    assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    with safe_open(final / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32


def test_export_in_requested_dtype(tmp_path):
    _, root = train(tmp_path, 1, [HFExport(dtype="bfloat16")])
    final = step_dir(root, 1)
    with safe_open(final / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(final).dtype == torch.bfloat16


def test_keep_last_spares_leased_steps_and_fresh_run_cleans_up(tmp_path):
    export = HFExport(every_n_steps=1, keep_last=5)
    _, root = train(tmp_path, 3, [export])
    assert sorted(stable_steps(root)) == [1, 2, 3]
    export.keep_last = 1
    with lease(step_dir(root, 1), "evaluator"):  # a consumer (the evaluator, later) holds step 1
        export._apply_retention(root)
        assert sorted(stable_steps(root)) == [1, 3]  # spared while leased; the newest always kept
    export._apply_retention(root)
    assert sorted(stable_steps(root)) == [3]
    # a holder SIGKILLed while it holds its lease leaves the file behind: retention sees it is stale
    export.keep_last = 5
    train(tmp_path, 2, [export])
    export.keep_last = 1
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lit_rl.run_dir import lease\n"
                               "with lease(sys.argv[1], 'evaluator'):\n    print('held', flush=True); time.sleep(60)",
                               str(step_dir(root, 1))], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    export._apply_retention(root)
    assert sorted(stable_steps(root)) == [1, 2]  # held by a live process
    holder.kill()
    holder.wait()
    assert list(step_dir(root, 1).glob("LEASE.*")), "the killed holder's lease file should still be there"
    export._apply_retention(root)
    assert sorted(stable_steps(root)) == [2]
    # a fresh run into the same root starts from an empty weights/ (leftovers of all kinds go)
    (root / "weights" / "step_9").mkdir()
    (root / "weights" / ".step_10.tmp").mkdir()
    train(tmp_path, 2, [HFExport(every_n_steps=1)])
    assert sorted(stable_steps(root)) == [1, 2] and not unfinished(root)


def test_one_hfexport_in_two_fits_exports_each_runs_last_step(tmp_path):
    """The same callback object in a second `fit` (a notebook, a sweep reusing its callbacks): the
    fresh run removes the first run's step 2 and must write its own. It remembered having exported
    step 2 and skipped it: the second run ended with no export at all."""
    export = HFExport()
    for _ in range(2):
        _, root = train(tmp_path, 2, [export])
        assert sorted(stable_steps(root)) == [2]


def test_a_fresh_run_removes_the_evals_of_the_earlier_runs_weights(tmp_path):
    """`lit-rl evaluate` on a run (no OnlineEval), then a fresh run in the same directory: its
    records and metrics described weights the fresh run removed. They stayed: `lit-rl report` drew
    the old eval beside the new loss, and `lit-rl evaluate` took step 2 for done."""
    from lit_rl.eval.logging import EvalLogger, read_eval_metrics
    from lit_rl.eval.plan import DoneLog

    _, root = train(tmp_path, 2, [HFExport()])
    DoneLog(root).record(2, "rt", "ok")
    EvalLogger(root / "evals").log(2, {"eval/rt/reward": 0.9})
    _, root = train(tmp_path, 2, [HFExport()])
    assert DoneLog(root).entries == {} and read_eval_metrics(root / "evals") == []
    assert sorted(stable_steps(root)) == [2]


class SyncEveryStep(L.Callback):
    """What InferenceRuntime does after each step of an RL run: `sync_export` of the run's exporter,
    here one that is not itself a callback (the runtime's default HFExport)."""

    def __init__(self, export):
        self.export = export

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.export.sync_export(trainer, pl_module, trainer.global_step)


def test_a_fresh_run_removes_the_weight_syncs_of_an_earlier_run(tmp_path):
    """The syncs of an earlier run (full models in sync/, numbered past the new run's steps) stayed
    for ever, and retention removed the new run's own syncs in their place."""
    _, root = train(tmp_path, 4, [SyncEveryStep(HFExport(keep_sync=2))])
    assert sorted(p.name for p in (root / "sync").iterdir()) == ["step_3", "step_4"]
    (root / "sync" / ".step_5.tmp").mkdir()  # a sync cut short by a kill
    _, root = train(tmp_path, 2, [SyncEveryStep(HFExport(keep_sync=2))])
    assert sorted(p.name for p in (root / "sync").iterdir()) == ["step_1", "step_2"]


def test_failed_export_names_the_path_and_keeps_earlier_steps(tmp_path):
    """A real write failure: the file-size limit makes the weights file too large to write."""
    export = HFExport(every_n_steps=1)
    module, root = train(tmp_path, 1, [export])
    size = (step_dir(root, 1) / "model.safetensors").stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, hard))
    try:
        with pytest.raises(OSError, match=r"weights/step_2"):
            export.export(module.trainer, module, 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert sorted(stable_steps(root)) == [1] and not unfinished(root)
    assert AutoModelForCausalLM.from_pretrained(step_dir(root, 1)) is not None


def test_later_exports_write_the_same_bytes_as_save_pretrained(tmp_path):
    """After the first export of a run, HFExport replays the small files and writes the weights
    with plain safetensors; the result must equal what save_pretrained writes, byte for byte."""
    export = HFExport(every_n_steps=1)
    module, root = train(tmp_path, 3, [export])
    assert export._step_files, "the tiny Qwen3 should take the replay path after the first export"
    reference = tmp_path / "reference"
    module.model.save_pretrained(reference)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(reference)
    replayed = step_dir(root, 3)
    assert sorted(p.name for p in replayed.iterdir()) == sorted([p.name for p in reference.iterdir()] + ["STABLE"])
    for path in reference.iterdir():
        assert (replayed / path.name).read_bytes() == path.read_bytes(), path.name
    # and the replay wrote the new weights, not the first export's
    assert (step_dir(root, 1) / "model.safetensors").read_bytes() != (replayed / "model.safetensors").read_bytes()
