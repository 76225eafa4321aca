"""Dynamo's standalone KV indexer (``python -m dynamo.indexer``, package ai-dynamo-runtime) in
a child process: the router-side reader of KV events that the tests and the replicas
benchmark start on loopback, and its HTTP API as jaxkv's router calls it.

      with DynamoIndexer() as idx:
        idx.register(1, "tcp://127.0.0.1:5557", replay="tcp://127.0.0.1:5558", block_size=16)
        idx.query([1, 2, 3, ...])   # {1: {"device": 32, "host": 48, "disk": 48}, ...}

Its API (1.6): ``POST /register {instance_id, endpoint, model_name, block_size,
replay_endpoint?}`` subscribes to a worker's event stream; ``POST /query {token_ids,
model_name}`` answers ``instances``: per worker the tokens of the longest prefix held on
device (``gpu``), on device or host (``cpu``), or anywhere (``disk``, ``longest_matched``),
counted in whole blocks; ``GET /dump`` the radix tree's events; ``GET /health``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from jaxkv.entrypoints.openai.router import parse_query, register
from jaxkv.worker.tiers.pool.master import free_port


class DynamoIndexer:
  """``python -m dynamo.indexer`` on a free port (it listens on every interface: the tests'
  machines reach it only on loopback), in a process group of its own, killed on ``close``."""

  def __init__(self, *, port: int | None = None, log_dir: str | None = None,
               threads: int = 1):
    self.port = port or free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._dir = tempfile.TemporaryDirectory(prefix="jaxkv-indexer-", dir=log_dir)
    self.log_path = os.path.join(self._dir.name, "indexer.log")
    self._log = open(self.log_path, "wb")
    env = dict(os.environ, NO_COLOR="1", RUST_LOG=os.environ.get("RUST_LOG", "info"))
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
         "--threads", str(threads)], stdout=self._log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True)
    self.client = httpx.Client(base_url=self.url, timeout=10.0)

  def wait_ready(self, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"dynamo.indexer exited with status {self.proc.returncode}; its "
                           f"log ends:\n{self.log_tail()}")
      try:
        if self.client.get("/health").status_code == 200:
          return
      except httpx.HTTPError:
        pass
      if time.monotonic() > deadline:
        raise TimeoutError(f"dynamo.indexer did not answer /health within {timeout_s} s; its "
                           f"log ends:\n{self.log_tail()}")
      time.sleep(0.1)

  def register(self, worker: int, endpoint: str, *, replay: str | None = None,
               block_size: int, model_name: str = "default") -> None:
    register(self.url, worker, endpoint, replay=replay, block_size=block_size,
             model_name=model_name)

  def query(self, tokens, model_name: str = "default") -> dict[int, dict[str, int]]:
    r = self.client.post("/query", json={"token_ids": list(map(int, tokens)),
                                         "model_name": model_name})
    r.raise_for_status()
    return parse_query(r.json())

  def workers(self) -> list[dict]:
    return self.client.get("/workers").json()

  def log_tail(self, chars: int = 4000) -> str:
    self._log.flush()
    with open(self.log_path, "rb") as f:
      return f.read().decode("utf-8", "replace")[-chars:]

  def close(self) -> None:
    self.client.close()
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.proc.wait(30)
    self._log.close()

  def __enter__(self) -> DynamoIndexer:
    self.wait_ready()
    return self

  def __exit__(self, *exc) -> None:
    self.close()
    self._dir.cleanup()
