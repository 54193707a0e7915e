"""Token data is checked on the way in (issue 34, item 5).

* Flipped low bytes (ids still in range) are caught by the default `data.verify_checksums =
  "first_open"`: the shard is hashed the first time the run reads from it, and the error names the
  file. (Before, checksums were off by default and the run trained on the corrupt tokens.)
* Out-of-range ids, with hashing off, are caught by the range check of every read: the error names
  the shard file, the offset, the id and the vocabulary. (Before: `operands could not be broadcast
  together with shapes (320,) (60001,) (320,)` from the unigram count, naming neither.)
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

import lmforge.data.shards as shards_mod
from lmforge.config import load_config
from lmforge.data.loader import PackedLoader
from lmforge.data.prepare import PreparedData
from lmforge.data.shards import TokenShards
from lmforge.train.trainer import Trainer
from tests.test_ckpt import SMALL


def corrupt_copy(small_data, tmp_path, offset: int, value, drop_unigram: bool = False):
    """A copy of the prepared data whose first train shard has token `offset` changed by
    `value(old id)`; the manifest keeps its records (sha256, largest id), as a bit flip on disk would."""
    root = tmp_path / "data"
    shutil.copytree(small_data.train_dir.parent, root)
    train = root / small_data.train_dir.name
    manifest = json.loads((train / "manifest.json").read_text())
    shard = train / manifest["shards"][0]["file"]
    ids = np.fromfile(shard, dtype="<u2")
    ids[offset] = value(int(ids[offset]))
    ids.tofile(shard)
    if drop_unigram:  # a folder prepared before the counts were recorded: the run counts them from the data
        manifest.pop("unigram")
        (train / "manifest.json").write_text(json.dumps(manifest))
    data = PreparedData(**{**small_data.__dict__, "train_dir": train, "val_dir": root / small_data.val_dir.name})
    return data, shard


def trainer(data, tmp_path, **overrides) -> Trainer:
    return Trainer(load_config("tiny", {**SMALL, "train.steps": 4, "checkpoint.every_steps": 0, **overrides}),
                   out_dir=tmp_path / "run", data=data)


def test_flipped_low_bytes_are_caught_the_first_time_the_shard_is_read(small_data, tmp_path):
    data, shard = corrupt_copy(small_data, tmp_path, 1000, lambda v: v ^ 1)  # still a valid id
    assert load_config("tiny").data.verify_checksums == "first_open"  # the default
    with pytest.raises(ValueError, match=f"shard {re.escape(str(shard))} is corrupted: sha256 differs"):
        trainer(data, tmp_path).fit()
    assert not (tmp_path / "run" / "summary.json").exists()


def test_out_of_range_ids_name_the_shard_and_the_offset(small_data, tmp_path):
    data, shard = corrupt_copy(small_data, tmp_path, 1234, lambda v: 60000, drop_unigram=True)
    named = (f"token shard {re.escape(str(shard))} is corrupt: the token at offset 1,234 \\(byte 2,468\\) is id "
             f"60000, outside the vocabulary \\(vocab_size 320")
    with pytest.raises(ValueError, match=named):  # (the run's unigram count reads it first)
        trainer(data, tmp_path, **{"data.verify_checksums": "never"}).fit()

    # every batch is range-checked: the loader's gather and read name it alike
    shards = TokenShards(data.train_dir, verify_checksums="never")
    loader = PackedLoader(shards, 32, 8, seed=0)
    with pytest.raises(ValueError, match=named):
        for _ in range(len(shards) // (32 * 8) + 2):  # one epoch reaches the window holding it
            loader.next_batch()
    with pytest.raises(ValueError, match=named):
        shards.read(1200, 100)


def test_first_open_hashes_each_shard_once_per_process(small_data, tmp_path):
    data, shard = corrupt_copy(small_data, tmp_path, 0, lambda v: v)  # an intact copy
    shards = TokenShards(data.train_dir, verify_checksums="first_open")
    key = str(shard.resolve())
    assert not any(k[0] == key for k in shards_mod._VERIFIED)  # opening hashes nothing
    shards.read(0, 10)
    assert any(k[0] == key for k in shards_mod._VERIFIED)
    ids = np.fromfile(shard, dtype="<u2")
    ids[5] ^= 1
    ids.tofile(shard)  # (a new mtime: a changed file is hashed again)
    with pytest.raises(ValueError, match="sha256 differs"):
        TokenShards(data.train_dir, verify_checksums="first_open").read(0, 10)
    with pytest.raises(ValueError, match="sha256 differs"):  # "always" (= the old `true`): at open
        TokenShards(data.train_dir, verify_checksums=True)
