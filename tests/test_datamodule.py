"""StaticDataModule on real files: formats, start-up validation, bad rows, lazy rendering."""

import json

import datasets
import pytest

from lit_rl.data.datamodules import StaticDataModule
from lit_rl.data.sampler import StepBatchSampler, row_order
from helpers import TINY_MODEL, reverse_rows, write_jsonl


def dm_for(path, **kw):
    kw = {"batch_size": 4, "num_workers": 0, "tokenizer": TINY_MODEL, "max_length": 128, "micro_batch_tokens": 512, **kw}
    return StaticDataModule(path, **kw)


def first_batch(dm):
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


def test_messages_jsonl_yields_whole_steps(tmp_path):
    dm = dm_for(write_jsonl(tmp_path / "t.jsonl", reverse_rows(12)), shuffle=False)
    batch = first_batch(dm)
    assert batch["stats"]["rows"] == 4
    assert batch["position"] == (0, 4)  # data epoch 0, its first 4 rows trained once this step is
    assert sum(int(mb["loss_mask"].sum()) for mb in batch["micro_batches"]) > 0


def test_prompt_completion_parquet_with_tools(tmp_path):
    rows = [
        {"prompt": "what is 6*7?", "completion": "42", "tools": json.dumps([{"name": "calc", "parameters": {"type": "object"}}])},
        {"prompt": "say hi", "completion": json.dumps([{"role": "assistant", "content": "hi"}]), "tools": None},
    ] * 2
    path = str(tmp_path / "pc.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    dm = dm_for(path, shuffle=False, max_length=1024, micro_batch_tokens=2048)
    dm.setup("fit")
    renderer = dm._train.renderer
    s0 = renderer.sample(0)
    tok = renderer.tokenizer
    trained = tok.decode([t for t, m in zip(s0.input_ids, s0.loss_mask) if m])
    assert trained == "42<|im_end|>"  # the text "42" stays text, not a decoded JSON number
    assert '"name": "calc"' in tok.decode(s0.input_ids)  # the tool definition is rendered as context
    s1 = renderer.sample(1)
    assert tok.decode([t for t, m in zip(s1.input_ids, s1.loss_mask) if m]) == "hi<|im_end|>"


def test_startup_reports_every_problem_in_one_error(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}] * 4)
    dm = dm_for(path, packing="zigzag", bad_rows="ignore", max_length=9999)
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "4 problem(s)" in msg
    for needle in ("data.packing", "data.bad_rows", "data.max_length", "messages"):
        assert needle in msg
    assert "question" in msg  # the columns that were found are listed


def test_empty_split_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="no rows|cannot load"):
        dm_for(str(path)).setup("fit")


def test_bad_row_names_index_and_column_or_is_skipped(tmp_path):
    rows = reverse_rows(8)
    rows[2] = {"messages": [{"role": "user", "content": "no answer"}, {"role": "wizard", "content": "?"}]}
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    dm = dm_for(path, shuffle=False)
    with pytest.raises(ValueError, match=r"row 2.*messages"):
        first_batch(dm)
    dm = dm_for(path, shuffle=False, bad_rows="skip")
    batch = first_batch(dm)
    assert batch["stats"]["skipped_rows"] == 1 and batch["stats"]["rows"] == 3


def test_rows_are_rendered_lazily(tmp_path, monkeypatch):
    dm = dm_for(write_jsonl(tmp_path / "t.jsonl", reverse_rows(40)))
    dm.setup("fit")
    seen = []
    original = dm._train.renderer.sample
    monkeypatch.setattr(dm._train.renderer, "sample", lambda i: seen.append(i) or original(i))
    next(iter(dm.train_dataloader()))
    assert len(seen) == 4  # one step's rows, not the split


def test_sampler_resume_and_ranks():
    full = [rows for _, _, rows in StepBatchSampler(20, 4, seed=3)]
    resumed = StepBatchSampler(20, 4, seed=3)
    resumed.resume_at(0, 8)  # two steps of 4 rows trained
    assert [rows for _, _, rows in resumed] == full[2:]
    ranks = [list(StepBatchSampler(20, 4, seed=3, rank=r, world_size=2)) for r in (0, 1)]
    for (_, _, a), (_, _, b), whole in zip(ranks[0], ranks[1], full):
        assert sorted(a + b) == sorted(whole) and not set(a) & set(b)
    sampler = StepBatchSampler(20, 4, seed=3)
    first, second = list(sampler), list(sampler)  # each iteration is the next data epoch, reshuffled
    assert [e for e, _, _ in first + second] == [0] * 5 + [1] * 5
    assert [r for _, _, r in second] != full and sorted(sum((r for _, _, r in second), [])) == list(range(20))
    resumed.resume_at(0, 20)  # a checkpoint taken at the end of an epoch resumes with the next one
    assert [e for e, _, _ in resumed][0] == 1


