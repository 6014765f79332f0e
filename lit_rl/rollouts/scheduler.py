"""StalenessScheduler: which rollouts may start now, and which batch each finished group joins.

A pure, synchronous core with no I/O and no clock: the async rollout buffer calls
`spawn()` when `num_to_spawn() > 0`, `complete()` or `reject()` when a task ends,
`pop_batch()` when the trainer wants data, and `set_version()` when the inference
server starts serving new weights. Keeping the decisions here makes them testable
under any interleaving, which is where async RL trainers usually go wrong.

Staleness. Staleness is counted in optimizer steps. Each batch feeds
`updates_per_batch` (U) optimizer steps in a row: batch k is trained first in step
k * U (its *first step*), then in the U - 1 steps after it (U = 1, the default: batch k
is trained in step k). The policy version v is the number of optimizer steps whose
weights the server serves. A group spawned under version v that lands in batch k
has staleness k * U - v (how far its sampler lags the weights of the batch's first
update; the later updates are the trust region's business, not staleness), and no
popped sample ever exceeds `max_staleness`. So a group spawned at v must land in a
batch k <= (v + max_staleness) // U (its *last batch*). `max_staleness=0` is
synchronous on-policy RL: batch k holds only groups spawned at version k * U.

Two policies for keeping that bound:

- throttle (`drop_stale=False`, default): nothing finished is ever thrown away (but on a resume
  with fewer batches left than the groups the saved run had ready: those cannot be trained).
  A task spawned now can only land in batches up to v + max_staleness, so spawning
  stops once the groups in flight or waiting fill those batches. Batches are filled
  in completion order (first finished, first trained), except that an older group
  is pulled forward when leaving it behind would make the remaining groups
  impossible to place within the bound; a batch waits for an in-flight group that
  must land in it. Stragglers therefore stall the pipeline instead of being wasted.
- drop (`drop_stale=True`): spawn freely up to the concurrency and what the run
  still needs, while the current version can still reach a batch to come; a group that
  finishes after its last batch was popped (or is still waiting when it goes) is
  dropped, counted, and its budget returned so a replacement is spawned. Batches are
  filled strictly in completion order.

Peers, for orientation: prime-rl drops groups older than `max_off_policy_steps=8`,
TRL's async GRPO defaults to `max_staleness=4`, AReaL to 0 (on-policy). Unlike a
capacity-only bound (queue length), the bound here is per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def scheduler_option_problems(batch_size, group_size, max_concurrency, max_staleness, num_batches=None,
                              updates_per_batch=1) -> list[str]:
    """What is wrong with a scheduler's options, each problem starting with the option's name."""
    problems, bad = [], set()
    for name, value, lowest, optional in [
        ("batch_size", batch_size, 1, False),
        ("group_size", group_size, 1, False),
        ("max_concurrency", max_concurrency, 1, False),
        ("max_staleness", max_staleness, 0, True),
        ("num_batches", num_batches, 1, True),
        ("updates_per_batch", updates_per_batch, 1, False),
    ]:
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
            allowed = f"an int >= {lowest}" + (" or None" if optional else "")
            problems.append(f"{name} must be {allowed}, got {value!r}")
            bad.add(name)
    if not bad & {"batch_size", "group_size"} and batch_size % group_size:
        problems.append(
            f"batch_size={batch_size} must be a multiple of group_size={group_size} "
            "(groups are never split across batches)"
        )
    return problems


class Batch(list):
    """The samples of one popped batch (a plain list, in group order) plus what staleness
    metrics need: `index` (batches popped before it), `first_step` (the optimizer step that
    trains it first: index x updates_per_batch) and `versions` (the policy version each
    sample was spawned under, aligned with the samples)."""

    def __init__(self, samples: Sequence[Any], index: int, versions: Sequence[int],
                 first_step: int | None = None) -> None:
        super().__init__(samples)
        self.index = index
        self.first_step = index if first_step is None else first_step
        self.versions = list(versions)

    @property
    def staleness(self) -> list[int]:
        """`first_step - version` per sample; never above the scheduler's `max_staleness`."""
        return [self.first_step - v for v in self.versions]


@dataclass
class _Group:
    task_id: int
    version: int
    samples: list[Any]


