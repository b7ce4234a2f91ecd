"""data.shard: the llm.c / speedrun .bin layout byte for byte, a clear error for every bad file, and the start-up
check of all shards."""
import errno
import os
from pathlib import Path

import numpy as np
import pytest

import data.shard
from data.shard import (BOS_ID, HEADER_BYTES, MAGIC, VERSION, VOCAB_SIZE, ShardError, check_shards, check_token_ids,
                        read_header, read_shard, write_shard)


def test_round_trip_and_exact_layout(tmp_path):
    tokens = np.array([BOS_ID, 0, 1, 65535, 464, 2068], dtype=np.int64)
    path = tmp_path / "a.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert (header[0], header[1], header[2]) == (20240520, 1, 6) and not header[3:].any()
    assert raw[HEADER_BYTES:] == tokens.astype("<u2").tobytes()
    assert read_header(path) == 6
    loaded = read_shard(path)
    assert loaded.dtype == np.uint16
    np.testing.assert_array_equal(loaded, tokens)
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]  # no temporary file left behind


def test_written_shards_are_world_readable_whatever_the_umask(tmp_path):
    """write_shard goes through mkstemp, which creates files 0600: without the explicit chmod, shards written by
    one user (or a root container) could not be read by the training processes of another."""
    previous = os.umask(0o077)  # the most restrictive common umask: it alone would also give 0600
    try:
        write_shard(tmp_path / "a.bin", np.array([BOS_ID, 1, 2], dtype=np.uint16))
    finally:
        os.umask(previous)
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o644


def test_empty_shard(tmp_path):
    write_shard(tmp_path / "e.bin", np.array([], dtype=np.uint16))
    assert read_header(tmp_path / "e.bin") == 0 and read_shard(tmp_path / "e.bin").size == 0


@pytest.mark.parametrize("tokens,match", [
    ([1, 65536], r"\[0, 65536\).*\[1, 65536\]"),
    ([-1, 5], r"\[0, 65536\).*\[-1, 5\]"),
    ([[1, 2]], "must be 1-D"),
])
def test_write_refuses_what_does_not_fit(tmp_path, tokens, match):
    with pytest.raises(ValueError, match=match):
        write_shard(tmp_path / "x.bin", np.array(tokens))
    assert not list(tmp_path.iterdir())


def header_bytes(magic=MAGIC, version=VERSION, count=4):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    return header.tobytes()


@pytest.mark.parametrize("content,match", [
    (b"\x00" * 100, r"only 100 bytes, shorter than the 1024-byte header.*re-download"),
    (header_bytes(magic=12345) + b"\x00" * 8, r"magic number 12345, expected 20240520.*data\.prepare"),
    (header_bytes(version=7) + b"\x00" * 8, r"format version 7, expected 1.*data\.prepare"),
    (header_bytes(count=4) + b"\x00" * 6, r"header says 4 tokens \(8 bytes\) but only 6 bytes.*incomplete"),
    (header_bytes(count=-3) + b"\x00" * 6, r"header says -3 tokens"),
    (header_bytes(count=4) + b"\x00" * 10, r"header says 4 tokens \(8 bytes\) but 10 bytes.*corrupt"),
])
def test_every_bad_file_names_itself_the_problem_and_the_fix(tmp_path, content, match):
    path = tmp_path / "bad_000001.bin"
    path.write_bytes(content)
    for reader in (read_header, read_shard):
        with pytest.raises(ShardError, match=match) as error:
            reader(path)
        assert str(path) in str(error.value)
        assert "cached_fineweb10B.py" in str(error.value) and "data.prepare" in str(error.value)


