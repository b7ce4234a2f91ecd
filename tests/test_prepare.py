"""data.prepare: shards equal BOS + GPT-2 tokens of each document in order; every bad input is a clean exit 2."""
import errno
import glob
import gzip
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import data.prepare
from data.loader import TrainLoader, ValLoader
from data.prepare import SAMPLE_DIR, PrepareError, ensure_sample_shards, main, prepare
from data.shard import BOS_ID, read_header, read_shard
from data import tokenizer
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
    assert summary["documents"] == len(texts) == 8 and summary["files"] == 6  # and notes.csv, skipped:
    assert [(path.name, category) for path, category, _ in summary["skipped"]] == [("notes.csv", "unknown extension")]
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
    assert [(p.name, category) for p, category, _ in summary["skipped"]] == [("notes.csv", "unknown extension"),
                                                                             ("bad.txt", "not UTF-8")]
    assert summary["documents"] == len(texts)
    assert f"warning: skipping {tmp_path / 'in' / 'bad.txt'}: not UTF-8 text" in capsys.readouterr().err


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
    *warnings, err = capsys.readouterr().err.splitlines()
    assert err.startswith("error: ")
    if case == "too_small":  # every file was read: the one skipped is named above the error
        assert len(warnings) == 1
        assert warnings[0].startswith(f"warning: skipping {inputs / 'notes.csv'}: unknown extension .csv: ")
    else:  # an error in a file or an option comes alone
        assert warnings == []
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


@pytest.mark.parametrize("case,match", [
    ("out_is_file", r"--out .*taken is a file: give a folder \(new or existing\) for the shards"),
    ("out_below_file", r"cannot write to --out .*taken/out \(Not a directory\): choose a folder you can write to"),
    ("workers_zero", r"--workers=0 must be positive"),
    ("damaged_vocab", r"gpt2/vocab.bpe has sha256 .*: the file is damaged; restore it with "
                      r"`git checkout -- data/gpt2`"),
    ("missing_vocab", r"cannot read the GPT-2 tokenizer file .*gpt2/vocab.bpe \(No such file or directory\): restore "
                      r"it with `git checkout -- data/gpt2`"),
])
def test_bad_options_exit_2_and_write_nothing(tmp_path, capsys, monkeypatch, case, match):
    make_corpus(tmp_path / "in")
    (tmp_path / "taken").write_text("a regular file")
    out, workers = tmp_path / "new" / "out", "1"
    if case == "out_is_file":
        out = tmp_path / "taken"
    elif case == "out_below_file":
        out = tmp_path / "taken" / "out"
    elif case == "workers_zero":
        workers = "0"
    else:  # a copy of the tokenizer files with vocab.bpe damaged or missing
        copy = tmp_path / "gpt2"
        copy.mkdir()
        for name in tokenizer.GPT2_FILES:
            (copy / name).write_bytes((tokenizer.GPT2_DIR / name).read_bytes() + b" " * (name == "vocab.bpe"))
        if case == "missing_vocab":
            (copy / "vocab.bpe").unlink()
        monkeypatch.setattr(tokenizer, "GPT2_DIR", copy)
        tokenizer.get_encoding.cache_clear()  # an earlier test's encoding would hide the files
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "in"), "--out", str(out), "--val_tokens", "40", "--workers", workers])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert re.search(match, err), err
    assert not (tmp_path / "new").exists() and (tmp_path / "taken").read_text() == "a regular file"


def test_a_file_named_twice_is_read_once(tmp_path, capsys):
    """A file given by name and inside a folder also given would otherwise land in both the val and train shards."""
    texts = make_corpus(tmp_path / "in")
    summary = prepare([tmp_path / "in" / "a.txt", tmp_path / "in", tmp_path / "in" / "b" / ".." / "a.txt"],
                      tmp_path / "out", val_tokens=40, workers=1)
    assert summary["files"] == 6 and summary["documents"] == len(texts)
    assert "warning: 2 file(s) given more than once (by name, or inside a folder also given) are read once" in \
        capsys.readouterr().err


