"""data/cached_fineweb10B.py against a fake hub on 127.0.0.1: download, skip, repair, and the offline message."""
import hashlib
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants

from data.cached_fineweb10B import REPO_ID, DownloadError, download, main
from data.shard import write_shard

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def shard_bytes(tmp_path_factory):
    """Small valid shards under the dataset's file names."""
    folder = tmp_path_factory.mktemp("hub_files")
    files = {}
    for i, name in enumerate(["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]):
        write_shard(folder / name, np.arange(100 + i, dtype=np.uint16))
        files[name] = (folder / name).read_bytes()
    return files


@pytest.fixture
def hub(shard_bytes):
    """A minimal hub: HEAD/GET {endpoint}/datasets/{repo}/resolve/main/{file} with the headers hf_hub_download
    needs (X-Repo-Commit, ETag, Content-Length). Yields (endpoint, list of (method, file) requested)."""
    requests = []
    prefix = f"/datasets/{REPO_ID}/resolve/main/"

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, with_body):
            name = self.path.removeprefix(prefix)
            requests.append((self.command, name))
            body = shard_bytes.get(name) if self.path.startswith(prefix) else None
            if body is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_HEAD(self):
            self._answer(with_body=False)

        def do_GET(self):
            self._answer(with_body=True)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def test_download_skip_and_repair(tmp_path, hub, shard_bytes):
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


def test_offline_lists_exactly_the_missing_files(tmp_path, hub, shard_bytes, monkeypatch):
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
