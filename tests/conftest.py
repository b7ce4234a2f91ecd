import hashlib
import json
import os
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

# What run.sh sets for a CPU run (its comment says why: about half of each smoke-run step on a 2-core AMD EPYC);
# the training runs the tests start get it too. tests/test_packaging.py checks that run.sh sets this value.
CPU_MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"


def pytest_configure(config):
    # glibc reads it when a process starts, so it reaches the runs this process launches, not this one
    user = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = CPU_MALLOC_TUNABLES + (f":{user}" if user else "")


# --- gpu marker (shell helper): skip @pytest.mark.gpu tests where CUDA is absent ------------------------
def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# --- a fake hub for the FineWeb downloader (tests/test_download.py, tests/test_reliability.py) -------------
@pytest.fixture(scope="module")
def shard_bytes(tmp_path_factory):
    """Small valid shards under the dataset's file names."""
    from data.shard import write_shard  # here, not at the top: this file also serves tests outside the repo

    folder = tmp_path_factory.mktemp("hub_files")
    files = {}
    for i, name in enumerate(["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]):
        write_shard(folder / name, np.arange(100 + i, dtype=np.uint16))
        files[name] = (folder / name).read_bytes()
    return files


@pytest.fixture
def hub(shard_bytes):
    """A minimal hub at the pinned revision: HEAD/GET {endpoint}/datasets/{repo}/resolve/{REVISION}/{file} with the
    headers hf_hub_download needs (X-Repo-Commit, ETag, Content-Length), and POST
    {endpoint}/api/datasets/{repo}/paths-info/{REVISION}, which lists each file's size and SHA-256 (its LFS object
    id) as the files were when the fixture started: a test that then changes shard_bytes serves other bytes than the
    hub publishes. Other revisions are not found. Yields (endpoint, list of (method, file) requested)."""
    from data.cached_fineweb10B import REPO_ID, REVISION

    requests = []
    prefix = f"/datasets/{REPO_ID}/resolve/{REVISION}/"
    paths_info = f"/api/datasets/{REPO_ID}/paths-info/{REVISION}"
    published = {name: {"type": "file", "path": name, "size": len(body), "oid": hashlib.sha1(body).hexdigest(),
                        "lfs": {"oid": hashlib.sha256(body).hexdigest(), "size": len(body), "pointerSize": 134}}
                 for name, body in shard_bytes.items()}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status, body=b"", headers=(), with_body=True):
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def _answer(self, with_body):
            name = self.path.removeprefix(prefix)
            requests.append((self.command, name))
            body = shard_bytes.get(name) if self.path.startswith(prefix) else None
            if body is None:
                self._send(404, headers=[("X-Error-Code", "EntryNotFound")])
                return
            self._send(200, body, [("X-Repo-Commit", REVISION), ("ETag", f'"{hashlib.sha256(body).hexdigest()}"')],
                       with_body)

        def do_HEAD(self):
            self._answer(with_body=False)

        def do_GET(self):
            self._answer(with_body=True)

        def do_POST(self):
            form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
            names = form.get("paths", [])
            requests.extend(("POST", name) for name in names)
            if self.path != paths_info:
                self._send(404, headers=[("X-Error-Code", "RevisionNotFound")])
                return
            body = json.dumps([published[name] for name in names if name in published]).encode()
            self._send(200, body, [("Content-Type", "application/json")])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()
