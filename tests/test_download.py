"""data/cached_fineweb10B.py against a fake hub on 127.0.0.1 (tests/conftest.py): download at the pinned revision,
skip, repair, the SHA-256 checks and their manifest, and the offline messages."""
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants

import data.cached_fineweb10B as fineweb
from data.cached_fineweb10B import MANIFEST, REPO_ID, REVISION, DownloadError, download, main
from data.shard import HEADER_BYTES

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def online(monkeypatch):
    """Hub access allowed whatever the caller's shell sets: huggingface_hub reads HF_HUB_OFFLINE (or
    TRANSFORMERS_OFFLINE) once, at import, into constants.HF_HUB_OFFLINE, so the constant is what must change."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def altered(body: bytes) -> bytes:
    """`body` with its first token changed: header and size still right, so only the hash tells."""
    token = np.frombuffer(body[HEADER_BYTES:HEADER_BYTES + 2], dtype="<u2")[0]
    return body[:HEADER_BYTES] + np.array([token ^ 1], dtype="<u2").tobytes() + body[HEADER_BYTES + 2:]


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files data.cached_fineweb10B hashes, in order."""
    names, sha = [], fineweb.file_sha256

    def counting(path):
        names.append(Path(path).name)
        return sha(path)

    monkeypatch.setattr(fineweb, "file_sha256", counting)
    return names


def test_download_skip_and_repair(tmp_path, hub, shard_bytes, online, hashed):
    endpoint, requests = hub
    paths = download(2, tmp_path, endpoint=endpoint)
    assert [p.name for p in paths] == list(shard_bytes)
    for path in paths:
        assert path.read_bytes() == shard_bytes[path.name]
    assert {name for method, name in requests if method == "GET"} == set(shard_bytes)
    assert {name for method, name in requests if method == "POST"} == set(shard_bytes)  # their published hashes
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["repo"] == REPO_ID and manifest["revision"] == REVISION
    assert {name: entry["sha256"] for name, entry in manifest["files"].items()} == \
        {name: sha256(body) for name, body in shard_bytes.items()}
    assert sorted(hashed) == sorted(shard_bytes)

    requests.clear()
    hashed.clear()
    assert download(2, tmp_path, endpoint=endpoint) == paths
    assert requests == [] and hashed == []  # recorded files are neither checked against the hub nor hashed again

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


def test_the_pinned_revision_is_what_is_fetched(tmp_path, hub, online, monkeypatch):
    """The fake hub has the files at REVISION only (test_download_skip_and_repair fetches them there): the downloader
    asking for another revision finds nothing."""
    endpoint, _ = hub
    assert REVISION == "889765ea1f903759787add96995d81171b632d0c"
    monkeypatch.setattr(fineweb, "REVISION", "main")
    with pytest.raises(DownloadError) as error:
        download(2, tmp_path, endpoint=endpoint)
    assert "Revision Not Found for url: " in str(error.value) and "/paths-info/main" in str(error.value)
    assert "3 file(s) still missing" in str(error.value)
    assert not list(tmp_path.glob("*.bin"))


def test_a_download_that_differs_from_the_published_hash_is_deleted(tmp_path, hub, shard_bytes, online,
                                                                     monkeypatch):
    endpoint, _ = hub
    bad = "fineweb_train_000001.bin"
    published = sha256(shard_bytes[bad])
    monkeypatch.setitem(shard_bytes, bad, altered(shard_bytes[bad]))  # served, but not what the hub publishes
    with pytest.raises(DownloadError) as error:
        download(2, tmp_path, endpoint=endpoint)
    assert str(error.value) == (f"{tmp_path / bad} arrived with sha256 {sha256(shard_bytes[bad])}, but the hub "
                                f"publishes {published} for it at revision {REVISION}: deleted it; run the command "
                                f"again")
    assert not (tmp_path / bad).exists()
    assert set(json.loads((tmp_path / MANIFEST).read_text())["files"]) == {"fineweb_val_000000.bin"}


