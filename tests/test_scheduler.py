"""StalenessScheduler: hand-picked cases, then random interleavings checked against every invariant."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rl.rollouts.scheduler import StalenessScheduler


def group(task_id: int, size: int) -> list[str]:
    """Unique, JSON-able samples, so loss and duplication are visible."""
    return [f"{task_id}/{i}" for i in range(size)]


def spawn_all(s: StalenessScheduler) -> list[int]:
    return [s.spawn() for _ in range(s.num_to_spawn())]


# -- hand-picked cases ---------------------------------------------------------------


def test_on_policy_sequence():
    s = StalenessScheduler(batch_size=4, group_size=2, max_concurrency=100, max_staleness=0, num_batches=2)
    for k in range(2):
        assert s.num_to_spawn() == 2  # exactly one batch of groups per version
        tasks = spawn_all(s)
        assert s.num_to_spawn() == 0 and s.in_flight_samples == 4
        s.complete(tasks[1], group(tasks[1], 2))
        assert s.pop_batch() is None  # batch k waits for every group spawned at version k
        s.complete(tasks[0], group(tasks[0], 2))
        assert s.num_to_spawn() == 0  # nothing may start before the new weights are served
        batch = s.pop_batch()
        assert list(batch) == group(tasks[1], 2) + group(tasks[0], 2)  # completion order
        assert batch.index == k and batch.versions == [k] * 4 and batch.staleness == [0] * 4
        assert s.num_to_spawn() == 0
        s.set_version(k + 1)
    assert s.finished and s.num_to_spawn() == 0 and s.pop_batch() is None


def test_argument_errors_are_reported_together():
    with pytest.raises(ValueError) as err:
        StalenessScheduler(batch_size=5, group_size=2, max_concurrency=0, max_staleness=-1, num_batches=0)
    message = str(err.value)
    assert "batch_size=5 must be a multiple of group_size=2" in message
    for name in ("max_concurrency", "max_staleness", "num_batches"):
        assert f"{name} must be an int" in message
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        StalenessScheduler(batch_size=4, group_size=0, max_concurrency=4, max_staleness=None)


def test_complete_checks_sample_count_and_task_id():
    s = StalenessScheduler(batch_size=2, group_size=2, max_concurrency=2, max_staleness=1)
    t = s.spawn()
    with pytest.raises(ValueError, match="got 1 samples, group_size is 2"):
        s.complete(t, ["a"])
    assert s.in_flight_samples == 2  # still in flight: the caller can reject it
    s.complete(t, group(t, 2))
    with pytest.raises(ValueError, match="not in flight"):
        s.complete(t, group(t, 2))
    with pytest.raises(ValueError, match="not in flight"):
        s.reject(99)


def test_set_version_never_decreases_nor_runs_ahead_of_popped_batches():
    s = StalenessScheduler(batch_size=2, group_size=1, max_concurrency=4, max_staleness=1)
    with pytest.raises(ValueError, match="only 0 batches were popped"):
        s.set_version(1)
    for t in spawn_all(s)[:2]:
        s.complete(t, group(t, 1))
    s.pop_batch()
    s.set_version(1)
    with pytest.raises(ValueError, match="never decrease"):
        s.set_version(0)


def test_max_concurrency_below_group_size_allows_one_group():
    s = StalenessScheduler(batch_size=8, group_size=4, max_concurrency=3, max_staleness=None)
    assert s.num_to_spawn() == 1
    s.spawn()
    assert s.num_to_spawn() == 0 and s.in_flight_samples == 4
    with pytest.raises(RuntimeError):
        s.spawn()


def test_reject_returns_budget():
    s = StalenessScheduler(batch_size=2, group_size=1, max_concurrency=10, max_staleness=0, num_batches=1)
    a, b = spawn_all(s)
    assert s.num_to_spawn() == 0
    s.reject(a)
    assert s.num_to_spawn() == 1 and s.rejected_tasks == 1
    c = s.spawn()
    s.complete(b, group(b, 1))
    s.complete(c, group(c, 1))
    assert list(s.pop_batch()) == ["1/0", "2/0"] and s.finished


def test_drop_stale_drops_counts_and_replaces():
    s = StalenessScheduler(batch_size=1, group_size=1, max_concurrency=3, max_staleness=0, drop_stale=True)
    old, fresh, slow = spawn_all(s)  # not throttled by staleness: 3 start at version 0
    s.complete(fresh, ["fresh"])
    assert list(s.pop_batch()) == ["fresh"]
    s.set_version(1)
    assert s.num_to_spawn() == 1  # fresh's slot
    s.complete(old, ["old"])  # version 0 is too old for batch 1
    assert s.dropped_groups == 1 and s.waiting_samples == 0 and s.num_to_spawn() == 2  # replaced
    new = s.spawn()
    s.complete(new, ["new"])
    assert list(s.pop_batch()) == ["new"]
    s.complete(slow, ["slow"])
    assert s.dropped_groups == 2 and s.pop_batch() is None


@pytest.mark.parametrize("max_staleness, updates_per_batch", [(0, 1), (1, 2)])
def test_drop_stale_spawns_nothing_the_next_batch_would_drop(max_staleness, updates_per_batch):
    """Between a pop and the trainer's next version a task would start too old for every batch
    still to come: nothing starts (it would run only to be dropped, holding a concurrency slot)."""
    s = StalenessScheduler(batch_size=1, group_size=1, max_concurrency=4, max_staleness=max_staleness,
                           drop_stale=True, updates_per_batch=updates_per_batch)
    first = s.spawn()
    s.complete(first, ["first"])
    assert list(s.pop_batch()) == ["first"]
    assert s.num_to_spawn() == 0  # version 0 can reach no batch after batch 0
    s.set_version(updates_per_batch - max_staleness)  # the oldest version batch 1 takes
    assert s.num_to_spawn() == 4


def test_drop_stale_replaces_a_doomed_task_while_it_is_still_in_flight():
    s = StalenessScheduler(
        batch_size=1, group_size=1, max_concurrency=3, max_staleness=0, drop_stale=True, num_batches=2
    )
    doomed, quick = spawn_all(s)  # exactly the two groups the run needs
    s.complete(quick, ["quick"])
    s.pop_batch()
    s.set_version(1)
    assert s.num_to_spawn() == 1  # `doomed` can no longer fill batch 1, so do not wait for it
    new = s.spawn()
    s.complete(new, ["new"])
    assert list(s.pop_batch()) == ["new"] and s.finished
    s.complete(doomed, ["doomed"])
    assert s.dropped_groups == 1 and s.waiting_samples == 0


def test_drop_stale_drops_waiting_groups_that_miss_their_last_batch():
    s = StalenessScheduler(batch_size=1, group_size=1, max_concurrency=2, max_staleness=0, drop_stale=True)
    a, b = spawn_all(s)
    s.complete(a, ["a"])
    s.complete(b, ["b"])
    assert list(s.pop_batch()) == ["a"]
    assert s.dropped_groups == 1 and s.waiting_samples == 0 and s.pop_batch() is None


def test_throttle_waits_for_a_straggler_instead_of_dropping_it():
    # staleness 1, one group per batch: the straggler (version 0) must be in batch 1 at the latest.
    s = StalenessScheduler(batch_size=1, group_size=1, max_concurrency=10, max_staleness=1)
    straggler, quick = spawn_all(s)  # batches 0 and 1 are all a version-0 task can reach
    assert s.num_to_spawn() == 0
    s.complete(quick, ["quick"])
    assert list(s.pop_batch()) == ["quick"]
    s.set_version(1)
    newer = s.spawn()  # may land in batch 2; batch 1 stays reserved for the straggler
    assert s.num_to_spawn() == 0
    s.complete(newer, ["newer"])
    assert s.pop_batch() is None  # first finished would be "newer", but then the straggler expires
    s.complete(straggler, ["straggler"])
    b1 = s.pop_batch()
    assert list(b1) == ["straggler"] and b1.staleness == [1]
    assert list(s.pop_batch()) == ["newer"] and s.dropped_groups == 0


def test_throttle_pulls_older_groups_forward_when_needed():
    # 2 groups per batch, staleness 2: six version-0 groups fill batches 0-2.
    s = StalenessScheduler(batch_size=2, group_size=1, max_concurrency=100, max_staleness=2)
    old = spawn_all(s)
    assert len(old) == 6
    for t in old[:2]:
        s.complete(t, group(t, 1))
    assert s.pop_batch().index == 0
    s.set_version(1)
    new = spawn_all(s)  # two version-1 groups may reach batch 3
    assert len(new) == 2
    for t in new + old[2:3]:
        s.complete(t, group(t, 1))
    # Batch 1 cannot take both new groups: four old ones would be left for batch 2 alone.
    assert s.pop_batch() is None
    s.complete(old[3], group(old[3], 1))
    assert s.pop_batch().versions == [0, 0]
    assert s.pop_batch() is None  # batch 2 needs the last two old groups
    for t in old[4:]:
        s.complete(t, group(t, 1))
    assert s.pop_batch().versions == [0, 0]
    assert s.pop_batch().versions == [1, 1] and s.dropped_groups == 0


def test_a_resume_with_fewer_batches_than_the_groups_ready_keeps_what_fits():
    """Saved after batch 0 of 100 with two batches' worth of groups generated ahead (max_staleness 2),
    resumed for 2 batches in all: the one batch left holds 2 groups of the 4 ready. Kept, they broke
    throttling's invariant and the first pop_batch failed ("throttling invariant broken")."""
    saved = StalenessScheduler(batch_size=4, group_size=2, max_concurrency=100, max_staleness=2, num_batches=100)
    while saved.num_to_spawn() > 0:
        task = saved.spawn()
        saved.complete(task, ["a", "b"])
    assert saved.pop_batch().index == 0
    state = saved.state_dict()
    assert len(state["ready"]) > 2
    resumed = StalenessScheduler(batch_size=4, group_size=2, max_concurrency=100, max_staleness=2, num_batches=2)
    assert resumed.resume_problems(state) == []
    resumed.load_state_dict(state)
    resumed.set_version(1)
    batch = resumed.pop_batch()
    assert batch.index == 1 and len(batch) == 4 and resumed.finished
    assert resumed.dropped_groups == state["dropped_groups"] + len(state["ready"]) - 2


