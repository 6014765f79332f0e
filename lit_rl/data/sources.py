"""Opening a dataset split with `datasets`: a hub name (with subset and split), local
json/jsonl/parquet/csv files, or a directory written by `Dataset.save_to_disk`.

Rows stay Arrow-backed (memory-mapped): nothing is tokenised here.
"""

from __future__ import annotations

import glob
import os

import datasets

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _local_builder(path: str) -> str | None:
    for ext, builder in _BUILDERS.items():
        if path.endswith(ext) and glob.glob(path):
            return builder
    return None


def single_split_kind(path: str) -> str | None:
    """What `path` is when it holds one split only (local files, a saved Dataset), else None.

    `open_split` gives such a source's rows whatever split is asked for, so a caller that wants a
    split by name (a held-out split) must refuse these instead of training on their rows twice."""
    if path.endswith(tuple(_BUILDERS)):
        return "a local file"
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
        return "a saved Dataset (not a DatasetDict)"
    return None


def open_split(
    path: str, *, subset: str | None = None, split: str = "train", data_files=None, max_examples: int | None = None
) -> datasets.Dataset:
    builder = _local_builder(path)
    if builder is None and path.endswith(tuple(_BUILDERS)):  # a local file by its name, but not there
        raise FileNotFoundError(f"no such file {path!r} (a relative path starts from {os.getcwd()})")
    if builder is not None:
        # Local files: `datasets` calls every file's rows the "train" split.
        ds = datasets.load_dataset(builder, data_files=path, split="train")
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(path, subset, split=split, data_files=data_files)
    if max_examples is not None:
        ds = ds.select(range(min(max_examples, len(ds))))
    return ds