def test_a_file_there_that_differs_from_the_published_hash_is_fetched_again(tmp_path, hub, shard_bytes, online,
                                                                           capsys):
    """Files put there by hand (or by the unchecked downloader of old) are checked against the hub once."""
    endpoint, requests = hub
    bad = tmp_path / "fineweb_train_000002.bin"
    for name, body in shard_bytes.items():
        (tmp_path / name).write_bytes(body)
    bad.write_bytes(altered(shard_bytes[bad.name]))
    download(2, tmp_path, endpoint=endpoint)
    assert f"{bad} has sha256 {sha256(altered(shard_bytes[bad.name]))}, but the hub publishes " \
           f"{sha256(shard_bytes[bad.name])} for it: deleting it and fetching it again" in capsys.readouterr().err
    assert bad.read_bytes() == shard_bytes[bad.name]
    assert {name for method, name in requests if method == "GET"} == {bad.name}
    assert set(json.loads((tmp_path / MANIFEST).read_text())["files"]) == set(shard_bytes)


def test_the_manifest_rechecks_a_changed_file_without_network(tmp_path, hub, shard_bytes, online, hashed,
                                                                capsys):
    """A recorded file whose modification time changed (copied with cp, say) is hashed against its recorded hash,
    with no hub request; one whose bytes changed is deleted and fetched again."""
    endpoint, requests = hub
    download(2, tmp_path, endpoint=endpoint)
    copied, damaged = tmp_path / "fineweb_val_000000.bin", tmp_path / "fineweb_train_000001.bin"
    os.utime(copied, ns=(1, 1))
    requests.clear()
    hashed.clear()
    download(2, tmp_path, endpoint=endpoint)
    assert requests == [] and hashed == [copied.name]
    assert json.loads((tmp_path / MANIFEST).read_text())["files"][copied.name]["mtime_ns"] == 1

    damaged.write_bytes(altered(shard_bytes[damaged.name]))
    requests.clear()
    download(2, tmp_path, endpoint=endpoint)
    assert f"{damaged} has sha256 {sha256(altered(shard_bytes[damaged.name]))}, not the " \
           f"{sha256(shard_bytes[damaged.name])} verified before: deleting it and fetching it again" in \
           capsys.readouterr().err
    assert damaged.read_bytes() == shard_bytes[damaged.name]
    assert {name for _, name in requests} == {damaged.name}


def test_a_damaged_manifest_means_checking_again(tmp_path, hub, online, hashed):
    endpoint, requests = hub
    download(1, tmp_path, endpoint=endpoint)
    (tmp_path / MANIFEST).write_text("{not json")
    requests.clear()
    hashed.clear()
    download(1, tmp_path, endpoint=endpoint)
    assert {method for method, _ in requests} == {"POST"} and len(hashed) == 2  # checked, nothing fetched
    assert len(json.loads((tmp_path / MANIFEST).read_text())["files"]) == 2


def test_offline_files_copied_in_by_hand_are_used_with_a_warning(tmp_path, shard_bytes, online, monkeypatch,
                                                                 capsys):
    for name, body in shard_bytes.items():
        (tmp_path / name).write_bytes(body)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert [p.name for p in download(2, tmp_path)] == list(shard_bytes)
    err = capsys.readouterr().err
    assert err.startswith(f"warning: could not reach the hub to check 3 shard(s) in {tmp_path} against the SHA-256 "
                          f"it publishes (")
    assert "using them unchecked" in err and "`python data/cached_fineweb10B.py 2` with network access" in err
    assert not (tmp_path / MANIFEST).exists()  # nothing was verified


def closed_port_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there now: connections are refused


def test_an_unreachable_hub_is_a_message_not_a_traceback(tmp_path, shard_bytes, online, capsys):
    """No network without HF_HUB_OFFLINE: the HTTP library's connection error is reported like offline mode."""
    endpoint = closed_port_endpoint()
    with pytest.raises(DownloadError, match=r"could not download from the hub dataset kjj0/fineweb10B-gpt2: .*"
                                            r"\n3 file\(s\) still missing"):
        download(2, tmp_path, endpoint=endpoint)
    for name, body in shard_bytes.items():
        (tmp_path / name).write_bytes(body)
    download(2, tmp_path, endpoint=endpoint)
    assert "warning: could not reach the hub to check 3 shard(s)" in capsys.readouterr().err