def test_state_dict_round_trip_mid_run():
    kwargs = dict(batch_size=4, group_size=2, max_concurrency=6, max_staleness=1, num_batches=3)
    s = StalenessScheduler(**kwargs)
    a, b, c = spawn_all(s)
    s.complete(a, group(a, 2))
    s.complete(b, group(b, 2))
    assert list(s.pop_batch()) == group(a, 2) + group(b, 2)
    s.set_version(1)
    s.complete(c, group(c, 2))
    d = s.spawn()  # in flight at save time
    state = json.loads(json.dumps(s.state_dict()))

    r = StalenessScheduler(**kwargs)
    r.load_state_dict(state)
    assert r.in_flight_samples == 0 and r.waiting_samples == 2 and r.spawned_tasks == 4
    with pytest.raises(ValueError, match="not in flight"):
        r.complete(d, group(d, 2))  # forgotten: its budget is back
    popped = []
    while not r.finished:
        for t in spawn_all(r):
            assert t > d  # ids are never reused
            r.complete(t, group(t, 2))
        batch = r.pop_batch()
        popped += batch
        r.set_version(batch.index + 1)
    assert popped[:2] == group(c, 2) and len(popped) == len(set(popped)) == 8
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessScheduler(**{**kwargs, "max_staleness": 2}).load_state_dict(state)
    StalenessScheduler(**{**kwargs, "num_batches": 2}).load_state_dict(state)  # a shorter run: still after batch 0
    with pytest.raises(ValueError, match="num_batches: 3 batches were drawn already, scheduler has 2"):
        StalenessScheduler(**{**kwargs, "num_batches": 2}).load_state_dict({**state, "next_batch": 3})


