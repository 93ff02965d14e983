"""A local stand-in for the Hugging Face hub on 127.0.0.1, with fault injection.

It serves what huggingface-hub 2.4.0 and app.downloads call: `GET /api/models/{repo}[/revision/{rev}]`
(siblings with size, blobId and lfs{sha256,size,pointerSize} when `?blobs=true`) and
`GET|HEAD /{repo}/resolve/{rev}/{path}` with Range, ETag, X-Repo-Commit and the X-Linked-* headers.
Errors carry the hub's X-Error-Code header so the client maps them as it would online.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".npz")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Fault:
    """One injected fault on a file's resolve URL; `times` = how many requests it hits."""

    kind: str  # "drop" (close after `after` bytes), "corrupt" (same size), "status", "stall"
    times: int = 1
    after: int = 0  # drop/stall: bytes of the body sent before the fault
    status: int = 500
    seconds: float = 0.0  # stall: how long to hang before going on

    def __post_init__(self):
        if self.kind not in ("drop", "corrupt", "status", "stall"):
            raise ValueError(f"unknown fault kind {self.kind!r}")


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    commit: str = ""
    gated: bool = False
    tokens: tuple[str, ...] = ()  # tokens that have accepted a gated repo's terms

    def __post_init__(self):
        if not self.commit:
            h = hashlib.sha1(self.repo_id.encode())
            for p in sorted(self.files):
                h.update(p.encode() + hashlib.sha1(self.files[p]).digest())
            self.commit = h.hexdigest()

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES) or len(self.files[path]) > 1 << 20

    def sibling(self, path: str) -> dict:
        data = self.files[path]
        s = {"rfilename": path, "size": len(data)}
        if self.is_lfs(path):
            sha = hashlib.sha256(data).hexdigest()
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n"
            )
            s["blobId"] = git_blob_sha1(pointer.encode())
            s["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": len(pointer)}
        else:
            s["blobId"] = git_blob_sha1(data)
        return s

    def etag(self, path: str) -> str:
        s = self.sibling(path)
        return s["lfs"]["sha256"] if "lfs" in s else s["blobId"]


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    faults: dict[str, list[Fault]] = field(default_factory=dict)  # "repo/path" -> faults
    log: list[dict] = field(default_factory=list)  # one record per request
    bytes_sent: dict[str, int] = field(default_factory=dict)  # "repo/path" -> body bytes
    chunk: int = 64 * 1024
    delay: float = 0.0  # seconds per chunk, to make transfers slow enough to pause
    ignore_range: bool = False  # a proxy that answers every GET with the whole file (200)
    redirect_lfs: bool = False  # answer LFS resolves with a 302 to /cdn/..., as the real hub does
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_repo(self, repo_id: str, files: dict[str, bytes], **kw) -> Repo:
        r = Repo(repo_id, files, **kw)
        self.repos[repo_id] = r
        return r

    def add_folder(self, repo_id: str, folder: Path, **kw) -> Repo:
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(Path(folder).rglob("*"))
            if p.is_file()
        }
        return self.add_repo(repo_id, files, **kw)

    def inject(self, repo_id: str, path: str, fault: Fault) -> None:
        with self.lock:
            self.faults.setdefault(f"{repo_id}/{path}", []).append(fault)

    def take_fault(self, key: str) -> Fault | None:
        with self.lock:
            faults = self.faults.get(key) or []
            while faults and faults[0].times <= 0:
                faults.pop(0)
            if not faults:
                return None
            faults[0].times -= 1
            return faults[0]

    def resolve_requests(self, path: str, kind: str = "resolve") -> list[dict]:
        return [r for r in self.log if r["kind"] == kind and r["path"] == path]


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_CDN = re.compile(r"^/cdn/(?P<repo>[^/]+/[^/]+)/(?P<rev>[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub  # set on the subclass made per server

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head=False):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, head=False):
        body = json.dumps({"error": message}).encode()
        headers = {
            "Content-Type": "application/json",
            "X-Error-Code": code,
            "X-Error-Message": message,
        }
        self._send(status, body, headers, head)

    def do_GET(self):
        self._route(head=False)

    def do_HEAD(self):
        self._route(head=True)

    def _route(self, head: bool):
        url = urlsplit(self.path)
        path = unquote(url.path)
        m = _API.match(path)
        if m:
            return self._api(m["repo"], m["rev"], parse_qs(url.query), head)
        m = _RESOLVE.match(path)
        if m:
            return self._resolve(m["repo"], m["rev"], m["path"], head)
        m = _CDN.match(path)
        if m:
            return self._resolve(m["repo"], m["rev"], m["path"], head, cdn=True)
        self.hub.log.append({"kind": "other", "path": path})
        self._error(404, "EntryNotFound", f"no route {path}", head)

    def _repo(self, repo_id: str, rev: str | None, head: bool) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            # The real hub answers 401 to anonymous callers and 404 to logged-in ones.
            status = 404 if self.headers.get("Authorization") else 401
            self._error(status, "RepoNotFound", "Repository not found", head)
            return None
        if rev not in (None, "main", repo.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            return None
        return repo

    def _api(self, repo_id: str, rev: str | None, query: dict, head: bool):
        self.hub.log.append({"kind": "api", "repo": repo_id, "rev": rev})
        repo = self._repo(repo_id, rev, head)
        if repo is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = [repo.sibling(p) if blobs else {"rfilename": p} for p in sorted(repo.files)]
        info = {
            "_id": repo.commit[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": repo.commit,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": ["safetensors"],
            "siblings": siblings,
            "lastModified": "2026-01-01T00:00:00.000Z",
        }
        if blobs:
            info["usedStorage"] = sum(len(b) for b in repo.files.values())
        body = json.dumps(info).encode()
        self._send(200, body, {"Content-Type": "application/json"}, head)

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool, cdn: bool = False):
        rng = self.headers.get("Range")
        record = {
            "kind": "cdn" if cdn else "resolve",
            "repo": repo_id,
            "path": path,
            "range": rng,
            "head": head,
            "auth": bool(self.headers.get("Authorization")),
        }
        self.hub.log.append(record)
        repo = self._repo(repo_id, rev, head) if not cdn else self.hub.repos.get(repo_id)
        if repo is None:
            return
        if repo.gated and not cdn:
            auth = self.headers.get("Authorization", "")
            token = auth.removeprefix("Bearer ").strip()
            if not token:
                msg = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in."
                return self._error(401, "GatedRepo", msg, head)
            if token not in repo.tokens:
                msg = f"Access to model {repo_id} is restricted and you are not in the authorized list."
                return self._error(403, "GatedRepo", msg, head)
        if path not in repo.files:
            return self._error(404, "EntryNotFound", f"{path} does not exist on main", head)
        if self.hub.redirect_lfs and repo.is_lfs(path) and not cdn:
            # The hub sends LFS files from a CDN: metadata headers here, bytes there.
            headers = {
                "Location": f"/cdn/{repo_id}/{repo.commit}/{path}",
                "X-Repo-Commit": repo.commit,
                "ETag": f'"{repo.sibling(path)["blobId"]}"',
                "X-Linked-Etag": f'"{repo.etag(path)}"',
                "X-Linked-Size": str(len(repo.files[path])),
            }
            return self._send(302, b"", headers, head)
        key = f"{repo_id}/{path}"
        fault = None if head else self.hub.take_fault(key)
        if fault is not None and fault.kind == "status":
            record["fault"] = f"status {fault.status}"
            return self._error(fault.status, "ServerError", "injected failure", head)
        data = repo.files[path]
        size = len(data)
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "ETag": f'"{repo.etag(path)}"',
            "X-Repo-Commit": repo.commit,
        }
        if repo.is_lfs(path):
            headers["X-Linked-Etag"] = f'"{repo.etag(path)}"'
            headers["X-Linked-Size"] = str(size)
        status, lo, hi = 200, 0, size
        if rng and not self.hub.ignore_range:
            m = _RANGE.match(rng.strip())
            if not m:
                return self._error(416, "RangeNotSatisfiable", f"bad range {rng}", head)
            lo = int(m[1])
            hi = min(size, int(m[2]) + 1) if m[2] else size
            if lo >= size:
                headers["Content-Range"] = f"bytes */{size}"
                return self._send(416, b"", headers, head)
            status = 206
            headers["Content-Range"] = f"bytes {lo}-{hi - 1}/{size}"
        body = data[lo:hi]
        if fault is not None and fault.kind == "corrupt":
            record["fault"] = "corrupt"
            body = bytes(b ^ 0x5A for b in body)  # same length, different bytes
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        sent = 0
        try:
            while sent < len(body):
                if fault is not None and fault.kind in ("drop", "stall") and sent >= fault.after:
                    if fault.kind == "drop":
                        record["fault"] = f"drop at {lo + sent}"
                        self.close_connection = True
                        self.wfile.flush()
                        self.connection.shutdown(2)  # the peer sees a short body
                        return
                    record["fault"] = f"stall at {lo + sent}"
                    time.sleep(fault.seconds)
                    fault = None
                n = self.hub.chunk
                if fault is not None and fault.kind in ("drop", "stall"):
                    n = min(n, max(1, fault.after - sent))
                piece = body[sent : sent + n]
                self.wfile.write(piece)
                sent += len(piece)
                with self.hub.lock:
                    self.hub.bytes_sent[key] = self.hub.bytes_sent.get(key, 0) + len(piece)
                if self.hub.delay:
                    time.sleep(self.hub.delay)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away (pause, cancel)


class HubServer:
    """`with HubServer() as hub:` runs a hub on a free port; `hub.endpoint` is its base URL."""

    def __init__(self, hub: Hub | None = None):
        self.hub = hub or Hub()
        handler = type("Handler", (_Handler,), {"hub": self.hub})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> HubServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> Hub:
        self.start()
        return self.hub

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """A running local hub, HF_ENDPOINT pointing at it, HF and app dirs isolated in tmp."""
    from huggingface_hub import constants as hf_constants

    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    # huggingface_hub reads these at import time; point them at tmp too.
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    server = HubServer().start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    yield server.hub
    server.stop()
