"""A local stand-in for the Hugging Face Hub's HTTP API, enough for ``snapshot_download``:
a repo's revision and file tree (``/api/models/...``) and its files (``/resolve/...``),
served from a folder. Tests point ``HF_ENDPOINT`` at it; nothing leaves the machine."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"  # the one revision every repo has


@contextmanager
def fake_hub(repos: dict[str, Path]) -> Iterator[tuple[str, list[str]]]:
    """Serve ``repos`` (repo id -> folder); yields the endpoint URL and the paths requested."""
    requested: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(head=True)

        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, head: bool) -> None:
            requested.append(self.path)
            for repo, folder in repos.items():
                files = {f.name: f for f in sorted(folder.iterdir()) if f.is_file()}
                if self.path.startswith(f"/api/models/{repo}/revision/"):
                    return self._json({"id": repo, "sha": SHA, "siblings": [{"rfilename": n} for n in files]})
                if self.path.startswith(f"/api/models/{repo}/tree/"):
                    return self._json([{"type": "file", "path": n, "size": f.stat().st_size,
                                        "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for n, f in files.items()])
                prefix = f"/{repo}/resolve/{SHA}/"
                if self.path.startswith(prefix) and self.path[len(prefix):] in files:
                    return self._file(files[self.path[len(prefix):]].read_bytes(), head)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _json(self, obj: object) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _file(self, data: bytes, head: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", SHA)
            self.end_headers()
            if not head:
                self.wfile.write(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", requested
    finally:
        server.shutdown()
        server.server_close()
