"""Learning-rate schedules for `model.init_args.lr_scheduler`: transformers' schedules, sized by the trainer.

    lr_scheduler:
      class_path: lit_rl.optim.LRSchedule
      init_args: {name: cosine_with_min_lr, warmup_steps: 50, scheduler_kwargs: {min_lr_rate: 0.1}}

The schedules themselves are transformers' (`transformers.get_scheduler`: linear, cosine,
cosine_with_min_lr, constant_with_warmup, warmup_stable_decay, ...); lit-rl adds only their
length. By default it is the trainer's number of optimizer steps (`trainer.max_steps`, or what
`max_epochs` amounts to), so `--trainer.max_steps 50` alone shortens the schedule too; a
config that repeats the number in `total_steps` would go wrong when only one is overridden.

Why a context variable: LightningCLI fixes the schedule factory's signature to
`Callable[[Optimizer], LRScheduler]`, so the module cannot hand the step count over as an
argument. `build_lr_scheduler` (called by the module's `configure_optimizers`) sets it around
the factory call and `LRSchedule` reads it when `total_steps` is not given.
"""

from __future__ import annotations

import contextlib
import logging
import math
from contextvars import ContextVar

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from lit_rl.errors import ConfigError

log = logging.getLogger(__name__)

_TRAINER_STEPS: ContextVar[int | None] = ContextVar("lit_rl_trainer_steps", default=None)
UNSUPPORTED = {"reduce_lr_on_plateau": "it needs a monitored metric", "greedy": "it needs a monitored metric"}
COMMON_ARGUMENTS = ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")  # passed by LRSchedule
RATES = ("min_lr_rate", "min_lr_ratio")  # fractions of the peak lr: the floor of a decay


def trainer_total_steps(trainer) -> int | None:
    """The optimizer steps the trainer will take in total (one batch is one step in lit-rl), or None
    when unknown (no trainer, or an endless run)."""
    if trainer is None:
        return None
    steps = trainer.estimated_stepping_batches
    return int(steps) if math.isfinite(steps) and steps > 0 else None


def build_lr_scheduler(factory, optimizer: Optimizer, total_steps: int | None):
    """`factory(optimizer)`, with `total_steps` as the default length of an `LRSchedule`."""
    token = _TRAINER_STEPS.set(total_steps)
    try:
        return factory(optimizer)
    finally:
        _TRAINER_STEPS.reset(token)


@contextlib.contextmanager
def config_values_of(section: str):
    """Around the module's call of the config's optimizer or schedule factory: they are built from
    the config's arguments only then, when the fit has begun, and torch's refusal of a value (`lr -1`:
    "Invalid learning rate") would be a traceback from inside Lightning. A ConfigError naming `section`."""
    try:
        yield
    except ValueError as e:
        if isinstance(e, ConfigError):  # LRSchedule's own, which names its problems
            raise
        raise ConfigError(f"invalid config: {section}: {e}") from e


def parameter_groups(module) -> list[dict]:
    """The trained parameters of `module` in the groups the optimizer factory is called with: the
    matrices (and embeddings), which take the optimizer's weight decay, and the vectors (biases and
    norm weights), which take none.

    Why: decay pulls a weight towards zero. For a matrix that is the regulariser meant; for an
    RMSNorm's gain (initialised at 1) it shrinks every activation's scale, and for a bias it moves
    an offset that has nothing to do with the model's capacity. transformers' Trainer (so TRL),
    nanoGPT and litgpt leave both undecayed; torch's AdamW default (`weight_decay` 0.01) would decay
    them. The rule is the tensor's rank, which names no module type: every bias and norm weight of a
    causal LM is a vector and every other weight is not. Only `requires_grad` parameters: a LoRA
    run's frozen base gets no optimizer state. An empty group is left out.
    """
    trained = [p for p in module.parameters() if p.requires_grad]
    decayed = [p for p in trained if p.ndim >= 2]
    undecayed = [p for p in trained if p.ndim < 2]
    groups = [{"params": decayed}] if decayed else []
    return groups + ([{"params": undecayed, "weight_decay": 0.0}] if undecayed else [])


