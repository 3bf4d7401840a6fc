#!/usr/bin/env python3
"""A hub-shaped HTTP server on 127.0.0.1 for wick's download tests: one model repository served
from a folder, with the routes and headers of huggingface.co that a client uses (the listing
with `blobs=true`, `resolve` with ranges), and faults on demand.

    hub_server.py --repo org/name --dir FOLDER [--interrupt FILE:BYTES:TIMES] [--corrupt FILE]
                  [--no-range] [--evil-name] [--slow FILE:SECONDS]

Prints `PORT <n>` once it listens. LFS files (weights) are listed with their SHA-256, others with
their git blob id, as the hub does."""
import argparse
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS = (".safetensors", ".bin", ".onnx", ".h5", ".ot", ".msgpack", ".pth")

parser = argparse.ArgumentParser()
parser.add_argument("--repo", required=True)
parser.add_argument("--dir", required=True)
parser.add_argument("--interrupt", help="FILE:BYTES:TIMES: the first TIMES responses for FILE stop after BYTES")
parser.add_argument("--corrupt", help="FILE served with one byte changed")
parser.add_argument("--no-range", action="store_true", help="ignore Range headers")
parser.add_argument("--evil-name", action="store_true", help="list a file named ../../evil.json")
parser.add_argument("--slow", help="FILE:SECONDS: FILE's body sent in 20 pieces over SECONDS")
args = parser.parse_args()

COMMIT = hashlib.sha1(args.repo.encode()).hexdigest()
files = {}
for base, _, names in os.walk(args.dir):
    for n in names:
        path = os.path.join(base, n)
        rel = os.path.relpath(path, args.dir).replace(os.sep, "/")
        data = open(path, "rb").read()
        entry = {"rfilename": rel, "size": len(data), "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if rel.endswith(LFS):
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        files[rel] = (entry, path)
siblings = [e for e, _ in files.values()]
if args.evil_name:
    siblings.append({"rfilename": "../../evil.json", "size": 2, "blobId": "0" * 40})
slow = {}
if args.slow:
    name, seconds = args.slow.rsplit(":", 1)
    slow[name] = float(seconds)
interrupts = {}
if args.interrupt:
    name, nbytes, times = args.interrupt.rsplit(":", 2)
    interrupts[name] = [int(nbytes), int(times)]
lock = threading.Lock()
requests = []


class Hub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):
        pass

    def do_GET(self):
        url = urlparse(self.path)
        path = unquote(url.path)
        with lock:
            requests.append((path, self.headers.get("Range")))
        listing = f"/api/models/{args.repo}/revision/"
        resolve = f"/{args.repo}/resolve/"
        if path.startswith(listing):
            rev = path[len(listing):]
            if rev not in ("main", COMMIT):
                return self.send_error(404)
            body = json.dumps({"id": args.repo, "sha": COMMIT, "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if path.startswith(resolve):
            rev, _, name = path[len(resolve):].partition("/")
            if rev not in ("main", COMMIT) or name not in files:
                return self.send_error(404)
            entry, fpath = files[name]
            data = bytearray(open(fpath, "rb").read())
            if name == args.corrupt:
                data[len(data) // 2] ^= 0xFF
            start = 0
            rng = self.headers.get("Range")
            if rng and not args.no_range:
                start = int(rng.removeprefix("bytes=").split("-")[0])
                if start >= len(data):
                    return self.send_error(416)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", '"%s"' % entry.get("lfs", {}).get("sha256", entry["blobId"]))
            self.end_headers()
            body = bytes(data[start:])
            with lock:
                cut = interrupts.get(name)
                stop = None
                if cut and cut[1] > 0:
                    cut[1] -= 1
                    stop = max(cut[0] - start, 0)
            if stop is not None:
                self.wfile.write(body[:stop])
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            if name in slow:
                piece = max(len(body) // 20, 1)
                for i in range(0, len(body), piece):
                    self.wfile.write(body[i:i + piece])
                    self.wfile.flush()
                    time.sleep(slow[name] / 20)
                return
            self.wfile.write(body)
            return
        if path == "/requests":
            body = json.dumps(requests).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_error(404)


server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
print(f"PORT {server.server_address[1]}", flush=True)
server.serve_forever()
