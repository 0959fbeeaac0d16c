"""A real S3-protocol server on loopback for the object-storage tests: moto's standalone server
(`moto[server]`, as s3fs's own suite uses), bound to 127.0.0.1 on a free port, in its own process.
moto checks a conditional PutObject's precondition and then writes, on one thread per request, so two
contenders could both pass an `If-Match`; S3 makes the pair atomic, and so does this server
(`_atomic_conditional_writes`), or the lease tests would test moto's race instead of ours.

The pipeline reaches it exactly as it reaches AWS: through s3fs, with the endpoint and credentials in
the standard variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), which child
processes (the CLI, Ray and Beam workers) inherit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server():
    """Start the server, point the AWS variables at it, and yield its endpoint URL; stop it after."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, __file__, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)
        os.environ.update(env)
        _forget_clients()
        yield endpoint
    finally:
        _forget_clients()  # a client cached in this process would go on calling a server that is gone
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=10)


def _forget_clients() -> None:
    """Drop s3fs's cached filesystems: each holds the endpoint it was made with, and fsspec hands the
    same one back for the same arguments, so a second server in one process (the benchmarks start one
    per module) was called at the first one's address."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def new_bucket() -> str:
    """A fresh bucket on the server the environment points at; returns s3://NAME."""
    import fsspec

    name = f"ew-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(name)
    return f"s3://{name}"


def _atomic_conditional_writes(app):
    """WSGI middleware: a write that carries a precondition (If-Match, If-None-Match) runs alone, so
    its check and its write are one step, as on S3."""
    import threading

    lock = threading.Lock()

    def serve(environ, start_response):
        if environ.get("HTTP_IF_MATCH") or environ.get("HTTP_IF_NONE_MATCH"):
            with lock:
                return list(app(environ, start_response))
        return app(environ, start_response)

    return serve


def _serve(port: int) -> None:
    """moto's server (as `python -m moto.server`), its conditional writes made atomic."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(
        "127.0.0.1", port, _atomic_conditional_writes(app), threaded=True, request_handler=MotoRequestHandler
    )


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