def test_byte_order_marks_are_not_text(tmp_path):
    """UTF-8 files that open with a byte-order mark (as some Windows editors write them) hold the same documents."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "bom").mkdir()
    for folder, bom in (("plain", b""), ("bom", b"\xef\xbb\xbf")):
        (tmp_path / folder / "a.txt").write_bytes(bom + "some text, enough of it. ".encode() * 20)
        (tmp_path / folder / "b.jsonl").write_bytes(bom + b'{"text": "a json line"}\n{"text": "another one"}\n')
    plain = prepare([tmp_path / "plain"], tmp_path / "out_plain", val_tokens=10, workers=1)
    bom = prepare([tmp_path / "bom"], tmp_path / "out_bom", val_tokens=10, workers=1)
    assert bom["documents"] == plain["documents"] == 3
    np.testing.assert_array_equal(read_all(bom["shards"]), read_all(plain["shards"]))


def test_utf16_text_gets_the_utf16_advice(tmp_path, capsys):
    texts = make_corpus(tmp_path / "in")
    (tmp_path / "in" / "wide.txt").write_bytes("wide text".encode("utf-16"))
    summary = prepare([tmp_path / "in"], tmp_path / "out", val_tokens=40, workers=1)
    assert [p.name for p, category, _ in summary["skipped"] if category == "not UTF-8"] == ["wide.txt"]
    assert summary["documents"] == len(texts)
    assert "wide.txt: not UTF-8 text" in (err := capsys.readouterr().err) and "`iconv -f utf-16 -t utf-8`" in err


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
    assert out.startswith("8 documents from 6 files (1 skipped: unknown extension): ") and "tokens/s" in out
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


def test_sample_shards_go_to_the_temporary_folder_in_a_read_only_checkout(tmp_path, monkeypatch):
    """A checkout mounted read-only (a container) still runs the smoke preset: its shards go to the system's
    temporary folder. (Root writes through permission bits, so the test stands in for the access check.)"""
    import data.prepare

    monkeypatch.setattr(data.prepare, "SAMPLE_DIR", tmp_path / "checkout")
    (tmp_path / "checkout").mkdir()
    for source in sorted(SAMPLE_DIR.glob("*.jsonl.gz")):
        (tmp_path / "checkout" / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(data.prepare.os, "access", lambda path, mode: False)
    monkeypatch.setattr(data.prepare.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    train_glob, _ = ensure_sample_shards()
    assert train_glob.startswith(str(tmp_path / "tmp" / "gpt-speedrun-sample")) and glob.glob(train_glob)
    assert not (tmp_path / "checkout" / "shards").exists()


def test_a_missing_sample_corpus_names_the_fix(tmp_path, monkeypatch):
    import data.prepare

    monkeypatch.setattr(data.prepare, "SAMPLE_DIR", tmp_path)
    with pytest.raises(PrepareError, match=r"the sample corpus \(\*.jsonl.gz\) is missing from .*: restore it with "
                                           r"`git checkout -- data/sample`"):
        ensure_sample_shards()


def test_empty_jsonl_texts_are_not_documents(tmp_path):
    """A {"text": ""} line (common in scraped dumps) holds no document: it must add neither a document to the count
    nor a lone BOS to the stream, which would teach the model that documents can be empty."""
    lines = [{"text": "the first real document"}, {"text": "", "id": 7}, {"text": "the second real document"}]
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    (tmp_path / "with" / "a.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "without" / "a.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines if line["text"]))
    with_empty = prepare([tmp_path / "with"], tmp_path / "out_with", val_tokens=3, workers=1)
    without = prepare([tmp_path / "without"], tmp_path / "out_without", val_tokens=3, workers=1)
    assert with_empty["documents"] == without["documents"] == 2
    assert with_empty["tokens"] == without["tokens"] == len(reference_stream(["the first real document",
                                                                             "the second real document"]))
    np.testing.assert_array_equal(read_all(with_empty["shards"]), read_all(without["shards"]))


def test_changed_sample_bytes_make_a_new_shard_folder(tmp_path, monkeypatch):
    """The sample's shard folder is named by a hash of its files' names and bytes: an updated sample under the same
    file names must be re-tokenized, not served from the stale shards of the old one. A tiny stand-in corpus keeps
    this fast."""
    import data.prepare

    corpus = tmp_path / "sample"
    corpus.mkdir()
    for name, text in (("a.jsonl.gz", "alpha document text"), ("b.jsonl.gz", "beta document text")):
        (corpus / name).write_bytes(gzip.compress(json.dumps({"text": text}).encode() + b"\n"))
    monkeypatch.setattr(data.prepare, "SAMPLE_DIR", corpus)
    monkeypatch.setattr(data.prepare, "SAMPLE_VAL_TOKENS", 3)  # the stand-in has ~10 tokens, not ~1.5M
    old_train, _ = ensure_sample_shards(tmp_path / "shards")
    (corpus / "b.jsonl.gz").write_bytes(gzip.compress(json.dumps({"text": "beta, revised"}).encode() + b"\n"))
    new_train, _ = ensure_sample_shards(tmp_path / "shards")
    assert new_train != old_train
    assert len(list((tmp_path / "shards").iterdir())) == 2  # the old folder and the new one, nothing half-made
    stream = reference_stream(["alpha document text", "beta, revised"])
    folder = Path(new_train).parent
    shards = [folder / "sample_val_000000.bin", folder / "sample_train_000001.bin"]
    np.testing.assert_array_equal(read_all(shards), stream)  # the revised text, not the stale one


# --- files without an extension, and the files data.prepare skips --------------------------------------------------

running_as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")


def unreadable_for(monkeypatch, path: Path) -> None:
    """Make data.prepare's open() refuse `path` as chmod 000 would for a user that is not root."""
    import data.prepare

    def refusing(file, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return open(file, *args, **kwargs)

    monkeypatch.setattr(data.prepare, "open", refusing, raising=False)


def test_extensionless_text_files_are_documents(tmp_path, capsys):
    """LICENSE, COPYING and the like: text by their first bytes, not their names. A multibyte character cut by
    the sniffed prefix does not make a file binary."""
    license_text = "MIT License\n\nPermission is hereby granted, free of charge. " * 3
    copying_text = "x" * (data.prepare.SNIFF_BYTES - 1) + "é and more"  # é's two bytes straddle the prefix
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "LICENSE").write_text(license_text)
    (tmp_path / "in" / "COPYING").write_text(copying_text)
    (tmp_path / "in" / "NOTICE.gz").write_bytes(gzip.compress(b"a gzipped notice"))
    summary = prepare([tmp_path / "in"], tmp_path / "out", val_tokens=5, workers=1)
    assert summary["documents"] == 3 and summary["files"] == 3 and summary["skipped"] == []
    np.testing.assert_array_equal(read_all(summary["shards"]),
                                  reference_stream([copying_text, license_text, "a gzipped notice"]))
    assert capsys.readouterr().err == ""


