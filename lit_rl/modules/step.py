"""TrainingStep: one optimizer step per batch, in named parts (mixed into `CausalLMModule`).

A batch from a lit-rl data module is one whole optimizer step, already split into
micro-batches, so the step can count what its loss is divided by before any backward:

    counts = _step_counts(micro_batches)      # one collective: normalisers, tokens and step statistics
    sums = _backward(micro_batches, counts)   # each part's loss over its own count, backward
    grad_norm, lr = _optimizer_step()         # step (clipped inside), free the gradients, schedule
    _log_step(...)                            # one collective for every logged sum

The loss and gradient then do not depend on the micro-batch split, the gradient-accumulation
count or the number of ranks. The module supplies `micro_batch_loss_sum`, `loss_normaliser`
and `target_cross_entropy_sum` (lit_rl/modules/base.py), and `step_statistics` when its loss
needs a number of the whole step (OPD's step-mean baseline), read from `step_totals`.
"""

from __future__ import annotations

import resource
import sys
import time
from contextlib import nullcontext

import torch

from lit_rl import stopping


def trained_tokens(micro_batch: dict[str, torch.Tensor]) -> float:
    """Tokens whose prediction is trained (the first token of a row is predicted from nothing)."""
    return float(micro_batch["loss_mask"][:, 1:].sum())


