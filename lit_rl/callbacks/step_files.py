"""The files of one exported step, written fast after the first export of a run.

`save_pretrained` re-serialises the config and generation config on every call
(milliseconds of validation and deep copies), and the tokenizer files never change
during a run. For a small model that fixed cost outweighs writing the weights. So the
first export of a run takes the general path (`model.save_pretrained`,
`tokenizer.save_pretrained`) and records what it wrote: the bytes of every small file,
and the names and metadata of the tensors in the single safetensors file. Later exports
write those bytes again and the weights with plain `safetensors.torch.save_file`.

The replay is used only when it is proven to give the very same bytes: the first export
also serialises the weights the fast way in memory and compares them with the file
`save_pretrained` wrote. Sharded checkpoints, renamed keys or any other difference keep
the general path for the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

WEIGHTS = "model.safetensors"


@dataclass
class StepFiles:
    small_files: dict[str, bytes]  # file name -> content, everything but the weights
    tensor_names: list[str]  # what save_pretrained stored (tied copies dropped), in its order
    metadata: dict[str, str] | None

    def write(self, state: dict[str, torch.Tensor], directory: Path) -> None:
        for name, content in self.small_files.items():
            (directory / name).write_bytes(content)
        save_file({k: state[k] for k in self.tensor_names}, str(directory / WEIGHTS), metadata=self.metadata)


def learn_step_files(directory: Path, state: dict[str, torch.Tensor]) -> StepFiles | None:
    """What `save_pretrained` wrote into `directory` for `state`, if a replay gives the same bytes."""
    names = sorted(p.name for p in directory.iterdir())
    weights = [n for n in names if n.endswith(".safetensors") or n.endswith(".safetensors.index.json")]
    if weights != [WEIGHTS] or any(not (directory / n).is_file() for n in names):
        return None  # sharded or unexpected layout: keep the general path
    with safe_open(directory / WEIGHTS, "pt") as f:
        tensor_names, metadata = list(f.keys()), f.metadata()
    if not set(tensor_names) <= set(state):
        return None  # save_pretrained renamed keys
    if save({k: state[k] for k in tensor_names}, metadata=metadata) != (directory / WEIGHTS).read_bytes():
        return None
    small = {n: (directory / n).read_bytes() for n in names if n != WEIGHTS}
    return StepFiles(small, tensor_names, metadata)