def test_finite_run_ends_exactly():
    s = StalenessScheduler(batch_size=2, group_size=1, max_concurrency=100, max_staleness=None, num_batches=3)
    tasks = spawn_all(s)
    assert len(tasks) == 6 and s.num_to_spawn() == 0  # exactly what the run needs
    s.reject(tasks[0])
    assert s.num_to_spawn() == 1  # a replacement, nothing more
    for t in tasks[1:] + [s.spawn()]:
        s.complete(t, group(t, 1))
    for k in range(3):
        assert not s.finished
        assert s.pop_batch().index == k
    assert s.finished and s.pop_batch() is None and s.num_to_spawn() == 0


# -- random interleavings --------------------------------------------------------------


class Sim:
    """Drives a scheduler like an async buffer and trainer would, in a random order, and
    checks every invariant after each action."""

    def __init__(self, cfg: dict, rng: random.Random) -> None:
        self.cfg, self.rng = cfg, rng
        self.s = StalenessScheduler(**cfg)
        self.G, self.S, self.N = cfg["group_size"], cfg["max_staleness"], cfg["num_batches"]
        self.U = cfg.get("updates_per_batch", 1)  # optimizer steps per batch: batch k is first trained in step k * U
        self.P = cfg["batch_size"] // self.G
        self.spawn_version: dict[int, int] = {}
        self.in_flight: set[int] = set()
        self.completed: set[int] = set()  # accepted by complete()
        self.popped: dict[str, int] = {}  # sample -> batch index
        self.spawned = self.rejected = self.forgotten = 0

    # actions

    def spawn(self) -> None:
        for _ in range(self.rng.randint(1, self.s.num_to_spawn())):
            t = self.s.spawn()
            assert t not in self.spawn_version
            self.spawn_version[t] = self.s.version
            self.in_flight.add(t)
            self.spawned += 1

    def finish(self) -> None:
        t = self.rng.choice(sorted(self.in_flight))
        if self.rng.random() < 0.3:
            self.s.reject(t)
            self.rejected += 1
        else:
            if self.rng.random() < 0.05:
                with pytest.raises(ValueError):
                    self.s.complete(t, group(t, self.G + 1))
            self.s.complete(t, group(t, self.G))
            self.completed.add(t)
        self.in_flight.discard(t)

    def pop(self) -> bool:
        batch = self.s.pop_batch()
        if batch is None:
            return False
        k = len(self.popped) // self.s.batch_size
        assert batch.index == k and batch.first_step == k * self.U and len(batch) == self.s.batch_size
        assert batch.staleness == [k * self.U - v for v in batch.versions]  # in optimizer steps
        for sample, v in zip(batch, batch.versions):
            t = int(sample.split("/")[0])
            assert t in self.completed and sample not in self.popped
            assert v == self.spawn_version[t] and 0 <= k * self.U - v
            assert self.S is None or k * self.U - v <= self.S
            self.popped[sample] = k
        tasks = [int(x.split("/")[0]) for x in batch]
        assert all(tasks.count(t) == self.G for t in tasks)  # whole groups
        return True

    def set_version(self) -> None:
        """Lag, catch up, or jump (a batch's updates at once), within `version <= optimizer steps
        that can have run` (batches popped x updates per batch)."""
        self.s.set_version(self.rng.randint(self.s.version, self.s.next_batch * self.U))

    def resume(self) -> None:
        state = json.loads(json.dumps(self.s.state_dict()))
        self.s = StalenessScheduler(**self.cfg)
        self.s.load_state_dict(state)
        for t in self.in_flight:
            with pytest.raises(ValueError):
                self.s.complete(t, group(t, self.G))
        self.forgotten += len(self.in_flight)
        self.in_flight.clear()

    # invariants

    def check(self) -> None:
        s, n = self.s, self.s.next_batch
        assert s.in_flight_samples == len(self.in_flight) * self.G
        assert s.in_flight_samples <= max(s.max_concurrency, self.G)
        assert s.spawned_tasks == self.spawned and s.rejected_tasks == self.rejected
        assert self.spawned == len(self.in_flight) + len(self.completed) + self.rejected + self.forgotten
        # every accepted group is popped, waiting, or dropped, and only dropped if too old
        waiting = {t for t, _, _ in s.state_dict()["ready"]}
        popped = {int(x.split("/")[0]) for x in self.popped}
        assert waiting.isdisjoint(popped) and (waiting | popped) <= self.completed
        dropped = self.completed - waiting - popped
        assert s.dropped_groups == len(dropped) and s.waiting_samples == len(waiting) * self.G
        assert all(self.spawn_version[t] + self.S < n * self.U for t in dropped)
        if not self.cfg["drop_stale"]:
            assert not dropped
        if self.N is not None:
            assert s.finished == (n == self.N)
            live = waiting | {t for t in self.in_flight if self.S is None or self.spawn_version[t] + self.S >= n * self.U}
            assert len(live) <= (self.N - n) * self.P  # no over-spawning
            if s.finished:
                assert s.num_to_spawn() == 0 and s.pop_batch() is None

    def run(self, max_steps: int = 3000) -> None:
        """Random actions until the run ends; a run that stops moving is a hang."""
        for _ in range(max_steps):
            s = self.s
            if self.N is None and s.next_batch >= 6:
                return
            if s.finished:
                assert not self.in_flight or self.cfg["drop_stale"]
                while self.in_flight:  # stragglers of a drop-mode run can only be dropped
                    self.finish()
                    self.check()
                return
            idle = not self.in_flight and s.num_to_spawn() == 0
            if idle and (self.S is None or s.version >= s.next_batch * self.U - self.S):
                # the consumer kept its side of the contract, so a batch must be ready
                assert self.pop(), f"hang at batch {s.next_batch}, version {s.version}"
            else:
                actions = [self.pop]
                if s.num_to_spawn() > 0:
                    actions.append(self.spawn)
                if self.in_flight:
                    actions.append(self.finish)
                if s.version < s.next_batch * self.U:
                    actions.append(self.set_version)
                if self.rng.random() < 0.02:
                    actions.append(self.resume)
                self.rng.choice(actions)()
            self.check()
        pytest.fail(f"no end after {max_steps} steps")