class TrainingStep:
    # ---- the loss parts of a step: one per source ------------------------------------------------
    # A step's samples may come from several sources (the rollouts, replayed dataset rows; see
    # lit_rl/data/mixing.py). The rule, decided here once: every source is its own loss part, divided
    # by its own count over the whole step and all ranks (its `loss_normaliser`: tokens, or sequences
    # for GRPO's grpo/gspo; trained tokens for rows that feed the cross-entropy), and the step's loss
    # is the sum of the parts. A step from one source has one part, named "".
    @staticmethod
    def _part(micro_batch: dict) -> str:
        return micro_batch.get("part", "")

    def _feeds_cross_entropy(self, micro_batch: dict) -> bool:
        """A micro-batch of static or teacher rows in a run whose own loss is another (replay rows
        in GRPO or OPD, `lit_rl.data.mixing`): it gets the cross-entropy, not the algorithm's loss."""
        return micro_batch.get("loss") == "cross_entropy" and self.loss_kind != "cross_entropy"

    def _part_loss_sum(self, micro_batch: dict):
        if self._feeds_cross_entropy(micro_batch):
            return self.target_cross_entropy_sum(micro_batch)
        return self.micro_batch_loss_sum(micro_batch)

    def _part_normaliser(self, micro_batch: dict) -> float:
        if self._feeds_cross_entropy(micro_batch):
            return trained_tokens(micro_batch)
        return self.loss_normaliser(micro_batch)

    # ---- numbers of the whole step that a loss needs before its first backward -----------------
    #: the names `step_statistics` returns (the same on every rank: they go into one collective)
    step_statistic_names: tuple[str, ...] = ()
    #: during `training_step`: `_step_counts`' totals (the step statistics included); None otherwise
    step_totals: dict[str, torch.Tensor] | None = None

    def step_statistics(self, micro_batch: dict) -> dict[str, float | torch.Tensor]:
        """Sums over one of the algorithm's own micro-batches (not replayed cross-entropy rows)
        that `_step_counts` adds up over the step and all ranks before any backward; the loss
        reads the totals from `step_totals`. Default: none."""
        return {}

    def _empty_micro_batch(self) -> dict[str, torch.Tensor]:
        """Stands in when every row of this rank's step was skipped, so gradient sync still lines up."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        zeros = torch.zeros((1, 2), device=self.device)
        return {"input_ids": ids, "position_ids": torch.arange(2, device=self.device)[None], "loss_mask": ids.bool(),
                "sequence_ids": ids - 1, "logprobs": zeros, "advantages": zeros, "teacher_logprobs": zeros}

    def _step_micro_batches(self, batch: dict) -> list[dict]:
        """The step's micro-batches on this rank; an empty one stands in for each source of a mixed
        step that gave this rank nothing (or for a step with no rows), and more are added until
        every rank has as many micro-batches (of each source) as the rank with the most, so that every rank takes
        part in the same collectives and logs the same metric names. Equal counts matter under
        FSDP: each forward all-gathers each layer's weights, so a rank with one micro-batch more
        than another (equal samples, other lengths, a token budget) would wait for it forever."""
        parts = batch.get("parts") or []
        if not parts:  # one source
            own = list(batch["micro_batches"]) or [self._empty_micro_batch()]
            return own + [self._empty_micro_batch() for _ in range(self._most_over_ranks([len(own)])[0] - len(own))]
        # A mixed step, part by part in the step's order: the algorithm's frozen model (GRPO's
        # reference, OPD's teacher) runs on its own part's micro-batches only, and is sharded too,
        # so each part needs the same count on every rank, in the same place.
        by_part = {name: [mb for mb in batch["micro_batches"] if mb.get("part") == name] for name, _ in parts}
        most = self._most_over_ranks([max(1, len(by_part[name])) for name, _ in parts])
        return [mb for (name, loss), n in zip(parts, most) for mb in by_part[name]
                + [{**self._empty_micro_batch(), "part": name, "loss": loss} for _ in range(n - len(by_part[name]))]]

    def _most_over_ranks(self, counts: list[int]) -> list[int]:
        """Each of `counts`, its largest over the ranks (one collective under several processes)."""
        if self.trainer.world_size == 1:
            return counts
        most = self.trainer.strategy.reduce(torch.tensor(counts, dtype=torch.float32, device=self.device), reduce_op="max")
        return [int(n) for n in most.tolist()]

    # ---- one optimizer step per batch: counts, backward, optimizer, logging ---------------------
    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Collective under multi-process strategies: every rank must call it."""
        return self.trainer.strategy.reduce(value, reduce_op="sum")

    def _sum_named_over_ranks(self, values: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
        """Named numbers (the same names on every rank) summed over ranks in one collective."""
        names = sorted(values)
        stacked = torch.stack([torch.as_tensor(values[n], dtype=torch.float32, device=self.device) for n in names])
        return dict(zip(names, self._sum_over_ranks(stacked)))

    def _step_counts(self, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
        """Counted before any backward, over all micro-batches and ranks (one collective):
        ``targets`` (the step's trained tokens), and per part its ``normaliser/<part>`` and its
        trained ``tokens/<part>``, and the module's `step_statistics`."""
        local: dict[str, float] = {"targets": 0.0, **dict.fromkeys(self.step_statistic_names, 0.0)}
        for mb in micro_batches:
            part, targets = self._part(mb), trained_tokens(mb)
            if not self._feeds_cross_entropy(mb):
                for name, value in self.step_statistics(mb).items():
                    local[name] += value
            local["targets"] += targets
            local[f"normaliser/{part}"] = local.get(f"normaliser/{part}", 0.0) + self._part_normaliser(mb)
            local[f"tokens/{part}"] = local.get(f"tokens/{part}", 0.0) + targets
        return self._sum_named_over_ranks(local)

    def _skip_grad_sync(self, skip: bool):
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return block() if skip and block is not None else nullcontext()

    @staticmethod
    def _split_loss_output(out) -> tuple[torch.Tensor, dict]:
        return out if isinstance(out, tuple) else (out, {})

    def _backward(self, micro_batches: list[dict], counts: dict[str, torch.Tensor], mixed: bool) -> dict:
        """Forward and backward of every micro-batch, each part's loss divided by its own count.
        Returns what the step logs, as ``{name: [sum, count]}`` on this rank: ``loss_sum/<part>``
        and the module's metrics (per part too in a mixed step)."""
        self.optimizers().zero_grad(set_to_none=True)
        sums: dict[str, list] = {}

        def add(name: str, value, count) -> None:
            pair = sums.setdefault(name, [0.0, 0.0])
            pair[0], pair[1] = pair[0] + torch.as_tensor(value).detach().float(), pair[1] + float(count)

        for i, mb in enumerate(micro_batches):
            part = self._part(mb)
            with self._skip_grad_sync(i < len(micro_batches) - 1):
                loss_sum, metrics = self._split_loss_output(self._part_loss_sum(mb))
                # DDP/FSDP average gradients over ranks; multiplying by world_size turns that into a sum.
                normaliser = counts[f"normaliser/{part}"].clamp(min=1.0)
                self.manual_backward(loss_sum * (self.trainer.world_size / normaliser))
            add(f"loss_sum/{part}", loss_sum, 0)
            for name, (value, count) in metrics.items():
                add(name, value, count)
                if mixed:
                    add(f"{part}/{name}", value, count)
        return sums

    def _clip_and_measure_grad_norm(self) -> torch.Tensor:
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        wrapped = self.trainer.strategy.model
        if hasattr(wrapped, "clip_grad_norm_"):  # FSDP1: the norm must be taken over the shards
            return wrapped.clip_grad_norm_(max_norm)
        # FSDP2: gradients are DTensor shards; the norm is taken over all of them (a collective)
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _optimizer_step(self) -> tuple[torch.Tensor, float]:
        """Step, free the gradients, advance the schedule; the gradient norm and the lr used. The
        clipping is in `on_before_optimizer_step`, which Lightning calls inside the step."""
        optimizer = self.optimizers()
        lr = optimizer.param_groups[0]["lr"]
        self._grad_norm = None
        optimizer.step()
        grad_norm = self._grad_norm
        if grad_norm is None:  # the hook runs from the closure Lightning hands the optimizer's step
            raise stopping.RunFailed(
                f"training step {self.trainer.global_step}: {type(optimizer.optimizer).__name__}.step() did not call "
                "the closure it was given, so the gradient was neither measured nor clipped (lit-rl clips in "
                "on_before_optimizer_step, which Lightning runs from that closure); use an optimizer whose step "
                "calls its closure, as torch.optim's do")
        # Gradients are freed at once, not at the next step: validation, exports and checkpoints
        # between steps then run without a second copy of the weights' size in memory.
        optimizer.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        return grad_norm, lr

    def on_before_optimizer_step(self, optimizer) -> None:
        """Clip and measure the gradient norm where Lightning's precision plugin has unscaled the
        gradients: fp16 mixed precision (`16-mixed` on a GPU) scales the loss by its GradScaler's
        scale (65536 at first) and unscales inside the optimizer step, just before this hook.
        Clipped before `optimizer.step()`, the scaled norm was clipped, which shrank every fp16
        update by the scale (tests/test_sft_step.py). A non-finite norm there is fp16 overflow:
        the scaler skips the step and lowers its scale. Anywhere else it stops the run."""
        grad_norm = self._clip_and_measure_grad_norm()
        self._grad_norm = grad_norm
        if not torch.isfinite(grad_norm) and self._loss_scaler() is None:  # every rank raises here together
            optimizer.zero_grad(set_to_none=True)
            raise stopping.RunFailed(
                f"training step {self.trainer.global_step}: the gradient norm is {float(grad_norm)} (a non-finite loss or "
                "gradient); the step was not applied, the weights are those of the step before")

    def _loss_scaler(self):
        """fp16 mixed precision's GradScaler (None in any other precision)."""
        return getattr(self.trainer.precision_plugin, "scaler", None)

    def _log_step(self, batch: dict, counts: dict[str, torch.Tensor], sums: dict, grad_norm, lr: float,
                  start: float, compute_start: float) -> torch.Tensor:
        """Log the step (one collective for every sum; every rank logs the same names); its loss:
        the sum over parts of each part's loss sum over its normaliser."""
        shares = rank_shares(batch.get("stats", {}))
        totals = self._sum_named_over_ranks({name: torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device)
                                                               for v in pair]) for name, pair in {**sums, **shares}.items()})
        parts = sorted(name.removeprefix("loss_sum/") for name in totals if name.startswith("loss_sum/"))
        part_loss = {p: totals[f"loss_sum/{p}"][0] / counts[f"normaliser/{p}"].clamp(min=1.0) for p in parts}
        loss = sum(part_loss.values())
        self._last_step_end = time.perf_counter()
        metrics = {
            "train/loss": loss,
            "train/tokens": counts["targets"],
            "train/tokens_per_s": counts["targets"] / max(self._last_step_end - start, 1e-9),
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/peak_memory_gb": peak_memory_gb(self.device),
            "train/compute_s": self._last_step_end - compute_start,  # forward, backward and optimizer
        }
        metrics.update({f"train/{name}": total[0] / total[1].clamp(min=1.0) for name, total in totals.items()
                        if not name.startswith(("loss_sum/", "share/"))})
        if batch.get("parts"):  # a mixed step: each source's own mean loss and trained tokens
            metrics.update({f"train/{p}/loss": part_loss[p] for p in parts})
            metrics.update({f"train/{p}/tokens": counts[f"tokens/{p}"] for p in parts})
        if self._loss_scaler() is not None:  # the scale after this step: halved at every fp16 overflow
            metrics["train/loss_scale"] = float(self._loss_scaler().get_scale())
        metrics.update({f"train/{k}": v for k, v in step_stats(batch.get("stats", {}), totals).items()})
        metrics.update(batch.get("metrics", {}))  # full names, e.g. rollout/... from a rollout data module
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, batch_size=1)
        self.log("loss", loss, prog_bar=True, logger=False, batch_size=1)
        return loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        start = self._last_step_end or time.perf_counter()
        compute_start = time.perf_counter()
        micro_batches = self._step_micro_batches(batch)
        counts = self._step_counts(micro_batches)
        self.step_totals = counts
        try:
            sums = self._backward(micro_batches, counts, mixed=bool(batch.get("parts")))
        finally:
            self.step_totals = None
        grad_norm, lr = self._optimizer_step()
        return self._log_step(batch, counts, sums, grad_norm, lr, start, compute_start)


