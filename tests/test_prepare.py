"""data.prepare: shards equal BOS + GPT-2 tokens of each document in order; every bad input is a clean exit 2."""
import gzip
import json
import re

import numpy as np
import pytest

from data.loader import TrainLoader, ValLoader
from data.prepare import PrepareError, ensure_sample_shards, main, prepare
from data.shard import BOS_ID, read_header, read_shard
from data.tokenizer import get_encoding


def make_corpus(root):
    """A folder with every supported kind of file; returns its documents in the order prepare must read them."""
    (root / "b").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / ".hidden" / "ignored.txt").write_text("never read")
    (root / "notes.csv").write_text("not,a,document")
    docs = {
        "a.txt": ["The first document.\n\nIt has two paragraphs, naïve café and 🙂."],
        "b/c.md": ["# Title\n\nSome *markdown*   text with   spaces.\n"],
        "b/d.jsonl": ["line one document", "line two: it's \u2028 a separator inside JSON", "x" * 300],
        "e.txt.gz": ["compressed text " * 50],
        "f.jsonl.gz": ["gz json one", "gz json two"],
    }
    for name, texts in docs.items():
        if ".jsonl" in name:
            lines = [json.dumps({"text": t, "id": i}, ensure_ascii=False) for i, t in enumerate(texts)]
            data = "\n\n".join(lines) + "\n"  # a blank line too, which is skipped
        else:
            data = texts[0]
        raw = data.encode("utf-8")
        (root / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    return [t for name in sorted(docs) for t in docs[name]]


def reference_stream(texts):
    encoding = get_encoding()
    return np.concatenate([[BOS_ID] + encoding.encode_ordinary(t) for t in texts])


def read_all(paths):
    return np.concatenate([read_shard(p) for p in paths])


def test_shards_hold_the_reference_stream(tmp_path):
    texts = make_corpus(tmp_path / "in")
    stream = reference_stream(texts)
    summary = prepare([tmp_path / "in"], tmp_path / "out", val_tokens=40, shard_tokens=50, workers=1)
    names = [p.name for p in summary["shards"]]
    assert names[0] == "corpus_val_000000.bin" and names[1] == "corpus_train_000001.bin"
    assert sorted(names) == sorted(p.name for p in (tmp_path / "out").iterdir())  # nothing else left in out
    assert read_header(summary["shards"][0]) == 41  # val_tokens + 1: inputs for exactly 40 predictions
    assert [read_header(p) for p in summary["shards"][1:-1]] == [50] * (len(names) - 2)
    np.testing.assert_array_equal(read_all(summary["shards"]), stream)
    assert summary["documents"] == len(texts) == 8 and summary["files"] == 5 and summary["skipped_files"] == 0
    assert summary["tokens"] == len(stream) and summary["val_tokens"] + summary["train_tokens"] == len(stream)


def test_pool_output_is_identical(tmp_path, monkeypatch):
    make_corpus(tmp_path / "in")
    monkeypatch.setattr("data.prepare.BATCH_CHARS", 100)  # many small tasks, so order across workers matters
    one = prepare([tmp_path / "in"], tmp_path / "one", val_tokens=40, shard_tokens=50, workers=1)
    two = prepare([tmp_path / "in"], tmp_path / "two", val_tokens=40, shard_tokens=50, workers=2)
    assert [p.name for p in one["shards"]] == [p.name for p in two["shards"]]
    for a, b in zip(one["shards"], two["shards"]):
        assert a.read_bytes() == b.read_bytes()


def test_non_utf8_text_is_skipped_and_counted(tmp_path, capsys):
    texts = make_corpus(tmp_path / "in")
    (tmp_path / "in" / "bad.txt").write_bytes(b"caf\xe9 in latin-1")
    summary = prepare([tmp_path / "in"], tmp_path / "out", val_tokens=40, shard_tokens=1000, workers=1)
    assert summary["skipped_files"] == 1 and summary["documents"] == len(texts)
    assert "warning: skipping" in capsys.readouterr().err


@pytest.mark.parametrize("case,match", [
    ("bad_json", r"d.jsonl:2: not a UTF-8 JSON object"),
    ("no_text", r"d.jsonl:1: no \"text\" string"),
    ("missing", r"input .*nowhere does not exist"),
    ("empty", r"no documents found"),
    ("too_small", r"the corpus has \d+ tokens, but the validation shard alone takes --val_tokens \+ 1 = 100,001"),
])
def test_bad_inputs_exit_2_without_output(tmp_path, capsys, case, match):
    inputs = tmp_path / "in"
    make_corpus(inputs)
    val_tokens = 10
    if case == "bad_json":
        (inputs / "b" / "d.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    elif case == "no_text":
        (inputs / "b" / "d.jsonl").write_text('{"content": "wrong field"}\n')
    elif case == "missing":
        inputs = tmp_path / "nowhere"
    elif case == "empty":
        inputs = tmp_path / "empty"
        inputs.mkdir()
        (inputs / "blank.txt").write_text("")
    else:
        val_tokens = 100_000
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main([str(inputs), "--out", str(out), "--val_tokens", str(val_tokens), "--workers", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert re.search(match, err), err
    assert not out.exists()


@pytest.mark.parametrize("text", ["a few words", "one two three four five six seven eight nine ten eleven"])
def test_too_small_advice_is_accepted(tmp_path, capsys, text):
    """The --val_tokens that the 'too small' error advises is one data.prepare then accepts."""
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": text}) + "\n")
    args = [str(tmp_path / "tiny.jsonl"), "--out", str(tmp_path / "out"), "--workers", "1"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    advised = re.search(r"lower --val_tokens \(e.g. to (\d+)\)", capsys.readouterr().err).group(1)
    main(args + ["--val_tokens", advised])
    assert (tmp_path / "out" / "corpus_train_000001.bin").exists()


def test_too_small_for_any_val_tokens_says_add_text(tmp_path, capsys):
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "a"}) + "\n")  # BOS + 1 token
    with pytest.raises(SystemExit):
        main([str(tmp_path / "tiny.jsonl"), "--out", str(tmp_path / "out"), "--val_tokens", "1", "--workers", "1"])
    err = capsys.readouterr().err
    assert "the corpus has 2 tokens" in err and "add text" in err and "lower --val_tokens" not in err


def test_existing_shards_are_not_mixed_with_new_ones(tmp_path):
    make_corpus(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "out", val_tokens=40, workers=1)
    with pytest.raises(PrepareError, match="already holds corpus_\\*.bin shards"):
        prepare([tmp_path / "in"], tmp_path / "out", val_tokens=40, workers=1)


def test_cli_summary_line(tmp_path, capsys):
    make_corpus(tmp_path / "in")
    main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--val_tokens", "40", "--workers", "1",
          "--name", "mine"])
    out = capsys.readouterr().out
    assert out.startswith("8 documents from 5 files (0 skipped") and "tokens/s" in out
    assert (tmp_path / "out" / "mine_val_000000.bin").exists()


def test_sample_shards_feed_the_loaders(tmp_path):
    train_glob, val_glob = ensure_sample_shards(tmp_path)
    folder = next(tmp_path.iterdir())
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert ensure_sample_shards(tmp_path) == (train_glob, val_glob)  # second call: nothing re-made
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamp
    assert sorted(stamp) == ["sample_train_000001.bin", "sample_val_000000.bin"]
    assert read_header(folder / "sample_val_000000.bin") == 65_537
    assert read_header(folder / "sample_train_000001.bin") >= 1_000_000
    loader = TrainLoader(train_glob, seq_len=256, batch_size=4, device_batch_size=2, rank=0, world_size=1,
                         device="cpu")
    inputs, _ = loader.next_batch()
    assert inputs[0, 0] == BOS_ID
    val = ValLoader(val_glob, val_tokens=65_536, seq_len=1024, device_batch_size=4, rank=0, world_size=1,
                    device="cpu")
    assert sum(int((y != -100).sum()) for _, y in val) == 65_536
