"""Token shard files, manifest and memory-mapped reads."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from lmforge.data.shards import TokenShards, dtype_for_vocab, write_token_shards


def _arrays(seed: int = 0, vocab: int = 1000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n) for n in (0, 7, 13, 1, 25, 9)]


def test_write_read_across_boundaries_equals_concatenation(tmp_path):
    arrays = _arrays()
    full = np.concatenate(arrays)
    m = write_token_shards(iter(arrays), tmp_path / "ds", shard_tokens=10, vocab_size=1000,
                           meta={"source": "test", "documents": 6})
    assert [s["tokens"] for s in m["shards"]] == [10, 10, 10, 10, 10, 5]
    ds = TokenShards(tmp_path / "ds")
    assert len(ds) == full.size == 55
    for start in range(0, 55):
        for length in (0, 1, 9, 10, 11, 23, 55 - start):
            if start + length <= 55:
                got = ds.read(start, length)
                assert got.dtype == np.int64
                np.testing.assert_array_equal(got, full[start:start + length])
    starts = np.array([0, 3, 8, 10, 19, 30, 44])
    np.testing.assert_array_equal(ds.gather(starts, 11), np.stack([full[s:s + 11] for s in starts]))
    with pytest.raises(IndexError):
        ds.read(50, 6)
    assert sum(len(c) for c in ds.iter_chunks(4)) == 55


def test_manifest_fields(tmp_path):
    arrays = _arrays()
    m = write_token_shards(arrays, tmp_path / "ds", shard_tokens=16, vocab_size=1000,
                           meta={"tokenizer_sha256": "ab" * 32, "documents": 6})
    on_disk = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert on_disk == m
    assert m["version"] == 1 and m["format"] == "lmforge-token-shards"
    assert m["dtype"] == "uint16" and m["byte_order"] == "little"
    assert m["vocab_size"] == 1000 and m["total_tokens"] == 55
    assert m["meta"] == {"tokenizer_sha256": "ab" * 32, "documents": 6}
    for rec in m["shards"]:
        data = (tmp_path / "ds" / rec["file"]).read_bytes()
        assert len(data) == 2 * rec["tokens"]
        assert hashlib.sha256(data).hexdigest() == rec["sha256"]
    assert [r["file"] for r in m["shards"]] == ["shard_00000.bin", "shard_00001.bin",
                                                 "shard_00002.bin", "shard_00003.bin"]
    assert not list(tmp_path.glob(".tmp*"))
    assert TokenShards(tmp_path / "ds").manifest == m


@pytest.mark.parametrize("vocab,dtype,itemsize", [(256, "uint16", 2), (65536, "uint16", 2),
                                                   (65537, "uint32", 4), (200_000, "uint32", 4)])
def test_dtype_choice(tmp_path, vocab, dtype, itemsize):
    assert dtype_for_vocab(vocab).name == dtype
    ids = np.array([0, 1, vocab - 1, 255], dtype=np.int64)
    m = write_token_shards([ids], tmp_path / "ds", 100, vocab, {})
    assert m["dtype"] == dtype
    raw = (tmp_path / "ds" / "shard_00000.bin").read_bytes()
    assert len(raw) == 4 * itemsize
    assert int.from_bytes(raw[2 * itemsize:3 * itemsize], "little") == vocab - 1
    np.testing.assert_array_equal(TokenShards(tmp_path / "ds").read(0, 4), ids)


def test_corrupted_shard_detected(tmp_path):
    write_token_shards(_arrays(), tmp_path / "ds", 10, 1000, {})
    shard = tmp_path / "ds" / "shard_00002.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    TokenShards(tmp_path / "ds")  # sizes still match: only the checksum can tell
    with pytest.raises(ValueError, match="shard_00002.bin is corrupted"):
        TokenShards(tmp_path / "ds", verify_checksums=True)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="shard_00002.bin has 18 bytes"):
        TokenShards(tmp_path / "ds")
    shard.unlink()
    with pytest.raises(ValueError, match="shard_00002.bin .* missing"):
        TokenShards(tmp_path / "ds")


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="outside \\[0, 10\\)"):
        write_token_shards([np.array([3, 10])], tmp_path / "a", 4, 10, {})
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".tmp*"))
    with pytest.raises(ValueError, match="empty"):
        write_token_shards([np.array([], dtype=np.int64)], tmp_path / "b", 4, 10, {})
    write_token_shards([np.array([1])], tmp_path / "c", 4, 10, {})
    with pytest.raises(ValueError, match="already exists"):
        write_token_shards([np.array([1])], tmp_path / "c", 4, 10, {})
    with pytest.raises(ValueError, match="manifest.json not found"):
        TokenShards(tmp_path / "nowhere")


# ---- issue 18 §3: one-line errors naming the file, and the max id for the vocabulary check ----

def _edit_manifest(ds, change) -> None:
    path = ds / "manifest.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def test_damaged_manifests_give_one_line_errors_naming_the_file(tmp_path):
    ds = tmp_path / "ds"
    write_token_shards(_arrays(), ds, 10, 1000, {})
    good = (ds / "manifest.json").read_text()
    path = str(ds / "manifest.json")
    _edit_manifest(ds, lambda m: [m])
    with pytest.raises(ValueError) as e:
        TokenShards(ds)
    assert str(e.value) == (f"{path}: a JSON list, not a token-shard manifest (a JSON object "
                            f"with \"shards\"); re-run prepare")
    (ds / "manifest.json").write_text(good)
    _edit_manifest(ds, lambda m: {k: v for k, v in m.items() if k != "shards"})
    with pytest.raises(ValueError) as e:
        TokenShards(ds)
    assert str(e.value) == (f"{path}: no 'shards' in the manifest; the dataset is incomplete, "
                            f"re-run prepare")
    (ds / "manifest.json").write_text(good)
    _edit_manifest(ds, lambda m: {**m, "shards": [{"file": 3}]})
    with pytest.raises(ValueError, match="must be a list of"):
        TokenShards(ds)
    # a wrong length is a ValueError naming the file, not an assert (which python -O removes)
    (ds / "manifest.json").write_text(good)
    _edit_manifest(ds, lambda m: {**m, "total_tokens": 56})
    with pytest.raises(ValueError) as e:
        TokenShards(ds)
    assert str(e.value) == (f"{path}: total_tokens = 56 but its shards hold 55 tokens; the "
                            f"manifest is damaged, re-run prepare")


def test_max_id_from_the_manifest_or_the_data_and_corrupt_ids_detected(tmp_path):
    ds = tmp_path / "ds"
    arrays = _arrays()
    m = write_token_shards(arrays, ds, 10, 1000, {})
    want = int(np.concatenate(arrays).max())
    assert m["max_id"] == want == TokenShards(ds).max_id
    assert [r["max_id"] for r in m["shards"]] == [
        int(np.concatenate(arrays)[k:k + 10].max()) for k in range(0, 55, 10)]
    # a manifest from before the field: computed from the data
    _edit_manifest(ds, lambda m: {**m, "max_id": None})
    assert TokenShards(ds).max_id == want
    # corrupt bytes of the right size: id 60000 with a vocabulary of 1000
    shard = ds / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[0:2] = (60000).to_bytes(2, "little")
    shard.write_bytes(bytes(data))
    assert TokenShards(ds).max_id == 60000  # (no recorded max: the data's)
    (ds / "manifest.json").write_text(json.dumps(m))
    sh = TokenShards(ds)
    assert sh.max_id == want < sh.vocab_size  # recorded: the trainer's start-up check passes
    with pytest.raises(ValueError, match="shard_00001.bin is corrupted: sha256 differs"):
        TokenShards(ds, verify_checksums=True)  # ... and the checksum option catches the bytes
    m["shards"][1]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()  # a forged checksum
    (ds / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="shard_00001.bin is corrupted: its largest token id is "
                                         "60000"):
        TokenShards(ds, verify_checksums=True)