def test_a_resume_with_another_batch_size_neither_repeats_nor_skips_a_row(tmp_path):
    """The data position counts rows: 3 steps of 4 rows, then steps of 6 from row 12 of the same
    order (the epoch's 2 rows left over, as in every pass). A checkpoint from before positions
    counted rows (`step_in_epoch`) resumes in steps of this run's batch size, as it did."""
    order = row_order(40, 0, shuffle=True, seed=5)
    first = [r for _, _, r in StepBatchSampler(40, 4, seed=5)][:3]
    resumed = StepBatchSampler(40, 6, seed=5)
    resumed.resume_at(0, 12)
    second = [r for _, _, r in resumed]
    assert sum(first, []) + sum(second, []) == order[:12 + 6 * 4]
    path = write_jsonl(tmp_path / "t.jsonl", reverse_rows(40))
    dm = dm_for(path, batch_size=6, seed=5)
    dm.load_state_dict({"epoch": 0, "rows_in_epoch": 12, "seed": 5, "num_rows": 40, "shuffle": True})
    dm.setup("fit")
    steps = list(dm.train_dataloader().sampler)
    assert [(epoch, rows) for epoch, rows, _ in steps] == [(0, 18), (0, 24), (0, 30), (0, 36)]
    assert sum((r for _, _, r in steps), []) == order[12:36]
    old = dm_for(path, batch_size=6, seed=5)
    old.load_state_dict({"epoch": 0, "step_in_epoch": 2, "seed": 5})  # 2 steps of this run's 6 rows
    old.setup("fit")
    assert [rows for _, rows, _ in old.train_dataloader().sampler] == [18, 24, 30, 36]
    # another split, or another order, cannot be resumed: the rows trained would not be found again
    for state, said in (({"num_rows": 30}, "the checkpoint's run trained on 30 rows, this one has 40"),
                        ({"shuffle": False}, "the checkpoint's run had data.shuffle False, this one True")):
        dm = dm_for(path, batch_size=6, seed=5)
        dm.load_state_dict({"epoch": 0, "rows_in_epoch": 12, "seed": 5, "num_rows": 40, "shuffle": True, **state})
        dm.setup("fit")
        with pytest.raises(ValueError, match=f"cannot resume the data where the checkpoint left it: {said}"):
            dm.train_dataloader()


def test_the_row_order_follows_the_run_seed_and_a_resume_keeps_its_own(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "t.jsonl", reverse_rows(12))

    def order(dm, state=None):
        if state is not None:
            dm.load_state_dict(state)
        dm.setup("fit")
        return dm.train_dataloader().sampler.order(0)

    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # what seed_everything(7) sets
    seven = order(dm_for(path))
    assert seven == row_order(12, 0, shuffle=True, seed=7) != row_order(12, 0, shuffle=True, seed=8)
    monkeypatch.setenv("PL_GLOBAL_SEED", "8")  # a resume launched with another seed
    resumed = dm_for(path)
    assert order(resumed, {"epoch": 0, "rows_in_epoch": 4, "seed": 7}) == seven
    assert resumed.state_dict() == {"epoch": 0, "rows_in_epoch": 4, "seed": 7, "num_rows": 12, "shuffle": True}
    # a checkpoint from before the seed was saved drew with the old default, 0
    assert order(dm_for(path), {"epoch": 0, "step_in_epoch": 1}) == row_order(12, 0, shuffle=True, seed=0)
    assert order(dm_for(path, seed=3)) == row_order(12, 0, shuffle=True, seed=3)  # an explicit seed wins
    with pytest.raises(ValueError, match="data.seed is 8, but the checkpoint's run drew its order with seed 7"):
        order(dm_for(path, seed=8), {"epoch": 0, "step_in_epoch": 1, "seed": 7})


def test_assistant_turns_inside_a_prompt_are_context(tmp_path):
    fewshot = [
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "xyz"},
    ]
    path = write_jsonl(tmp_path / "fs.jsonl", [{"prompt": fewshot, "completion": "zyx"}] * 4)
    dm = dm_for(path, shuffle=False)
    dm.setup("fit")
    renderer = dm._train.renderer
    s = renderer.sample(0)
    trained = renderer.tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])
    assert trained == "zyx<|im_end|>"
    assert "cba" in renderer.tokenizer.decode(s.input_ids)


