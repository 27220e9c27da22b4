"""Stand-ins for the Hugging Face Hub in tests, which cannot reach it: a hub-cache folder built
from local files (the layout huggingface_hub writes), and a loopback HTTP server answering the
endpoints huggingface_hub's `snapshot_download` calls, as the Hub answers them (huggingface_hub
2.x: file_download.py, hf_api.py, utils/_http.py).

Endpoints (REPO = ORG/NAME, REV = a branch or a commit):
- GET /api/models/REPO/revision/REV: the model info, with `sha` (the commit) and `siblings`.
- GET /api/models/REPO/tree/REV?recursive=...: the file listing (path, size, oid, lfs).
- HEAD and GET /REPO/resolve/REV/FILE: the file, with X-Repo-Commit, ETag (the git blob sha1)
  and Content-Length. A safetensors file is an LFS file: the Hub answers 302 to its CDN, with
  X-Linked-Etag (the sha256) and X-Linked-Size; here the CDN is a second server on another
  port (another origin, so huggingface_hub sends it no token).
- Errors with the Hub's X-Error-Code / X-Error-Message headers: RepoNotFound (401),
  GatedRepo (401), RevisionNotFound (404), EntryNotFound (404).
"""

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file: the Hub's ETag of a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    return path.endswith((".safetensors", ".bin"))


def etag_of(path: str, data: bytes) -> str:
    """What huggingface_hub names the cached blob: sha256 for LFS files, else the git sha1."""
    return hashlib.sha256(data).hexdigest() if is_lfs(path) else git_blob_sha1(data)


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by its '/'-separated relative path."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def build_hub_cache(
    cache_dir: Path, repo_id: str, files: dict[str, bytes], commit: str, refs: tuple[str, ...]
) -> Path:
    """Write `files` as huggingface_hub's cache holds a repository snapshot:
    models--ORG--NAME/blobs/ETAG (the contents), snapshots/COMMIT/PATH (relative symlinks to
    the blobs) and refs/REF (the commit of each branch in `refs`). Returns the snapshot."""
    storage = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for path, data in files.items():
        blob = storage / "blobs" / etag_of(path, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@dataclass
class HubRepo:
    """One repository of the stand-in Hub: its files at one commit, named by branches."""

    files: dict[str, bytes]
    commit: str
    branches: tuple[str, ...] = ("main",)
    gated: bool = False


@dataclass
class FakeHub:
    """The loopback Hub's state, and what it was asked (method, path, Authorization)."""

    repos: dict[str, HubRepo]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    endpoint: str = ""
    cdn: str = ""

    def downloaded(self) -> list[str]:
        """Paths of the files whose contents were sent (GETs of /resolve/ or of the CDN)."""
        return sorted(
            path.split("/resolve/", 1)[1].split("/", 1)[1] if "/resolve/" in path else path
            for method, path, _ in self.requests
            if method == "GET" and ("/resolve/" in path or path.startswith("/cdn/"))
        )


def _handler(hub: FakeHub, cdn: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def _send(self, status: int, headers: dict[str, str], body: bytes, send_body: bool) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str, send_body: bool) -> None:
            body = json.dumps({"error": message}).encode()
            headers = {"X-Error-Code": code, "X-Error-Message": message}
            headers["Content-Type"] = "application/json"
            self._send(status, headers, body, send_body)

        def _answer(self, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Authorization")))
            if cdn:  # /cdn/PATH?...: the LFS file's contents, found by its path
                wanted = path.removeprefix("/cdn/")
                for repo in hub.repos.values():
                    if wanted in repo.files:
                        data = repo.files[wanted]
                        return self._send(200, {}, data, send_body)
                return self._send(404, {}, b"", send_body)
            if path.startswith("/api/models/"):
                return self._api(path.removeprefix("/api/models/"), send_body)
            if "/resolve/" in path:
                return self._resolve(path, send_body)
            return self._send(404, {}, b"", send_body)

        def _repo(self, repo_id: str, revision: str, send_body: bool) -> HubRepo | None:
            """The repo at `revision`, or None after answering the Hub's error."""
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", "Repository not found", send_body)
                return None
            if repo.gated:
                self._error(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it "
                    f"and be authenticated to access it. Please log in.",
                    send_body,
                )
                return None
            if revision not in (*repo.branches, repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", send_body)
                return None
            return repo

        def _api(self, rest: str, send_body: bool) -> None:
            org, name, kind, revision = rest.split("/", 3)
            repo_id = f"{org}/{name}"
            repo = self._repo(repo_id, revision, send_body)
            if repo is None:
                return
            if kind == "revision":
                info = {
                    "id": repo_id,
                    "sha": repo.commit,
                    "private": False,
                    "gated": False,
                    "siblings": [{"rfilename": p} for p in repo.files],
                }
                body = json.dumps(info).encode()
            else:  # tree
                entries = []
                for path, data in repo.files.items():
                    entry: dict[str, object] = {
                        "type": "file",
                        "path": path,
                        "size": len(data),
                        "oid": git_blob_sha1(data),
                    }
                    if is_lfs(path):
                        entry["lfs"] = {
                            "oid": hashlib.sha256(data).hexdigest(),
                            "size": len(data),
                            "pointerSize": 134,
                        }
                    entries.append(entry)
                body = json.dumps(entries).encode()
            self._send(200, {"Content-Type": "application/json"}, body, send_body)

        def _resolve(self, path: str, send_body: bool) -> None:
            repo_part, rest = path.lstrip("/").split("/resolve/", 1)
            revision, filename = rest.split("/", 1)
            repo = self._repo(repo_part, revision, send_body)
            if repo is None:
                return
            if filename not in repo.files:
                self._error(404, "EntryNotFound", f"{filename} does not exist", send_body)
                return
            data = repo.files[filename]
            headers = {"X-Repo-Commit": repo.commit}
            if is_lfs(filename):  # the Hub sends LFS files from its CDN
                headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
                headers["X-Linked-Size"] = str(len(data))
                headers["ETag"] = f'"{git_blob_sha1(data)}"'
                headers["Location"] = f"{hub.cdn}/cdn/{filename}?signature=abc"
                return self._send(302, headers, b"", send_body)
            headers["ETag"] = f'"{git_blob_sha1(data)}"'
            headers["Content-Length"] = str(len(data))
            self._send(200, headers, data, send_body)

    return Handler


@contextmanager
def serve_hub(repos: dict[str, HubRepo]) -> Iterator[FakeHub]:
    """Run the stand-in Hub (and its CDN) on loopback ports; yields its state, with
    `endpoint` the URL for HF_ENDPOINT."""
    hub = FakeHub(repos)
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, cdn)) for cdn in (False, True)]
    hub.endpoint, hub.cdn = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield hub
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