def test_only_a_license_is_a_corpus(tmp_path, capsys):
    """The folder that once gave "0 readable files, 0 skipped": its one file is text, and is read."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "LICENSE").write_text("Permission is hereby granted, free of charge, to any person. " * 5)
    main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--val_tokens", "10", "--workers", "1"])
    assert capsys.readouterr().out.startswith("1 documents from 1 files: ")


def test_every_skipped_file_is_named_with_why(tmp_path, capsys, monkeypatch):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.txt").write_text("the one document in here, with a few words")
    (inputs / "blob").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(100))
    (inputs / "wide").write_bytes("wide text".encode("utf-16"))
    (inputs / "notes.csv").write_text("a,b")
    (inputs / "secret").write_text("text no one may read")
    unreadable_for(monkeypatch, inputs / "secret")
    main([str(inputs), "--out", str(tmp_path / "out"), "--val_tokens", "3", "--workers", "1"])
    out, err = capsys.readouterr()
    assert out.startswith("1 documents from 5 files (4 skipped: 1 binary, 1 not UTF-8, 1 unknown extension, "
                          "1 unreadable): ")
    assert err.splitlines() == [
        f"warning: skipping {inputs / 'blob'}: binary, not text (it holds NUL bytes)",
        f"warning: skipping {inputs / 'notes.csv'}: unknown extension .csv: data.prepare reads .txt, .md and .jsonl "
        f"files, optionally gzipped (.txt.gz, ...), and text files without an extension",
        f"warning: skipping {inputs / 'secret'}: cannot be read (Permission denied); make it readable with "
        f"`chmod a+r {inputs / 'secret'}` to include it",
        f"warning: skipping {inputs / 'wide'}: not UTF-8 text (invalid start byte at byte 0); convert it to include "
        f"it, e.g. `iconv -f utf-16 -t utf-8`",
    ]


def test_no_documents_names_the_skipped_files(tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "blob").write_bytes(bytes(10))
    (inputs / "data.csv").write_text("a,b")
    with pytest.raises(SystemExit):
        main([str(inputs), "--out", str(tmp_path / "out"), "--workers", "1"])
    *warnings, err = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2
    assert err == (f"error: no documents found in {inputs} (2 file(s), 2 skipped: {inputs / 'blob'}: binary, not "
                   f"text (it holds NUL bytes); {inputs / 'data.csv'}: unknown extension .csv: data.prepare reads "
                   f".txt, .md and .jsonl files, optionally gzipped (.txt.gz, ...), and text files without an "
                   f"extension): give .txt/.md/.jsonl files with text in them, or text files without an extension")


@pytest.mark.parametrize("how", ["monkeypatched", pytest.param("chmod", marks=running_as_root)])
def test_an_unreadable_file_in_a_folder_is_skipped_and_named(tmp_path, capsys, monkeypatch, how):
    texts = make_corpus(tmp_path / "in")
    secret = tmp_path / "in" / "b" / "secret.txt"
    secret.write_text("no one may read this")
    if how == "chmod":
        secret.chmod(0)
    else:
        unreadable_for(monkeypatch, secret)
    summary = prepare([tmp_path / "in"], tmp_path / "out", val_tokens=40, workers=1)
    assert summary["documents"] == len(texts)
    assert (secret, "unreadable", f"cannot be read (Permission denied); make it readable with `chmod a+r {secret}` "
                                  f"to include it") in summary["skipped"]
    assert f"warning: skipping {secret}: cannot be read (Permission denied)" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["monkeypatched", pytest.param("chmod", marks=running_as_root)])
def test_an_unreadable_file_named_on_the_command_line_is_an_error(tmp_path, capsys, monkeypatch, how):
    secret = tmp_path / "secret.txt"
    secret.write_text("no one may read this")
    if how == "chmod":
        secret.chmod(0)
    else:
        unreadable_for(monkeypatch, secret)
    with pytest.raises(SystemExit) as exit_info:
        main([str(secret), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"error: {secret}: cannot be read (Permission denied); make it readable with "
                                       f"`chmod a+r {secret}` to include it\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, content, why", [
    ("notes.csv", b"a,b", "unknown extension .csv: data.prepare reads .txt, .md and .jsonl files"),
    ("blob", b"\x00\x01", "binary, not text (it holds NUL bytes)"),
    ("latin", "café au lait".encode("latin-1"), "not UTF-8 text (invalid continuation byte at byte 3); convert it"),
    ("cut", "café".encode("latin-1"), "not UTF-8 text (unexpected end of data at byte 3); convert it"),
])
def test_a_file_named_on_the_command_line_that_is_not_read_is_an_error(tmp_path, capsys, name, content, why):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(SystemExit):
        main([str(tmp_path / name), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / name}: {why}")