def test_token_ids_outside_the_vocabulary(tmp_path):
    check_token_ids(np.array([0, VOCAB_SIZE - 1], dtype=np.uint16), "ok.bin")
    with pytest.raises(ShardError, match=r"bad.bin: holds token id 50257, but the GPT-2 vocabulary has 50257"):
        check_token_ids(np.array([3, VOCAB_SIZE, 2], dtype=np.uint16), "bad.bin")
    check_token_ids(np.array([0, 999], dtype=np.uint16), "ok.bin", vocab_size=1000)  # a smaller model's limit
    with pytest.raises(ShardError, match=r"small.bin: holds token id 1000, but the model embeds only 1000 ids: give "
                                         r"the model a vocab_size of at least 50257"):
        check_token_ids(np.array([1000], dtype=np.uint16), "small.bin", vocab_size=1000)


# --- unreadable shards -------------------------------------------------------------------------------------------

running_as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")


def refuse(monkeypatch, path) -> None:
    """Make data.shard's open() refuse `path` as chmod 000 would for a user that is not root."""
    def refusing(file, *args, **kwargs):
        if Path(file) == Path(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return open(file, *args, **kwargs)

    monkeypatch.setattr(data.shard, "open", refusing, raising=False)


@pytest.mark.parametrize("how", ["monkeypatched", pytest.param("chmod", marks=running_as_root)])
def test_an_unreadable_shard_names_itself_and_the_fix(tmp_path, monkeypatch, how):
    path = tmp_path / "train_000001.bin"
    write_shard(path, np.arange(10, dtype=np.uint16))
    if how == "chmod":
        path.chmod(0)
    else:
        refuse(monkeypatch, path)
    for reader in (read_header, read_shard, lambda p: check_shards([p], VOCAB_SIZE)):
        with pytest.raises(ShardError) as error:
            reader(path)
        assert str(error.value) == (f"shard {path}: cannot be read (Permission denied): make it readable with "
                                    f"`chmod a+r {path}`, or run as a user allowed to read it")


# --- the start-up check ------------------------------------------------------------------------------------------

def shards(folder, count, size=50):
    paths = [folder / f"train_{i:06d}.bin" for i in range(1, count + 1)]
    for i, path in enumerate(paths):
        write_shard(path, np.arange(i, i + size, dtype=np.uint16))
    return paths


def test_check_shards_counts_the_tokens_of_good_shards(tmp_path):
    paths = shards(tmp_path, 3)
    assert check_shards(paths, VOCAB_SIZE) == 150
    assert check_shards(paths + paths[:1], VOCAB_SIZE) == 150  # a shard given twice (train and val) counts once
    assert check_shards([], VOCAB_SIZE) == 0


def test_a_bad_id_in_the_last_shard_fails_the_check(tmp_path):
    paths = shards(tmp_path, 5)
    tokens = read_shard(paths[-1]).copy()
    tokens[-1] = 60_000
    write_shard(paths[-1], tokens)
    with pytest.raises(ShardError, match=rf"^shard {paths[-1]}: holds token id 60000, but the GPT-2 vocabulary has "
                                         rf"50257 ids: it was tokenized with another tokenizer; "):
        check_shards(paths, VOCAB_SIZE)
    tokens[-1] = 3000  # a GPT-2 id, but past the embedding of a model with 1000 rows
    write_shard(paths[-1], tokens)
    with pytest.raises(ShardError, match=rf"^shard {paths[-1]}: holds token id 3000, but the model embeds only 1000"):
        check_shards(paths, 1000)


def test_every_header_is_checked_before_any_token(tmp_path, monkeypatch):
    """A cut-off last shard is reported before the first shard's bad id, and without reading any token: headers
    first, so a bad file anywhere fails in milliseconds, not after minutes of scanning."""
    paths = shards(tmp_path, 3)
    write_shard(paths[0], np.array([1, 60_000], dtype=np.uint16))
    paths[-1].write_bytes(paths[-1].read_bytes()[:-4])
    scanned = []
    monkeypatch.setattr(data.shard, "check_token_ids", lambda tokens, path, vocab_size: scanned.append(path))
    with pytest.raises(ShardError, match=rf"^shard {paths[-1]}: header says 50 tokens \(100 bytes\) but only 96"):
        check_shards(paths, VOCAB_SIZE)
    assert scanned == []
