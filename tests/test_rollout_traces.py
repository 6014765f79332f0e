"""The trained-sample traces (`rollouts/trained*.jsonl`) on a resume: the steps the resumed run
trains again move to `*.rolled_back.jsonl`."""

import json

from lit_rl.data.rollout_traces import rewind_traces


def test_a_trace_line_cut_short_goes_with_the_rolled_back_steps(tmp_path):
    """A crash while a step's line was appended leaves it cut short: every resume stopped at its
    JSONDecodeError before the first step. Now it is moved out with the steps past the resume point,
    on a line of its own, and the steps before stay."""
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    lines = [json.dumps({"step": s, "samples": [[s, 0]]}) for s in (0, 1, 2)]
    (rollouts / "trained_rank0.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:12])
    rewind_traces(tmp_path, 1, 0)
    assert (rollouts / "trained_rank0.jsonl").read_text() == lines[0] + "\n"
    assert (rollouts / "trained_rank0.rolled_back.jsonl").read_text() == lines[1] + "\n" + lines[2][:12] + "\n"
