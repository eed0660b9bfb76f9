"""A small local Hugging Face Hub for tests: the part of the protocol huggingface_hub 2.4 uses.

Reads: repo info, tree, paths-info, resolve (HEAD/GET with Range). Writes, on the legacy LFS
path (``HF_HUB_DISABLE_XET=1``): repos/create, branch, preupload, LFS batch + PUT, commit
(NDJSON), lfs-files/duplicate for cross-repository copies, validate-yaml.

The server counts what crosses the wire (bytes served by ``resolve``, bytes received by LFS
PUTs and inline commit files) so tests can prove which bytes were downloaded or uploaded. It
can also drop a connection part-way through a download and stop listening (connection
refused afterwards), to test network failures. Everything runs on 127.0.0.1 in one thread
per request (``ThreadingHTTPServer``); ``stop()`` shuts it down cleanly.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
LFS_THRESHOLD = 10 * 1024 * 1024
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's object id


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class Entry:
    """A file in a commit: inline bytes (regular) or an LFS object (bytes in the server's store)."""

    path: str
    size: int
    sha256: str
    lfs: bool
    data: bytes | None = None  # regular files only

    @property
    def oid(self) -> str:
        return git_blob_oid(lfs_pointer(self.sha256, self.size)) if self.lfs else git_blob_oid(self.data or b"")

    @property
    def xet_hash(self) -> str:
        return hashlib.sha256(b"xet:" + self.sha256.encode()).hexdigest()

    def to_json(self) -> dict:
        out = {"type": "file", "oid": self.oid, "size": self.size, "path": self.path}
        if self.lfs:
            pointer = lfs_pointer(self.sha256, self.size)
            out["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": len(pointer)}
            out["xetHash"] = self.xet_hash
        return out


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    refs: dict[str, str] = field(default_factory=dict)  # branch / refs/pr/N -> commit sha
    commits: dict[str, dict[str, Entry]] = field(default_factory=dict)  # sha -> {path: Entry}
    messages: dict[str, str] = field(default_factory=dict)  # sha -> summary
    lfs_oids: set[str] = field(default_factory=set)  # LFS objects linked to this repo
    prs: int = 0

    def resolve(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        if rev in self.commits:
            return rev
        matches = [c for c in self.commits if len(rev) >= 7 and c.startswith(rev)]
        return matches[0] if len(matches) == 1 else None


@dataclass
class Stats:
    served: int = 0  # body bytes answered by GET resolve
    uploaded: int = 0  # bytes received by LFS PUT + inline commit files
    uploaded_oids: list[str] = field(default_factory=list)
    requests: list[tuple[str, str, str | None, int]] = field(default_factory=list)  # method, path, range, status
    served_by_file: dict[str, int] = field(default_factory=dict)
    commits: list[dict] = field(default_factory=list)  # parsed NDJSON payloads
    duplicates: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self) -> None:
        with self.lock:
            self.served = 0
            self.uploaded = 0
            self.uploaded_oids.clear()
            self.requests.clear()
            self.served_by_file.clear()
            self.commits.clear()
            self.duplicates.clear()


class HubState:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> content (the LFS store)
        self.tokens: dict[str, str] = {}  # token -> "read" | "write"
        self.stats = Stats()
        self.lock = threading.RLock()
        self.drop_after: int | None = None  # serve this many resolve bytes, then drop and stop listening
        self.on_drop = None  # callable run (in a thread) when a connection is dropped
        self._counter = 0

    # -- seeding ---------------------------------------------------------------------

    def _new_sha(self, seed: str) -> str:
        self._counter += 1
        return hashlib.sha1(f"{seed}:{self._counter}:{time.time_ns()}".encode()).hexdigest()  # noqa: S324

    def add_repo(self, repo_id: str, folder: Path | None = None, *, private: bool = False,
                 files: dict[str, bytes] | None = None) -> str:
        """Create ``repo_id`` with one commit holding ``folder`` (and/or ``files``); returns the commit sha."""
        with self.lock:
            repo = Repo(repo_id, private=private)
            self.repos[repo_id] = repo
            content: dict[str, bytes] = {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}
            if folder is not None:
                for p in sorted(Path(folder).rglob("*")):
                    rel = p.relative_to(folder)
                    if p.is_file() and not any(part.startswith(".") for part in rel.parts):
                        content[str(rel)] = p.read_bytes()
            content.update(files or {})
            tree = {path: self._entry(repo, path, data) for path, data in content.items()}
            sha = self._new_sha(repo_id)
            repo.commits[sha] = tree
            repo.messages[sha] = "initial commit"
            repo.refs["main"] = sha
            return sha

    def _entry(self, repo: Repo, path: str, data: bytes) -> Entry:
        sha = hashlib.sha256(data).hexdigest()
        if path.endswith(LFS_SUFFIXES) or len(data) > LFS_THRESHOLD:
            self.blobs[sha] = data
            repo.lfs_oids.add(sha)
            return Entry(path, len(data), sha, True)
        return Entry(path, len(data), sha, False, data)

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        """Every file of ``repo_id`` at ``rev`` with its bytes (for assertions)."""
        repo = self.repos[repo_id]
        tree = repo.commits[repo.resolve(rev)]
        return {p: (self.blobs[e.sha256] if e.lfs else e.data) for p, e in tree.items()}


class _Reply(Exception):
    def __init__(self, status: int, body: object = None, headers: dict | None = None) -> None:
        self.status, self.body, self.headers = status, body, headers or {}


def _not_found(kind: str, message: str) -> _Reply:
    return _Reply(404, {"error": message}, {"X-Error-Code": kind, "X-Error-Message": message})


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HubServer

    def log_message(self, format, *args):  # noqa: A002 - silence the default stderr log
        pass

    @property
    def state(self) -> HubState:
        return self.server.state

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's algorithm and delayed
        # ACKs add ~40 ms to every small response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.conn_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.conn_lock:
            self.server.connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    # -- plumbing --------------------------------------------------------------------

    def _body(self) -> bytes:
        return self._raw_body

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                line = self.rfile.readline().strip()
                n = int(line.split(b";")[0], 16)
                if n == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(n)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: object = None, headers: dict | None = None, head: bool = False) -> None:
        if isinstance(body, (dict, list)):
            data = json.dumps(body).encode()
            ctype = "application/json"
        elif body is None:
            data, ctype = b"", "text/plain"
        else:
            data, ctype = bytes(body), "application/octet-stream"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head and data:
            self.wfile.write(data)
        with self.state.stats.lock:
            self.state.stats.requests.append((self.command, self.path, self.headers.get("Range"), status))

    def _auth(self) -> str | None:
        """The permission of the presented token ("read"/"write"), None when anonymous."""
        auth = self.headers.get("Authorization")
        if not auth:
            return None
        token = auth.removeprefix("Bearer ").strip()
        perm = self.state.tokens.get(token)
        if perm is None:
            raise _Reply(401, {"error": INVALID_CREDENTIALS}, {"X-Error-Message": INVALID_CREDENTIALS})
        return perm

    def _repo(self, repo_id: str, perm: str | None, write: bool = False) -> Repo:
        repo = self.state.repos.get(repo_id)
        if repo is None or (repo.private and perm is None):
            # The Hub answers 401 RepoNotFound for missing and for private-without-token alike.
            raise _Reply(401 if perm is None else 404, {"error": "Repository not found"},
                         {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
        if write:
            self._need_write(perm)
        return repo

    def _need_write(self, perm: str | None) -> None:
        if perm is None:
            raise _Reply(401, {"error": "write access needs a token"}, {"X-Error-Message": "Unauthorized"})
        if perm != "write":
            msg = "You don't have the rights to write to this repository"
            raise _Reply(403, {"error": msg}, {"X-Error-Message": msg})

    def _commit_of(self, repo: Repo, rev: str) -> str:
        sha = repo.resolve(rev)
        if sha is None:
            raise _not_found("RevisionNotFound", f"Invalid rev id: {rev}")
        return sha

    def _dispatch(self, method: str) -> None:
        try:
            # Read the whole body first: an early error answer must not leave it in the stream.
            self._raw_body = self._read_body() if method in ("POST", "PUT") else b""
            self._route(method)
        except _Reply as r:
            self._send(r.status, r.body, r.headers, head=method == "HEAD")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self):  # noqa: N802
        self._dispatch("GET")

    def do_HEAD(self):  # noqa: N802
        self._dispatch("HEAD")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self):  # noqa: N802
        self._dispatch("PUT")

    # -- routing ---------------------------------------------------------------------

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        segs = [unquote(s) for s in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        perm = self._auth()
        if segs[:2] == ["api", "models"] and len(segs) >= 4:
            repo_id = f"{segs[2]}/{segs[3]}"
            rest = segs[4:]
            return self._api_model(method, repo_id, rest, query, perm)
        if segs[:3] == ["api", "repos", "create"] and method == "POST":
            return self._create_repo(perm)
        if segs[:2] == ["api", "validate-yaml"] and method == "POST":
            return self._validate_yaml()
        if segs[:1] == ["lfs-upload"] and method == "PUT":
            return self._lfs_put(segs[1])
        if len(segs) >= 4 and segs[1].endswith(".git") and segs[2:] == ["info", "lfs", "objects", "batch"]:
            return self._lfs_batch(f"{segs[0]}/{segs[1][:-4]}", perm)
        if len(segs) >= 5 and segs[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(method, f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:]), perm)
        raise _Reply(404, {"error": f"no route for {method} {url.path}"})

    def _api_model(self, method, repo_id, rest, query, perm) -> None:
        if method == "GET" and (not rest or rest[0] == "revision"):
            repo = self._repo(repo_id, perm)
            sha = self._commit_of(repo, "/".join(rest[1:]) if rest else "main")
            tree = repo.commits[sha]
            siblings = [{"rfilename": p, "size": e.size, "blobId": e.oid,
                         **({"lfs": {"sha256": e.sha256, "size": e.size, "pointerSize": 0}} if e.lfs else {})}
                        for p, e in sorted(tree.items())]
            return self._send(200, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private,
                                    "siblings": siblings, "tags": []})
        if method == "GET" and rest[:1] == ["tree"]:
            repo = self._repo(repo_id, perm)
            sha = self._commit_of(repo, rest[1])
            prefix = "/".join(rest[2:])
            recursive = query.get("recursive", ["False"])[0].lower() == "true"
            return self._send(200, self._listing(repo.commits[sha], prefix, recursive))
        if method == "POST" and rest[:1] == ["paths-info"]:
            repo = self._repo(repo_id, perm)
            sha = self._commit_of(repo, rest[1])
            form = parse_qs(self._body().decode())
            tree = repo.commits[sha]
            return self._send(200, [tree[p].to_json() for p in form.get("paths", []) if p in tree])
        if method == "POST" and rest[:1] == ["preupload"]:
            repo = self._repo(repo_id, perm, write=True)
            payload = json.loads(self._body())
            tree = repo.commits[self._commit_of(repo, rest[1])]
            out = []
            for f in payload["files"]:
                lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] > LFS_THRESHOLD
                old = tree.get(f["path"])
                oid = None if old is None else (old.sha256 if old.lfs else old.oid)
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
            return self._send(200, {"files": out})
        if method == "POST" and rest[:1] == ["commit"]:
            return self._commit(repo_id, rest[1], query, perm)
        if method == "POST" and rest[:1] == ["branch"]:
            repo = self._repo(repo_id, perm, write=True)
            branch = "/".join(rest[1:])
            if branch in repo.refs:
                raise _Reply(409, {"error": "Reference already exists"})
            payload = json.loads(self._body() or b"{}")
            repo.refs[branch] = self._commit_of(repo, payload.get("startingPoint") or "main")
            return self._send(200, {})
        if method == "POST" and rest[:2] == ["lfs-files", "duplicate"]:
            return self._duplicate(repo_id, perm)
        raise _Reply(404, {"error": f"no route for {method} {repo_id} {rest}"})

    @staticmethod
    def _listing(tree: dict[str, Entry], prefix: str, recursive: bool) -> list[dict]:
        out: list[dict] = []
        dirs: set[str] = set()
        base = prefix + "/" if prefix else ""
        for path, e in sorted(tree.items()):
            if not path.startswith(base):
                continue
            rel = path[len(base):]
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = base + "/".join(parts[:i])
                if (recursive or i == 1) and d not in dirs:
                    dirs.add(d)
                    out.append({"type": "directory", "oid": git_blob_oid(d.encode()), "path": d})
            if recursive or len(parts) == 1:
                out.append(e.to_json())
        return out

    # -- reads -----------------------------------------------------------------------

    def _resolve(self, method, repo_id, rev, path, perm) -> None:
        repo = self._repo(repo_id, perm)
        sha = self._commit_of(repo, rev)
        e = repo.commits[sha].get(path)
        if e is None:
            raise _not_found("EntryNotFound", f"{path} does not exist at {rev}")
        data = self.state.blobs[e.sha256] if e.lfs else e.data
        headers = {"ETag": f'"{e.sha256 if e.lfs else e.oid}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if e.lfs:
            headers.update({"X-Linked-Etag": f'"{e.sha256}"', "X-Linked-Size": str(e.size)})
        start, end, status = 0, len(data), 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) >= len(data):
                raise _Reply(416, None, {"Content-Range": f"bytes */{len(data)}"})
            start = int(m.group(1))
            end = min(int(m.group(2)) + 1, len(data)) if m.group(2) else len(data)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        if method == "HEAD":
            return self._send(status, data[start:end], headers, head=True)
        self._serve_body(status, data[start:end], headers, path)

    def _serve_body(self, status: int, body: bytes, headers: dict, path: str) -> None:
        st = self.state
        cut = None
        with st.stats.lock:
            if st.drop_after is not None and st.stats.served + len(body) > st.drop_after:
                cut = max(0, st.drop_after - st.stats.served)
                st.drop_after = None
            sent = len(body) if cut is None else cut
            st.stats.served += sent
            st.stats.served_by_file[path] = st.stats.served_by_file.get(path, 0) + sent
            st.stats.requests.append(("GET", self.path, self.headers.get("Range"), status))
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if cut is None:
            self.wfile.write(body)
            return
        # Simulated network failure: part of the body, then the connection goes away and the
        # server stops listening (further connections are refused).
        self.wfile.write(body[:cut])
        self.wfile.flush()
        self.close_connection = True
        if st.on_drop is not None:
            threading.Thread(target=st.on_drop, daemon=True).start()
        raise ConnectionResetError

    # -- writes ----------------------------------------------------------------------

    def _create_repo(self, perm) -> None:
        self._need_write(perm)
        payload = json.loads(self._body())
        repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
        with self.state.lock:
            if repo_id in self.state.repos:
                raise _Reply(409, {"error": "You already created this model repo", "url": self._url(repo_id)})
            private = payload.get("private") or payload.get("visibility") == "private"
            self.state.add_repo(repo_id, private=bool(private))
        self._send(200, {"url": self._url(repo_id), "name": repo_id})

    def _url(self, repo_id: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/{repo_id}"

    def _validate_yaml(self) -> None:
        import yaml

        payload = json.loads(self._body())
        content = payload.get("content", "")
        errors = []
        if content.startswith("---"):
            try:
                meta = yaml.safe_load(content.split("---", 2)[1])
                if not isinstance(meta, dict):
                    errors.append({"message": "metadata is not a mapping"})
            except yaml.YAMLError as e:
                errors.append({"message": f"invalid YAML: {e}"})
        if errors:
            raise _Reply(400, {"errors": errors, "warnings": []})
        self._send(200, {"errors": [], "warnings": []})

    def _lfs_batch(self, repo_id, perm) -> None:
        repo = self._repo(repo_id, perm, write=True)
        payload = json.loads(self._body())
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], obj["size"]
            entry = {"oid": oid, "size": size, "authenticated": True}
            if oid in self.state.blobs:
                repo.lfs_oids.add(oid)  # content already stored: nothing to upload
            else:
                host, port = self.server.server_address[:2]
                entry["actions"] = {"upload": {"href": f"http://{host}:{port}/lfs-upload/{oid}?repo={repo_id}"}}
            objects.append(entry)
        self._send(200, {"transfer": "basic", "objects": objects})

    def _lfs_put(self, oid: str) -> None:
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            raise _Reply(400, {"error": "sha256 mismatch"})
        repo_id = parse_qs(urlsplit(self.path).query).get("repo", [""])[0]
        with self.state.stats.lock:
            self.state.stats.uploaded += len(data)
            self.state.stats.uploaded_oids.append(oid)
        self.state.blobs[oid] = data
        if repo_id in self.state.repos:
            self.state.repos[repo_id].lfs_oids.add(oid)
        self._send(200, {})

    def _duplicate(self, src_id, perm) -> None:
        src = self._repo(src_id, perm)
        payload = json.loads(self._body())
        target = payload["target"]
        dst = self._repo(target["name"], perm, write=True)
        failed = []
        for f in payload["files"]:
            known = f["sha256"] in src.lfs_oids and self.state.blobs.get(f["sha256"]) is not None
            if not known or f["xetHash"] != Entry("", 0, f["sha256"], True).xet_hash:
                failed.append({"sha256": f["sha256"], "error": "not found in source repository"})
            else:
                dst.lfs_oids.add(f["sha256"])
        with self.state.stats.lock:
            self.state.stats.duplicates.append(payload)
        self._send(200, {"failed": failed})

    def _commit(self, repo_id, rev, query, perm) -> None:
        repo = self._repo(repo_id, perm, write=True)
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        with self.state.lock:
            create_pr = query.get("create_pr", ["0"])[0] == "1"
            if rev not in repo.refs:
                raise _not_found("RevisionNotFound", f"Invalid rev id: {rev}")
            base_sha = repo.refs[rev]
            tree = dict(repo.commits[base_sha])
            header = {}
            for item in lines:
                key, value = item["key"], item["value"]
                if key == "header":
                    header = value
                elif key == "file":
                    data = base64.b64decode(value["content"])
                    with self.state.stats.lock:
                        self.state.stats.uploaded += len(data)
                    tree[value["path"]] = self.state._entry(repo, value["path"], data)
                elif key == "lfsFile":
                    oid = value["oid"]
                    if oid not in repo.lfs_oids or oid not in self.state.blobs:
                        raise _Reply(422, {"error": f"LFS object {oid} is not linked to {repo_id}"})
                    size = len(self.state.blobs[oid])
                    if "size" in value and value["size"] != size:
                        raise _Reply(422, {"error": f"size mismatch for {value['path']}"})
                    tree[value["path"]] = Entry(value["path"], size, oid, True)
                elif key == "deletedFile":
                    if value["path"] not in tree:
                        raise _not_found("EntryNotFound", "A file with this name doesn't exist")
                    del tree[value["path"]]
                elif key == "deletedFolder":
                    pre = value["path"].rstrip("/") + "/"
                    tree = {p: e for p, e in tree.items() if not p.startswith(pre)}
                else:
                    raise _Reply(400, {"error": f"unknown key {key}"})
            parent = header.get("parentCommit")
            if parent and not base_sha.startswith(parent):
                raise _Reply(412, {"error": "parent commit is not the head of the revision"})
            sha = self.state._new_sha(repo_id)
            repo.commits[sha] = tree
            repo.messages[sha] = header.get("summary", "")
            pr_url = None
            if create_pr:
                repo.prs += 1
                repo.refs[f"refs/pr/{repo.prs}"] = sha
                pr_url = f"{self._url(repo_id)}/discussions/{repo.prs}"
            else:
                repo.refs[rev] = sha
            with self.state.stats.lock:
                self.state.stats.commits.append({"repo": repo_id, "rev": rev, "lines": lines, "sha": sha})
        self._send(200, {"commitUrl": f"{self._url(repo_id)}/commit/{sha}", "commitOid": sha,
                         "pullRequestUrl": pr_url, "success": True})


class HubServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.state = HubState()
        self.connections: set = set()
        self.conn_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def handle_error(self, request, client_address) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, OSError)):
            super().handle_error(request, client_address)

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.shutdown()
        self.server_close()
        with self.conn_lock:  # keep-alive connections too: afterwards every request is refused
            for conn in list(self.connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def drop_after(self, nbytes: int) -> None:
        """Serve ``nbytes`` more resolve bytes, then reset the connection and refuse new ones."""
        with self.state.stats.lock:
            self.state.drop_after = self.state.stats.served + nbytes
        self.state.on_drop = self.stop


# ---------------------------------------------------------------------------
# Test wiring: point huggingface_hub at a fresh server (used by test_hub / test_push fixtures).

WRITE_TOKEN = "hf_test_write_0123456789"
READ_TOKEN = "hf_test_read_0123456789"


def _loopback_only_client():
    """huggingface_hub's own client, plus a guard: a test must never leave 127.0.0.1."""
    import httpx2
    from huggingface_hub.utils._http import hf_request_event_hook

    def guard(request):
        if request.url.host != "127.0.0.1":
            raise AssertionError(f"a test tried to reach {request.url}")

    return httpx2.Client(event_hooks={"request": [guard, hf_request_event_hook]}, follow_redirects=True, timeout=None)


def serve_hub(monkeypatch, tmp_path):
    """Generator for a pytest fixture: a started HubServer, huggingface_hub pointed at it.

    The legacy LFS upload path (``HF_HUB_DISABLE_XET``), a private ``HF_HOME``, a write token in
    ``HF_TOKEN``, fast retries. huggingface_hub reads some settings at import time, so its
    constants are set too; its HTTP client is its own, with a guard that fails any request
    leaving 127.0.0.1.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils._http import default_client_factory, set_client_factory

    from ckpt_tools.io.hub import HUB_STATS

    srv = HubServer().start()
    srv.state.tokens.update({WRITE_TOKEN: "write", READ_TOKEN: "read"})
    home = tmp_path / "hf_home"
    env = {"HF_ENDPOINT": srv.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0", "HF_HOME": str(home),
           "HF_TOKEN": WRITE_TOKEN, "HF_TOKEN_PATH": str(home / "token"), "CKPT_HUB_RETRIES": "2",
           "CKPT_HUB_RETRY_WAIT": "0.05", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", srv.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        srv.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    set_client_factory(_loopback_only_client)
    HUB_STATS.reset()
    try:
        yield srv
    finally:
        srv.stop()
        set_client_factory(default_client_factory)
