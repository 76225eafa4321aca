"""An S3-compatible server on loopback (``moto`` in server mode) for tests and benchmarks.

Nothing leaves the machine: the server is a child process bound to 127.0.0.1, its buckets
live in its memory, and it is stopped on exit. Credentials are dummies the server accepts
(TensorStore's ``s3`` kvstore reads them from the environment).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from jaxkv.errors import InputError

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "jaxkv-test", "AWS_SECRET_ACCESS_KEY": "jaxkv-test",
               "AWS_DEFAULT_REGION": "us-east-1"}


def empty_aws_config(directory: str) -> dict:
  """``{AWS_CONFIG_FILE: path, AWS_SHARED_CREDENTIALS_FILE: path}`` of empty files made in
  ``directory``: TensorStore's AWS library logs an error for each one missing."""
  out = {}
  for var, name in (("AWS_CONFIG_FILE", "aws-config"),
                    ("AWS_SHARED_CREDENTIALS_FILE", "aws-credentials")):
    out[var] = os.path.join(directory, name)
    open(out[var], "w").close()
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LocalS3:
  """``with LocalS3() as s3: spec = s3.kvstore("bucket", "path/")``."""

  def __init__(self, start_timeout_s: float = 60.0):
    if importlib.util.find_spec("moto") is None:
      raise InputError("the local S3 server needs moto: pip install 'moto[server]' (it is in "
                       "jaxkv's [test] extra).")
    for k, v in CREDENTIALS.items():
      os.environ.setdefault(k, v)
    self._dir = tempfile.TemporaryDirectory(prefix="jaxkv-s3-")
    for var, path in empty_aws_config(self._dir.name).items():
      os.environ.setdefault(var, path)
    self.port = _free_port()
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                  str(self.port)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    t_end = time.monotonic() + start_timeout_s
    while True:
      try:
        urllib.request.urlopen(self.endpoint + "/", timeout=1.0).read()
        return
      except OSError:
        if self.proc.poll() is not None or time.monotonic() > t_end:
          self.close()
          raise RuntimeError(f"the local S3 server did not start on {self.endpoint}") from None
        time.sleep(0.2)

  def client(self, max_connections: int = 10):
    import boto3  # pylint: disable=import-outside-toplevel  (comes with moto)
    from botocore.config import Config  # pylint: disable=import-outside-toplevel
    return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                        config=Config(max_pool_connections=max_connections),
                        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"])

  def kvstore(self, bucket: str, path: str = "") -> dict:
    """A TensorStore kvstore spec for ``bucket`` (created if needed) under ``path``."""
    client = self.client()
    try:
      client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
      pass
    return {"driver": "s3", "bucket": bucket, "endpoint": self.endpoint,
            "aws_region": "us-east-1", "path": path}

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()

  def __enter__(self) -> "LocalS3":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
