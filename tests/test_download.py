"""data/cached_fineweb10B.py against a fake hub on 127.0.0.1 (tests/conftest.py): download, skip, repair, and the
offline message."""
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from data.cached_fineweb10B import DownloadError, download, main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def online(monkeypatch):
    """Hub access allowed whatever the caller's shell sets: huggingface_hub reads HF_HUB_OFFLINE (or
    TRANSFORMERS_OFFLINE) once, at import, into constants.HF_HUB_OFFLINE, so the constant is what must change."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_download_skip_and_repair(tmp_path, hub, shard_bytes, online):
    endpoint, requests = hub
    paths = download(2, tmp_path, endpoint=endpoint)
    assert [p.name for p in paths] == list(shard_bytes)
    for path in paths:
        assert path.read_bytes() == shard_bytes[path.name]
    assert {name for method, name in requests if method == "GET"} == set(shard_bytes)

    requests.clear()
    assert download(2, tmp_path, endpoint=endpoint) == paths
    assert requests == []  # complete files are not even checked against the hub

    partial = tmp_path / "fineweb_train_000001.bin"
    partial.write_bytes(shard_bytes[partial.name][:-10])
    download(2, tmp_path, endpoint=endpoint)
    assert partial.read_bytes() == shard_bytes[partial.name]
    assert {name for _, name in requests} == {partial.name}


def test_offline_lists_exactly_the_missing_files(tmp_path, hub, shard_bytes, online, monkeypatch):
    endpoint, requests = hub
    download(1, tmp_path, endpoint=endpoint)
    requests.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DownloadError) as error:
        download(2, tmp_path, endpoint=endpoint)
    message = str(error.value)
    assert "HF_HUB_OFFLINE is set" in message and "1 file(s) still missing" in message
    assert "fineweb_train_000002.bin" in message and "fineweb_train_000001.bin" not in message
    assert "python data/cached_fineweb10B.py 2" in message and "copy these files" in message
    assert requests == []


def test_script_runs_from_the_repo_root_and_exits_2_offline(tmp_path):
    result = subprocess.run([sys.executable, "data/cached_fineweb10B.py", "1", "--out", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: could not download") and "fineweb_val_000000.bin" in result.stderr


def test_bad_n_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["0"])
    assert exit_info.value.code == 2 and "train shards 1 to 103" in capsys.readouterr().err


def test_a_bad_out_folder_names_the_fix(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(DownloadError, match=r"cannot make the folder .*a_file/shards \(Not a directory\): give --out "
                                            r"a folder you can write to"):
        download(1, tmp_path / "a_file" / "shards")
    (tmp_path / "fineweb_val_000000.bin").mkdir()
    with pytest.raises(DownloadError, match=r"fineweb_val_000000.bin is a folder where a shard belongs: move it away"):
        download(1, tmp_path)
    assert (tmp_path / "fineweb_val_000000.bin").is_dir()