#: the data stats that count this rank's share of the step (and each source's `<name>/rows`)
RANK_COUNTS = ("rows", "micro_batches", "truncated_rows", "skipped_rows")


def rank_shares(stats: dict) -> dict[str, list[float]]:
    """The data stats that count this rank's share of the step, as `[value, 0]` pairs for the
    step's one collective (`share/<name>`); the padding too, in token slots."""
    shares = {f"share/{k}": [v, 0.0] for k, v in stats.items() if k in RANK_COUNTS or k.endswith("/rows")}
    if "_token_slots" in stats:
        slots = stats["_token_slots"]
        shares["share/_token_slots"] = [slots, 0.0]
        shares["share/_padded_slots"] = [stats.get("padding_fraction", 0.0) * slots, 0.0]
    return shares


def step_stats(stats: dict, totals: dict) -> dict:
    """The step's data stats as logged: those counting a rank's share summed over ranks (so they
    are the step's under DDP/FSDP as in one process), the padding fraction of all ranks' slots, the
    rest (rollout stats, from the whole batch on every rank) as they are; none starting with "_"."""
    out = {k: v for k, v in stats.items() if not k.startswith("_")}
    for name, total in totals.items():
        if name.startswith("share/") and not name.startswith("share/_"):
            out[name.removeprefix("share/")] = total[0]
    if "share/_token_slots" in totals:
        slots = totals["share/_token_slots"][0]
        out["padding_fraction"] = totals["share/_padded_slots"][0] / slots.clamp(min=1.0)
    return out


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far, in GB (1e9 bytes): the CUDA allocator's maximum on a GPU, this
    process's peak resident set on CPU (what the OS had to give it, libraries included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # bytes on macOS, KiB on Linux
