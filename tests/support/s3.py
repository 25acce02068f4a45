"""A real S3 API on loopback for the object-store suites: moto's server as a subprocess.

`MotoS3` starts ``python -m moto.server`` on 127.0.0.1 (a free port), waits for it and creates
a bucket; `env` holds the standard AWS variables that point pyarrow's ``S3FileSystem`` and
obstore's ``S3Store`` (and so the proxy, started with them in its environment) at it. Nothing
leaves the machine. moto honours ``If-None-Match: *`` and ``If-Match`` on PUT
(docs/reports/object-store-spike.md), so conditional writes are tested for real.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

__all__ = ["MotoS3"]

#: One line of moto's request log: the method after the quote (colour codes may sit between).
_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|PUT|POST|HEAD|DELETE) ')

_KEY = "testing"
_SECRET = "testing"
_REGION = "us-east-1"


class MotoS3:
    """moto's S3 server on 127.0.0.1, one bucket; `stop` it (or use it as a context manager)."""

    def __init__(self, workdir: Path, bucket: str = "capture") -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = bucket
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "moto.log"
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    self.stop()
                    msg = f"moto's server did not start; see {self.log_path}"
                    raise RuntimeError(msg) from None
                time.sleep(0.1)
        self.create_bucket(bucket)

    def create_bucket(self, bucket: str) -> None:
        # moto does not check signatures: an unsigned PUT creates the bucket.
        req = urllib.request.Request(f"{self.endpoint}/{bucket}", method="PUT")
        with urllib.request.urlopen(req, timeout=5):
            pass

    def requests(self) -> int:
        """Requests served so far (the server logs each one once it has answered)."""
        time.sleep(0.15)  # the log line follows the response
        return len(_REQUEST.findall(self.log_path.read_text(errors="replace")))

    def url(self, prefix: str | None = None) -> str:
        """A fresh ``s3://bucket/prefix`` (a new prefix per call unless one is given)."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex}"

    @property
    def env(self) -> dict[str, str]:
        """The AWS variables that make pyarrow, obstore and a proxy process use this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": _KEY,
            "AWS_SECRET_ACCESS_KEY": _SECRET,
            "AWS_REGION": _REGION,
            "AWS_DEFAULT_REGION": _REGION,
            "AWS_ALLOW_HTTP": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def apply_env(self) -> dict[str, str | None]:
        """Set `env` in this process; returns the previous values for `restore_env`."""
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        return old

    @staticmethod
    def restore_env(old: dict[str, str | None]) -> None:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> MotoS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
