"""The YAML blocks in the docs are configs the CLI accepts, with the values they show.

Each block is a fragment: the options a page is about, to be added to a shipped config. So each is
merged onto the config it extends, as a user would (`lit-rl fit --config BASE --config BLOCK
--print_config`), and every value the block sets must be in the config printed: an option renamed
or moved in the code and not in the docs fails here, instead of in a user's first run. The options
of a server (`inference.server`, an `OnlineEval`'s `server`), free-form to the parser, are checked
as a run checks them before it starts one (`server_option_problems`). A value
written `...` in a block means "as before" and is left to the base. docs/environments.md's blocks
are also run, not only parsed (test_dataset_env.py, test_verifiers_env.py).
"""

from __future__ import annotations

import pytest
import yaml
from helpers import REPO, doc_yaml_blocks

from lit_rl.server_options import EVALUATOR_SERVER_OPTIONS, server_option_problems

EXAMPLES = REPO / "examples" / "reverse_text"


def doc_blocks() -> list[tuple[str, int, dict]]:
    blocks = []
    for page in sorted([*REPO.glob("docs/*.md"), REPO / "README.md"]):
        name = page.relative_to(REPO).as_posix()
        for index, block in enumerate(doc_yaml_blocks(name)):
            if isinstance(block, dict) and {"model", "data", "trainer", "inference"} & set(block):
                blocks.append((name, index, without_ellipses(block)))
    return blocks


def without_ellipses(node):
    if isinstance(node, dict):
        return {k: without_ellipses(v) for k, v in node.items() if v != "..."}
    if isinstance(node, list):
        return [without_ellipses(v) for v in node]
    return node


def base_config(block: dict) -> str:
    """The shipped config a block extends: OPD's for a teacher, GRPO's for rollouts or a server."""
    text = yaml.safe_dump(block)
    if "teacher_model" in text or "lit_rl.modules.OPD" in text:
        return str(EXAMPLES / "opd.yaml")
    if "inference" in block or "lit_rl.modules.GRPO" in text or "RolloutDataModule" in text:
        return str(EXAMPLES / "grpo.yaml")
    return str(EXAMPLES / "sft.yaml")


def leaves(node, path=()):
    """(path, value) for every scalar the block sets."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*path, key))
    elif isinstance(node, list) and node and all(isinstance(v, (dict, list)) for v in node):
        for index, value in enumerate(node):
            yield from leaves(value, (*path, index))
    else:
        yield path, node


def server_mappings(node, path=()):
    """(path, options) for every server's options in a block: `inference.server`/`teacher_server`,
    and a callback's `server` (the evaluator's, which takes `num_infer_gpus` besides)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("server", "teacher_server") and isinstance(value, dict):
                yield (*path, key), value
            else:
                yield from server_mappings(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from server_mappings(value, (*path, index))


def server_problems_in(config: dict) -> list[str]:
    """What a run would refuse in a config's server options before it starts a server."""
    problems = []
    for path, options in server_mappings(config):
        also = EVALUATOR_SERVER_OPTIONS if "callbacks" in path else ()
        problems += server_option_problems(options, where=".".join(map(str, path)) + ".", also=also)
    return problems


def at(config, path):
    for key in path:
        config = config[key]
    return config


BLOCKS = doc_blocks()


def test_the_docs_have_config_blocks_to_check():
    pages = {page for page, _, _ in BLOCKS}
    assert {"docs/cli.md", "docs/distributed.md", "docs/inference.md", "docs/lora.md", "docs/rl.md"} <= pages, pages


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{page}#{index}" for page, index, _ in BLOCKS])
def test_a_docs_config_block_parses_with_the_values_it_shows(page, index, block, tmp_path, lit_rl_main):
    fragment = tmp_path / "block.yaml"
    fragment.write_text(yaml.safe_dump(block))
    code, stdout, stderr = lit_rl_main(["fit", "--config", base_config(block), "--config", str(fragment), "--print_config"])
    assert code == 0, f"{page}, YAML block {index + 1}, does not parse:\n{stderr[-2000:]}"
    config = yaml.safe_load(stdout)
    assert list(leaves(block))
    for path, value in leaves(block):
        try:
            printed = at(config, path)
        except (KeyError, IndexError, TypeError):
            pytest.fail(f"{page}, YAML block {index + 1}: {'.'.join(map(str, path))} is not in the parsed config")
        assert printed == value, f"{page}, YAML block {index + 1}: {'.'.join(map(str, path))} parsed as {printed!r}"
    assert not server_problems_in(block), (page, index + 1, server_problems_in(block))
