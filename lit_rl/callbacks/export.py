"""HFExport: writes `weights/step_<N>/` HF checkpoints while training runs.

Every `every_n_steps` optimizer steps and after the last step, the full model is
written as safetensors with its config, tokenizer, chat template and generation
config, following the STABLE protocol of the run directory (lit_rl/run_dir.py), so
`from_pretrained`, vLLM and the evaluator can read it while training goes on.

HFExport is the one owner of exports and their retention. Other callbacks do not
patch it or write checkpoints themselves; they register as consumers:

- `register(consumer)`: the consumer's `export_due(step)` says that a checkpoint must
  exist at that step (online evals), its `needs(path)` that retention must spare a
  step directory for now (not yet evaluated);
- `ensure(trainer, module, step)`: a checkpoint of this step, exported if not yet;
- `sync_export(trainer, module, step)`: the weights of this step for the policy's
  inference server (RL weight sync), in `sync/step_N`: no fsync (nothing is lost if
  the machine dies, training re-exports), `keep_sync` newest kept; a checkpoint of
  the same step is reused instead of written twice.

A model with a LoRA adapter (`model.init_args.lora`) exports the adapter only, in PEFT's format
(`lit_rl.lora`), in every `weights/step_N` and `sync/step_N`; its frozen base is written once per
run to `weights/base` (what the policy's server serves the adapter on, and the adapter's
`base_model_name_or_path`). With `merged`, `weights/step_N/merged` also holds the plain model with
the adapter merged in.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_rl.callbacks.step_files import StepFiles, learn_step_files
from lit_rl.eval.plan import DoneLog, evals_dir
from lit_rl.lora import adapter_state, base_state, has_adapter, merged_state, unties, write_adapter
from lit_rl.model_names import load_tokenizer
from lit_rl.modules.model_loading import resolve_dtype
from lit_rl.run_dir import STABLE, base_dir, fsync_written, in_use, stable_steps, step_dir, step_of, sync_dir, unfinished
from lit_rl.sharding import is_sharded

log = logging.getLogger(__name__)


class ExportError(OSError):
    """Writing a step directory failed (disk full, unwritable directory); earlier steps are intact."""


def forget_evals(root: Path, resumed_at: int | None) -> None:
    """The evals of weights this run removes (those of `lit-rl evaluate` and of OnlineEval alike): a
    fresh run removes `evals/`, whose metrics and records describe the earlier run's checkpoints (`lit-rl
    report` drew them beside the new run's loss, and `lit-rl evaluate` took their steps for done); a
    resume forgets the records past its step, which a discarded future wrote."""
    if resumed_at is None:
        if evals_dir(root).is_dir():
            shutil.rmtree(evals_dir(root), ignore_errors=True)
            rank_zero_info(f"HFExport: removed {evals_dir(root).relative_to(root)}/ of an earlier run (fresh start)")
    else:
        DoneLog(root).forget_after(resumed_at)


class HFExport(L.Callback):
    def __init__(
        self, every_n_steps: int | None = None, keep_last: int | None = None, dtype: str | None = None, keep_sync: int = 2,
        merged: bool = False,
    ):
        """
        Args:
            every_n_steps: export every N optimizer steps; None exports only after the last step.
            keep_last: keep this many newest step directories; None keeps all.
            dtype: dtype of the saved weights (float32, bfloat16, float16); default: training dtype.
            keep_sync: weight-sync exports kept in ``sync/`` (RL), the newest; at least 1.
            merged: with a LoRA adapter, also write the model with the adapter merged in, a plain HF
                checkpoint, to ``weights/step_N/merged`` (the adapter alone is always written).
        """
        if keep_sync < 1:
            raise ValueError(f"HFExport.keep_sync must be >= 1, got {keep_sync}")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"HFExport.every_n_steps must be >= 1 or None, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"HFExport.keep_last must be >= 1 or None, got {keep_last}")
        self.every_n_steps, self.keep_last, self.keep_sync = every_n_steps, keep_last, keep_sync
        self.merged = merged
        self._base_written_for = None  # the run (trainer) whose LoRA base is in weights/base
        self._consumers: list = []
        self.dtype = resolve_dtype(dtype) if dtype else None
        self.last_exported: int | None = None
        self._loaded_tokenizer = None
        self._prepared_for = None
        self._step_files: StepFiles | None | bool = None  # learnt at the run's first export; False: keep the general path

    def _tokenizer(self, pl_module):
        """Loaded once per run (`prepare_run` forgets it): every export of a run writes the same tokenizer files."""
        if self._loaded_tokenizer is None:
            self._loaded_tokenizer = load_tokenizer(pl_module.tokenizer_name, trust_remote_code=pl_module.trust_remote_code)
        return self._loaded_tokenizer

    # ---- a run's start: the weights/ directory must describe this run only ------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self.prepare_run(trainer)

    def prepare_run(self, trainer) -> None:
        """Fresh run: remove steps an earlier run left in this root, checkpoints (`weights/`) and
        weight syncs (`sync/`). Resume: remove only the steps past the resume point (they belong to
        a future this run will rewrite). Once per run, before its first export: OnlineEval calls it
        before exporting step 0, `sync_export` before the first sync. Collective."""
        if self._prepared_for is trainer:
            return
        self._prepared_for = trainer
        # learnt again: the module (its tokenizer, its tensors) may differ from the last run's, and a step
        # number the last run exported says nothing of this run's (a second fit with the same callbacks)
        self._step_files = None
        self._loaded_tokenizer = None
        self.last_exported = None
        root = Path(trainer.default_root_dir)
        resumed = trainer.ckpt_path is not None
        if trainer.is_global_zero:
            synced = [p for p in sync_dir(root).iterdir() if p.is_dir()] if sync_dir(root).is_dir() else []
            stale = [p for s, p in stable_steps(root).items() if not resumed or s > trainer.global_step] + unfinished(root)
            stale += [p for p in synced if p.name.endswith(".tmp") or (
                step_of(p) is not None and (not resumed or step_of(p) > trainer.global_step))]
            for path in stale:
                shutil.rmtree(path, ignore_errors=True)
            if stale:
                why = f"past the resume step {trainer.global_step}" if resumed else "from an earlier run (fresh start)"
                names = ", ".join(str(p.relative_to(root)) for p in stale)
                rank_zero_info(f"HFExport: removed {len(stale)} exported step(s) {why}: {names}")
            forget_evals(root, None if not resumed else trainer.global_step)
        trainer.strategy.barrier("hf_export_start")
        if trainer.global_step in stable_steps(root):
            self.last_exported = trainer.global_step  # resumed exactly at an exported step

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if trainer.is_global_zero:  # never leave a half-written step behind
            for path in unfinished(trainer.default_root_dir):
                shutil.rmtree(path, ignore_errors=True)

    # ---- consumers -------------------------------------------------------------------------------
    def register(self, consumer) -> None:
        """A consumer with `export_due(step) -> bool` and `needs(path) -> bool` (see module docstring)."""
        if consumer not in self._consumers:
            self._consumers.append(consumer)

    # ---- when ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        periodic = bool(self.every_n_steps) and step % self.every_n_steps == 0
        return periodic or any(c.export_due(step) for c in self._consumers)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.due(trainer.global_step):
            self.ensure(trainer, pl_module, trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.ensure(trainer, pl_module, trainer.global_step)

    def ensure(self, trainer, pl_module, step: int) -> Path:
        """A checkpoint of `step` (the current weights), exported unless it already was. Collective."""
        if self.last_exported == step:
            return step_dir(trainer.default_root_dir, step)
        return self.export(trainer, pl_module, step)

    # ---- what ----------------------------------------------------------------------------------
    def full_state_dict(self, trainer, pl_module) -> dict[str, torch.Tensor]:
        """Collective: every rank takes part in gathering; rank 0 gets the full tensors."""
        model = pl_module.model
        if trainer.world_size > 1 or is_sharded(model):  # FSDP2 parameters are DTensors, even on one rank
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = model.state_dict()
        cast = self.dtype
        state = {k: (v.to(cast) if cast and v.is_floating_point() else v).detach().cpu().contiguous() for k, v in state.items()}
        # Tied parameters (one parameter under several names, e.g. the head and the embeddings) come
        # back from a gather as separate copies: make them one tensor again, so save_pretrained
        # writes them once, as it does for an unsharded model.
        first: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in state:
                state[name] = state[first.setdefault(id(param), name)]
        return state

    def export(self, trainer, pl_module, step: int) -> Path:
        """Collective under multi-process strategies; rank 0 writes."""
        root = Path(trainer.default_root_dir)
        final = step_dir(root, step)
        fill = self._filler(trainer, pl_module, durable=True)
        if trainer.is_global_zero:
            self._write(final, fill)
            self._apply_retention(root)
        trainer.strategy.barrier("hf_export")
        self.last_exported = step
        return final

    def sync_export(self, trainer, pl_module, step: int) -> Path:
        """The current weights (of `step`) for the inference server: this step's checkpoint if one
        was written, else `sync/step_N` without fsync; the newest `keep_sync` are kept. Collective."""
        self.prepare_run(trainer)  # the run's first sync may come first (InferenceRuntime's HFExport is not a callback)
        root = Path(trainer.default_root_dir)
        if self.last_exported == step and (step_dir(root, step) / STABLE).is_file():
            return step_dir(root, step)
        fill = self._filler(trainer, pl_module, durable=False)
        final = sync_dir(root) / f"step_{step}"
        if trainer.is_global_zero:
            self._write(final, fill, durable=False)
            self._retain_syncs(root, final)
        trainer.strategy.barrier("hf_sync_export")
        return final

    def _retain_syncs(self, root: Path, written: Path) -> None:
        """Keep the newest `keep_sync` of `sync/`, the one just written, and any still in use (a
        lease, or a consumer's `needs`: the runtime's for what its server serves until the new one
        is loaded, which a restart in between loads again)."""
        synced = sorted((p for p in sync_dir(root).iterdir() if step_of(p) is not None), key=step_of)
        for path in synced[: max(0, len(synced) - self.keep_sync)]:
            if path != written and not self.in_use(path):
                shutil.rmtree(path, ignore_errors=True)

    def _filler(self, trainer, pl_module, durable: bool):
        """Gathers what one step directory holds (collective) and returns what fills it on rank 0."""
        model = pl_module.model
        if not has_adapter(model):
            state = self.full_state_dict(trainer, pl_module)
            if self._step_files:
                return lambda tmp: self._step_files.write(state, tmp)
            return lambda tmp: self._write_general(pl_module, state, tmp)
        base = self.ensure_base(trainer, pl_module)
        adapter = adapter_state(model)
        merged = merged_state(model, self.full_state_dict(trainer, pl_module)) if durable and self.merged else None

        def fill(tmp: Path) -> None:
            write_adapter(model, adapter, tmp, base=str(base.resolve()))
            if durable:  # a checkpoint for people and evals; the server's sync reads the two adapter files only
                self._tokenizer(pl_module).save_pretrained(tmp)
            if merged is not None:
                (tmp / "merged").mkdir()
                self._write_plain(pl_module, merged, tmp / "merged")
        return fill

    def ensure_base(self, trainer, pl_module) -> Path:
        """A LoRA model's frozen base weights in `weights/base`, written once per run. A resumed run
        keeps the one its first launch wrote (the checkpoint's fingerprint of the base was checked
        against this run's model when it loaded): rewriting it would cost a whole model's write
        and pull it from under an evaluator's server that is loading it. Collective."""
        path = base_dir(trainer.default_root_dir)
        if self._base_written_for is not trainer:
            kept = trainer.ckpt_path is not None and (path / STABLE).is_file()
            if not trainer.strategy.broadcast(kept):  # rank 0's view, so every rank takes part in the gather or none
                state = base_state(self.full_state_dict(trainer, pl_module))
                if trainer.is_global_zero:
                    self._write(path, lambda tmp: self._write_plain(pl_module, state, tmp))
            trainer.strategy.barrier("hf_export_base")
            self._base_written_for = trainer
        return path

    def _write(self, final: Path, fill, durable: bool = True) -> None:
        tmp = final.with_name(f".{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            fill(tmp)
            if durable:
                fsync_written(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            (final / STABLE).touch()
        except Exception as e:  # safetensors reports I/O failures as its own error type
            shutil.rmtree(tmp, ignore_errors=True)
            raise ExportError(f"HFExport: could not write {final}: {type(e).__name__}: {e}") from e
        if durable:
            rank_zero_info(f"exported {final}")

    def _write_general(self, pl_module, state: dict[str, torch.Tensor], tmp: Path) -> None:
        """save_pretrained + tokenizer; the first export of a run also learns the fast replay."""
        self._write_plain(pl_module, state, tmp)
        if self._step_files is None:
            self._step_files = learn_step_files(tmp, state) or False

    def _write_plain(self, pl_module, state: dict[str, torch.Tensor], tmp: Path) -> None:
        """A plain HF checkpoint of `state` (the model's own names): save_pretrained, config, tokenizer.
        Untied where `state` holds the head apart from the embedding it is tied to (a merged adapter
        on the embedding: `lit_rl.lora.merged_state`)."""
        config = pl_module.model.config
        tied = getattr(config, "tie_word_embeddings", False)
        if tied and unties(pl_module.model, state):
            config.tie_word_embeddings = False  # else save_pretrained drops the head and the loader re-ties it
        try:
            pl_module.model.save_pretrained(tmp, state_dict=dict(state), safe_serialization=True)  # it pops keys
        finally:
            config.tie_word_embeddings = tied
        if self.dtype is not None:
            cfg = json.loads((tmp / "config.json").read_text())
            cfg["dtype"] = cfg["torch_dtype"] = str(self.dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        self._tokenizer(pl_module).save_pretrained(tmp)

    def in_use(self, path: Path) -> bool:
        """Whether a consumer still needs this step directory; retention never deletes it then:
        a lease file is present (`lit_rl.run_dir.lease`) or a registered consumer `needs` it."""
        return in_use(path) or any(c.needs(Path(path)) for c in self._consumers)

    def _apply_retention(self, root: Path) -> None:
        if self.keep_last is None:
            return
        steps = stable_steps(root)
        for step in list(steps)[: max(0, len(steps) - self.keep_last)]:  # the newest are never candidates
            if not self.in_use(steps[step]):
                shutil.rmtree(steps[step], ignore_errors=True)