@settings(max_examples=200, deadline=None)
@given(
    group_size=st.integers(1, 4),
    groups_per_batch=st.integers(1, 4),
    concurrency=st.integers(1, 20),
    max_staleness=st.sampled_from([0, 1, 2, 3, None]),
    drop_stale=st.booleans(),
    num_batches=st.sampled_from([1, 2, 3, 5, None]),
    updates_per_batch=st.sampled_from([1, 1, 2, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_interleavings_keep_every_invariant(
    group_size, groups_per_batch, concurrency, max_staleness, drop_stale, num_batches, updates_per_batch, seed
):
    cfg = dict(
        batch_size=group_size * groups_per_batch,
        group_size=group_size,
        max_concurrency=concurrency,
        max_staleness=max_staleness,
        drop_stale=drop_stale,
        num_batches=num_batches,
        updates_per_batch=updates_per_batch,
    )
    Sim(cfg, random.Random(seed)).run()


def test_several_updates_per_batch_count_versions_and_staleness_in_optimizer_steps():
    """Batch k feeds steps 2k and 2k + 1: a version may be any step reached, staleness is the
    batch's first step minus the spawn version, and a group spawned at version v may land in
    batches up to (v + max_staleness) // 2."""
    s = StalenessScheduler(batch_size=2, group_size=2, max_concurrency=8, max_staleness=1, updates_per_batch=2)
    (t0,) = spawn_all(s)  # version 0: last batch (0 + 1) // 2 = 0, so only one group may start
    s.complete(t0, group(t0, 2))
    batch = s.pop_batch()
    assert (batch.index, batch.first_step, batch.staleness) == (0, 0, [0, 0])
    with pytest.raises(ValueError, match="at most 2 optimizer steps"):
        s.set_version(3)
    s.set_version(1)  # after batch 0's first update: its groups may land in batch 1 (first step 2, staleness 1)
    (t1,) = spawn_all(s)
    s.complete(t1, group(t1, 2))
    s.set_version(2)
    batch = s.pop_batch()
    assert (batch.index, batch.first_step, batch.staleness) == (1, 2, [1, 1])
    state = s.state_dict()
    with pytest.raises(ValueError, match="updates_per_batch: saved 2, scheduler has 1"):
        StalenessScheduler(batch_size=2, group_size=2, max_concurrency=8, max_staleness=1).load_state_dict(state)
    with pytest.raises(ValueError, match="updates_per_batch must be an int >= 1, got 0"):
        StalenessScheduler(batch_size=2, group_size=2, max_concurrency=8, max_staleness=1, updates_per_batch=0)
