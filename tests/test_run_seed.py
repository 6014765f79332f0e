"""The run's seed (lit_rl/run_seed.py): what `seed_everything` reaches outside torch's generators.

End to end: the task order and a resume's (tests/test_grpo_cli.py), the policy server's seed
(tests/test_lora.py), a resumed teacher server's (tests/test_graceful_stop.py).
"""


def test_the_run_seed_seeds_a_started_server_unless_its_options_set_one(monkeypatch):
    """`seed_everything` reaches vLLM's sampler (`--seed`) and the default task order; an explicit
    `--seed` in the server's options wins; without a seed the run's is 0, as Lightning's."""
    from lit_rl.run_seed import SEED_VARIABLE, run_seed, with_sampler_seed

    monkeypatch.delenv(SEED_VARIABLE, raising=False)
    assert run_seed() == 0
    monkeypatch.setenv(SEED_VARIABLE, "7")
    assert run_seed() == 7
    assert with_sampler_seed({"dtype": "float32"}, 7) == {"dtype": "float32", "extra_args": ["--seed", "7"]}
    assert with_sampler_seed({"extra_args": ["--max-logprobs", "32"]}, 9)["extra_args"] == ["--max-logprobs", "32",
                                                                                              "--seed", "9"]
    for explicit in (["--seed", "1"], ["--seed=1"]):
        assert with_sampler_seed({"extra_args": explicit}, 7)["extra_args"] == explicit