class StalenessScheduler:
    """Decides how many rollout tasks may start and which batch each finished group joins.

    Args:
        batch_size: samples per batch (= per optimizer step); a multiple of `group_size`.
        group_size: samples per task (one prompt, `group_size` completions). A group is
            never split: all its samples land in the same batch.
        max_concurrency: samples in flight at most (spawned tasks not yet completed or
            rejected, times `group_size`), rounded down to whole groups. A value below
            `group_size` still allows one group in flight, so the run can make progress.
        max_staleness: the most optimizer steps a sample may lag the policy that trains
            on it; None means unbounded.
        drop_stale: False throttles spawning so no group ever gets too old; True spawns
            freely and drops (and replaces) groups that finish too old.
        num_batches: batches in the run; None means the run never ends.
        updates_per_batch: optimizer steps each batch feeds (several updates on one batch:
            TRL's `num_iterations`); staleness and versions stay in optimizer steps.

    Consumer contract (what the buffer and trainer must do):
        - Every spawned task eventually gets `complete()` or `reject()`.
        - `set_version(v)` is non-decreasing and `v <= batches popped x updates_per_batch`
          (step v-1 can only have run once its batch was popped). Normal use: after
          optimizer step s, serve the new weights and call `set_version(s + 1)`; any
          non-decreasing v is allowed (a sync after each batch only: `set_version((k + 1) x
          updates_per_batch)`), late calls too, but to get batch k the version must reach
          `k x updates_per_batch - max_staleness` (with nothing in flight and no batch
          ready, `num_to_spawn() > 0` is only guaranteed then).
        - Stamp each task's samples with `version` read right after `spawn()`;
          `pop_batch()` also returns the spawn version of every sample.

    Counters for metrics: `spawned_tasks`, `rejected_tasks`, `dropped_groups`,
    `in_flight_samples`, `waiting_samples`, `next_batch` (= batches popped).
    """

    def __init__(
        self,
        batch_size: int,
        group_size: int,
        max_concurrency: int,
        max_staleness: int | None,
        drop_stale: bool = False,
        num_batches: int | None = None,
        updates_per_batch: int = 1,
    ) -> None:
        problems = scheduler_option_problems(batch_size, group_size, max_concurrency, max_staleness, num_batches,
                                             updates_per_batch)
        if problems:
            raise ValueError("StalenessScheduler: " + "; ".join(problems))
        self.batch_size = batch_size
        self.group_size = group_size
        self.max_concurrency = max_concurrency
        self.max_staleness = max_staleness
        self.drop_stale = drop_stale
        self.num_batches = num_batches
        self.updates_per_batch = updates_per_batch
        self._groups_per_batch = batch_size // group_size
        self._max_groups_in_flight = max(1, max_concurrency // group_size)
        self._version = 0
        self._next_batch = 0
        self._next_task_id = 0
        self._in_flight: dict[int, int] = {}  # task id -> version at spawn
        self._ready: list[_Group] = []  # finished, not yet popped, in completion order
        self.spawned_tasks = 0
        self.rejected_tasks = 0
        self.dropped_groups = 0

    # -- what the buffer reads ---------------------------------------------------------

    @property
    def version(self) -> int:
        """The policy version new tasks are spawned under (stamp it on their samples)."""
        return self._version

    @property
    def next_batch(self) -> int:
        """Index of the next batch `pop_batch()` returns (= batches popped so far)."""
        return self._next_batch

    def first_step(self, batch: int) -> int:
        """The optimizer step that trains batch `batch` first."""
        return batch * self.updates_per_batch

    @property
    def in_flight_samples(self) -> int:
        return len(self._in_flight) * self.group_size

    @property
    def waiting_samples(self) -> int:
        """Samples finished and accepted but not yet popped."""
        return len(self._ready) * self.group_size

    @property
    def finished(self) -> bool:
        """True once the last batch of a finite run was popped."""
        return self.num_batches is not None and self._next_batch >= self.num_batches

    def num_to_spawn(self) -> int:
        """How many tasks may start now."""
        if self.finished:
            return 0
        room = self._max_groups_in_flight - len(self._in_flight)
        if self.drop_stale:
            if self._expired(self._version):  # too old for any batch still to come: it would be dropped
                return 0
            if self.num_batches is not None:  # no more than the remaining batches need
                live = len(self._ready) + sum(not self._expired(v) for v in self._in_flight.values())
                room = min(room, (self.num_batches - self._next_batch) * self._groups_per_batch - live)
        else:
            # A task spawned now can land in batches next_batch..last at most; those
            # slots minus everything already headed there bound what may start.
            last = self._last_batch(self._version)
            if last is not None:
                outstanding = len(self._in_flight) + len(self._ready)
                slots = (last - self._next_batch + 1) * self._groups_per_batch
                room = min(room, slots - outstanding)
        return max(0, room)

    # -- what the buffer calls ---------------------------------------------------------

    def set_version(self, version: int) -> None:
        """The server now serves the weights after `version` optimizer steps."""
        if version < self._version:
            raise ValueError(f"set_version({version}): versions never decrease (current {self._version})")
        if version > self.first_step(self._next_batch):
            raise ValueError(
                f"set_version({version}): only {self._next_batch} batches were popped, so "
                f"at most {self.first_step(self._next_batch)} optimizer steps can have run"
            )
        self._version = version

    def spawn(self) -> int:
        """Start one task under the current version; returns its id."""
        if self.num_to_spawn() <= 0:
            raise RuntimeError("spawn(): nothing may be spawned now (check num_to_spawn() first)")
        task_id = self._next_task_id
        self._next_task_id += 1
        self._in_flight[task_id] = self._version
        self.spawned_tasks += 1
        return task_id

    def complete(self, task_id: int, samples: Sequence[Any]) -> None:
        """A task finished with its `group_size` samples. A wrong count raises and leaves
        the task in flight: `reject()` it to give its budget back."""
        version = self._in_flight_version(task_id)
        if len(samples) != self.group_size:
            raise ValueError(
                f"complete({task_id}): got {len(samples)} samples, group_size is {self.group_size}"
            )
        del self._in_flight[task_id]
        if self._expired(version):
            self.dropped_groups += 1  # only in drop mode; throttling never lets this happen
        else:
            self._ready.append(_Group(task_id, version, list(samples)))

    def reject(self, task_id: int) -> None:
        """A task failed or its group was rejected: forget it, freeing its budget for a
        replacement."""
        self._in_flight_version(task_id)
        del self._in_flight[task_id]
        self.rejected_tasks += 1

    def pop_batch(self) -> Batch | None:
        """The next batch (`batch_size` samples, a `Batch`, i.e. a list) once it can be
        filled within the bound, else None. When throttling, it may wait for an in-flight
        group that would otherwise miss its last batch."""
        if self.finished:
            return None
        chosen = self._choose()
        if chosen is None:
            return None
        groups = [self._ready[i] for i in chosen]
        self._ready = [g for i, g in enumerate(self._ready) if i not in chosen]
        batch = Batch(
            [s for g in groups for s in g.samples],
            index=self._next_batch,
            versions=[g.version for g in groups for _ in g.samples],
            first_step=self.first_step(self._next_batch),
        )
        self._next_batch += 1
        if self.drop_stale:  # groups that missed their last batch can never be trained
            expired = [g for g in self._ready if self._expired(g.version)]
            self._ready = [g for g in self._ready if not self._expired(g.version)]
            self.dropped_groups += len(expired)
        return batch

    # -- checkpointing -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain python data (JSON-able as long as the samples are). Samples are opaque
        here and kept as they are: the buffer serializes them if they need it, and hands
        the same form back to `load_state_dict`. Tasks in flight cannot be resumed and
        are not saved; see `load_state_dict`."""
        return {
            "batch_size": self.batch_size,
            "group_size": self.group_size,
            "max_staleness": self.max_staleness,
            "drop_stale": self.drop_stale,
            "num_batches": self.num_batches,
            "updates_per_batch": self.updates_per_batch,
            "version": self._version,
            "next_batch": self._next_batch,
            "next_task_id": self._next_task_id,
            "ready": [[g.task_id, g.version, list(g.samples)] for g in self._ready],
            "spawned_tasks": self.spawned_tasks,
            "rejected_tasks": self.rejected_tasks,
            "dropped_groups": self.dropped_groups,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state. Finished-but-unpopped groups come back as they were;
        tasks that were in flight at save time are forgotten and their budget returned,
        so replacements get spawned (their ids are unknown afterwards). `max_concurrency`
        may change, and `num_batches` to any count not below the batches already popped; the
        rest must match (a state from before `updates_per_batch` existed had 1)."""
        problems = self.resume_problems(state)
        if problems:
            raise ValueError("load_state_dict: state does not fit this scheduler: " + "; ".join(problems))
        self._version = state["version"]
        self._next_batch = state["next_batch"]
        self._next_task_id = state["next_task_id"]
        self._in_flight = {}
        self._ready = [_Group(t, v, list(s)) for t, v, s in state["ready"]]
        self.spawned_tasks = state["spawned_tasks"]
        self.rejected_tasks = state["rejected_tasks"]
        self.dropped_groups = state["dropped_groups"]
        self._keep_what_the_remaining_batches_hold()

    def _keep_what_the_remaining_batches_hold(self) -> None:
        """A resume with fewer batches (a smaller `max_steps`) than the groups generated ahead of the
        saved run fill: the groups past the remaining slots can never be trained in this run and are
        dropped (counted), those with the earliest deadlines kept. Kept, they broke throttling's
        invariant (more groups due by the last batch than it holds) and the first `pop_batch` failed."""
        if self.num_batches is None:
            return
        room = max(0, (self.num_batches - self._next_batch) * self._groups_per_batch)
        if len(self._ready) <= room:
            return
        by_deadline = sorted(range(len(self._ready)), key=lambda i: (self._last_batch(self._ready[i].version), i))
        kept = set(by_deadline[:room])
        self.dropped_groups += len(self._ready) - room
        self._ready = [g for i, g in enumerate(self._ready) if i in kept]

    def resume_problems(self, state: dict[str, Any]) -> list[str]:
        """Why a saved state cannot continue under this scheduler's options, each problem starting
        with the option's name (empty when it can)."""
        state = {"updates_per_batch": 1, **state}
        problems = [
            f"{key}: saved {state[key]!r}, scheduler has {getattr(self, key)!r}"
            for key in ("batch_size", "group_size", "max_staleness", "drop_stale", "updates_per_batch")
            if state[key] != getattr(self, key)
        ]
        if self.num_batches is not None and state["next_batch"] > self.num_batches:
            problems.append(f"num_batches: {state['next_batch']} batches were drawn already, scheduler has "
                            f"{self.num_batches}")
        return problems

    # -- internals ---------------------------------------------------------------------

    def _in_flight_version(self, task_id: int) -> int:
        if task_id not in self._in_flight:
            raise ValueError(f"task {task_id} is not in flight (unknown, already finished, or lost in a resume)")
        return self._in_flight[task_id]

    def _last_batch(self, version: int) -> int | None:
        """Last batch a group spawned at `version` may join, capped at the run's last batch
        (a slot past the end is no slot); None when there is no limit. The deadline used
        for throttling."""
        bounds = [self._newest_batch(version)] if self.max_staleness is not None else []
        if self.num_batches is not None:
            bounds.append(self.num_batches - 1)
        return min(bounds, default=None)

    def _expired(self, version: int) -> bool:
        """True when a group spawned at `version` is too old for the next batch (and so
        for every later one)."""
        return self.max_staleness is not None and self._newest_batch(version) < self._next_batch

    def _newest_batch(self, version: int) -> int:
        """The last batch whose first step is within `max_staleness` of `version` (set)."""
        return (version + self.max_staleness) // self.updates_per_batch

    def _choose(self) -> list[int] | None:
        """Indices into the ready list for the next batch, in completion order, or None.

        Drop mode takes the first finished groups. Throttle mode keeps the invariant
        that everything in flight or waiting still fits: for every batch j >= next,
        at most (j - next + 1) * groups_per_batch of those groups have a last batch <= j
        (Hall's condition for placing groups by deadline). Spawning keeps it for the
        newest deadline; here the batch takes, from the earliest finished groups, those
        needed so that it still holds for the rest, then fills up in completion order.
        """
        per_batch = self._groups_per_batch
        if len(self._ready) < per_batch:
            return None
        if self.drop_stale or (self.max_staleness is None and self.num_batches is None):
            return list(range(per_batch))
        ready_deadlines = [self._last_batch(g.version) for g in self._ready]
        deadlines = ready_deadlines + [self._last_batch(v) for v in self._in_flight.values()]
        chosen: list[int] = []
        for j in sorted(set(deadlines)):
            need = sum(d <= j for d in deadlines) - (j - self._next_batch) * per_batch
            for i, d in enumerate(ready_deadlines):
                if len(chosen) >= need:
                    break
                if i not in chosen and d <= j:
                    chosen.append(i)
            if len(chosen) < need:
                return None  # a group that must join this batch is still in flight
        assert len(chosen) <= per_batch, "throttling invariant broken"
        chosen += [i for i in range(len(self._ready)) if i not in chosen][: per_batch - len(chosen)]
        return sorted(chosen)