def test_num_workers_auto_renders_inline_only_when_torch_has_every_core(tmp_path):
    """`auto` (the default): no worker on a CPU-only machine whose cores torch's threads already
    use (a worker would preempt one: docs/benchmarks.md); one worker once a core is spare."""
    import torch

    from lit_rl.data.workers import resolve_num_workers, usable_cores

    assert not torch.cuda.is_available(), "this test reads the CPU-only rule"
    dm = StaticDataModule(write_jsonl(tmp_path / "t.jsonl", reverse_rows(8)), batch_size=4, tokenizer=TINY_MODEL)
    dm.setup("fit")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(usable_cores())
        assert dm.num_workers == "auto" and dm.train_dataloader().num_workers == 0
        if usable_cores() > 1:
            torch.set_num_threads(usable_cores() - 1)
            assert dm.train_dataloader().num_workers == 1
    finally:
        torch.set_num_threads(threads)
    assert resolve_num_workers(3) == 3 and resolve_num_workers(0) == 0
    for bad in (-1, "two", 1.5, True):
        with pytest.raises(ValueError, match="data.num_workers must be 'auto' or a number >= 0"):
            StaticDataModule("unused.jsonl", num_workers=bad)


def test_val_split_of_a_one_split_source_is_refused(tmp_path):
    """A local file or a saved Dataset has one split: `val_split` would validate on the training rows."""
    path = write_jsonl(tmp_path / "t.jsonl", reverse_rows(8))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(reverse_rows(8)).save_to_disk(str(saved))
    for source in (path, str(saved)):
        for stage in ("fit", "validate"):
            with pytest.raises(ValueError, match=r"data.val_split \('test'\) needs a source with named splits.*data.val_path"):
                dm_for(source, val_split="test").setup(stage)
    # a saved DatasetDict has named splits: val_split picks one
    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(reverse_rows(8)),
                          "test": datasets.Dataset.from_list(reverse_rows(3, offset=20))}).save_to_disk(str(both))
    dm = dm_for(str(both), val_split="test")
    dm.setup("fit")
    assert list(dm._val.renderer.rows) == reverse_rows(3, offset=20) and len(dm._train.renderer.rows) == 8


def test_pack_length_above_micro_batch_tokens_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", reverse_rows(8))
    with pytest.raises(ValueError, match=r"data.pack_length \(600\) exceeds data.micro_batch_tokens \(512\)"):
        dm_for(path, packing="packed", pack_length=600).setup("fit")
    dm_for(path, packing="packed", pack_length=512).setup("fit")


def test_validation_sees_every_row_once_on_every_number_of_ranks():
    for rows, batch, world in [(10, 4, 1), (10, 4, 2), (9, 4, 2), (3, 4, 2), (1, 4, 4), (13, 6, 3)]:
        ranks = [list(StepBatchSampler(rows, batch, shuffle=False, rank=r, world_size=world, keep_last=True))
                 for r in range(world)]
        assert len({len(steps) for steps in ranks}) == 1  # every rank runs the same number of steps
        seen = [i for steps in ranks for _, _, share in steps for i in share]
        assert sorted(seen) == list(range(rows)), (rows, batch, world)
        assert len(ranks[0]) == -(-rows // batch)


def test_val_loss_is_the_token_mean_over_every_held_out_row(tmp_path):
    """10 held-out rows, batch 4: three validation steps (4, 4, 2 rows), and val/loss is the mean
    cross-entropy over the trained tokens of all 10 rows."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lit_rl.modules.sft import SFT

    rows = reverse_rows(10)
    val = write_jsonl(tmp_path / "val.jsonl", rows)
    dm = dm_for(val, val_path=val, shuffle=False)
    dm.setup("validate")
    assert [int(step["stats"]["rows"]) for step in dm.val_dataloader()] == [4, 4, 2]
    module = SFT(model=TINY_MODEL, random_init=True)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    (metrics,) = trainer.validate(module, datamodule=dm)
    renderer, total, count = dm._val.renderer, 0.0, 0
    with torch.no_grad():
        for i in range(len(rows)):
            s = renderer.sample(i)
            ids = torch.tensor([s.input_ids])
            logits = module.model(input_ids=ids, use_cache=False).logits[0].float()
            mask = torch.tensor(s.loss_mask[1:])
            total += F.cross_entropy(logits[:-1][mask], ids[0, 1:][mask], reduction="sum").item()
            count += int(mask.sum())
    assert metrics["val/loss"] == pytest.approx(total / count, rel=1e-5)