def regroup_single_group_state(module, state: dict) -> dict:
    """An optimizer state written before `parameter_groups` (one group, positions over the trained
    parameters in the module's order), as the two groups' state: the same tensors' moments at
    their new positions, the group's settings in both, `weight_decay` 0 in the second. Without it a
    run resumed from such a checkpoint stopped at torch's "loaded state dict has a different number
    of parameter groups". Any other state is returned as it is."""
    if len(state.get("param_groups", ())) != 1:
        return state
    trained = [p for p in module.parameters() if p.requires_grad]
    groups = parameter_groups(module)
    if len(groups) != 2 or len(state["param_groups"][0]["params"]) != len(trained):
        return state
    position = {id(p): i for i, p in enumerate(p for group in groups for p in group["params"])}
    new_of_old = [position[id(p)] for p in trained]
    (old,) = state["param_groups"]
    split = len(groups[0]["params"])
    return {"state": {new_of_old[i]: v for i, v in state["state"].items()},
            "param_groups": [{**old, "params": list(range(split))},
                             {**old, "weight_decay": 0.0, "params": list(range(split, len(trained)))}]}


def regroup_checkpoint_optimizer_states(module, checkpoint: dict) -> None:
    """`regroup_single_group_state` of each of a one-file checkpoint's optimizer states, in place, said
    once: both places that restore them call it (the module's `on_load_checkpoint`, and lit-rl's FSDP2
    strategy, which sets them before that hook runs); the second finds nothing left to regroup."""
    states = checkpoint.get("optimizer_states") or []
    regrouped = [regroup_single_group_state(module, s) for s in states]
    if any(a is not b for a, b in zip(regrouped, states)):
        log.info("resuming a checkpoint of an earlier lit-rl (one optimizer group): its optimizer state is put in "
                 "the two groups of lit_rl.optim.parameter_groups; biases and norm weights are not decayed from here on")
        checkpoint["optimizer_states"] = regrouped


def scheduler_names() -> list[str]:
    from transformers.trainer_utils import SchedulerType

    return [s.value for s in SchedulerType if s.value not in UNSUPPORTED]


def schedule_arguments(name: str) -> list[str]:
    """The arguments of transformers' schedule `name` that `scheduler_kwargs` may give: its
    function's, less those lit-rl passes itself."""
    import inspect

    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
    from transformers.trainer_utils import SchedulerType

    function = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
    return [p for p in inspect.signature(function).parameters if p not in COMMON_ARGUMENTS]


def schedule_kwargs_problems(name: str, kwargs: dict) -> list[str]:
    """What is wrong with `scheduler_kwargs` for schedule `name`, said before transformers sees
    them: it drops those of constant and constant_with_warmup without a word (the others' unknown
    ones are its TypeError), and a floor above the peak makes a decay rise (min_lr_rate 2.0: the
    lr ends at 1.96x the peak)."""
    if name not in scheduler_names():
        return []  # the name's own problem is reported
    accepted = schedule_arguments(name)
    problems = []
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes none"
        problems.append(f"scheduler_kwargs {unknown} are not arguments of the {name!r} schedule ({takes})")
    for rate in RATES:
        value = kwargs.get(rate)
        if rate in accepted and isinstance(value, (int, float)) and not 0.0 <= value <= 1.0:
            problems.append(f"scheduler_kwargs.{rate} is a fraction of the peak lr, in [0, 1]; got {value}")
    return problems


class LRSchedule(LambdaLR):
    """A transformers schedule (`transformers.get_scheduler`) stepped once per optimizer step."""

    def __init__(
        self,
        optimizer: Optimizer,
        name: str = "cosine",
        warmup_steps: int = 0,
        total_steps: int | None = None,
        scheduler_kwargs: dict | None = None,
    ):
        """
        Args:
            optimizer: the module's optimizer (given by the module, not the config).
            name: a ``transformers.SchedulerType``: linear, cosine, cosine_with_restarts, polynomial,
                constant, constant_with_warmup, inverse_sqrt, cosine_with_min_lr,
                cosine_warmup_with_min_lr, warmup_stable_decay.
            warmup_steps: optimizer steps of linear warm-up from 0 to the optimizer's lr (refused
                with ``constant``, which has none: ``constant_with_warmup`` warms up).
            total_steps: length of the schedule in optimizer steps. Default: the trainer's
                (``trainer.max_steps``, or the steps of ``max_epochs``); give it only to decouple
                the schedule from the run's length.
            scheduler_kwargs: extra arguments of the transformers schedule, e.g.
                ``{min_lr_rate: 0.1}`` for cosine_with_min_lr, ``{num_cycles: 2}`` for cosine_with_restarts;
                an argument the schedule does not take is refused.
        """
        from transformers import get_scheduler

        trainer_steps = _TRAINER_STEPS.get()
        steps = total_steps if total_steps is not None else trainer_steps
        problems = []
        if name in UNSUPPORTED or name not in scheduler_names():
            why = f" ({UNSUPPORTED[name]}; lit-rl steps schedules once per optimizer step)" if name in UNSUPPORTED else ""
            problems.append(f"name must be one of {scheduler_names()}, got {name!r}{why}")
        if warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0, got {warmup_steps}")
        if name == "constant" and warmup_steps > 0:
            problems.append(f"warmup_steps ({warmup_steps}) does nothing with the 'constant' schedule (transformers' "
                            "constant ignores it); use name: constant_with_warmup")
        problems += schedule_kwargs_problems(name, scheduler_kwargs or {})
        if steps is None and name != "constant":
            problems.append(
                "total_steps is unknown: set trainer.max_steps (or max_epochs), or give total_steps "
                "(outside a lit-rl module's configure_optimizers there is no trainer to take it from)"
            )
        elif steps is not None and steps < 1:
            problems.append(f"total_steps must be >= 1, got {steps}")
        if problems:
            raise ConfigError(f"{type(self).__name__}: " + "; ".join(problems))
        if steps is not None and steps <= warmup_steps:
            log.warning("%s: the run (%d steps) ends within the warm-up (%d steps)", type(self).__name__, steps, warmup_steps)
        if total_steps is not None and trainer_steps is not None and total_steps != trainer_steps:
            log.warning(
                "%s: total_steps=%d but the trainer runs %d optimizer steps; the schedule follows total_steps "
                "(leave it out to follow the trainer)", type(self).__name__, total_steps, trainer_steps,
            )
        self.name, self.warmup_steps, self.total_steps = name, warmup_steps, steps
        try:
            built = get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=steps,
                                  scheduler_specific_kwargs=dict(scheduler_kwargs or {}))
        except (TypeError, ValueError) as e:  # transformers' own words on a schedule's missing or unknown arguments
            raise ConfigError(f"{type(self).__name__} {name!r}: {e}; scheduler_kwargs gives the schedule's own "
                              f"arguments (got {dict(scheduler_kwargs or {})})") from e
        super().__init__(optimizer, built.lr_lambdas)

    def load_state_dict(self, state_dict: dict) -> None:
        """A resume goes on with the schedule this run configured (its length: the new
        `trainer.max_steps`) from the step the checkpoint reached. The optimizer, restored before
        (by Lightning), holds the learning rate the checkpoint's schedule left; without this its
        first step after the resume trained at the old schedule's end (0 at the end of a decay)."""
        configured = {"name": self.name, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps}
        super().load_state_dict(state_dict)
        self.__dict__.update(configured)
        values = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = values


class WarmupCosineLR(LRSchedule):
    """Deprecated (lit-rl 0.1 configs): use ``LRSchedule`` with ``name: cosine_with_min_lr``.

    Kept so old configs run: linear warm-up, then cosine decay to ``min_lr_ratio`` x the peak,
    now computed by transformers. ``total_steps`` is optional: by default the trainer's.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0, total_steps: int | None = None, min_lr_ratio: float = 0.0):
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ConfigError(f"WarmupCosineLR: min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        log.warning(
            "lit_rl.optim.WarmupCosineLR is deprecated: use class_path lit_rl.optim.LRSchedule with init_args "
            "{name: cosine_with_min_lr, warmup_steps: %d, scheduler_kwargs: {min_lr_rate: %s}} and no total_steps "
            "(it follows trainer.max_steps)", warmup_steps, min_lr_ratio,
        )
        super().__init__(optimizer, "cosine_with_min_lr", warmup_steps, total_steps, {"min_lr_rate": min_lr_ratio})
