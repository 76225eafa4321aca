"""The router (launch/router.py) and the P/D proxy (launch/pd_proxy.py) hold the API server's
pre-auth limits: real processes on loopback over a stand-in node (a small HTTP server in
this process that answers as a replica, a prefill node and a decode node do), driven with
raw sockets as an attacker drives them: a huge content-length, an endless chunked body, a
header that never ends, a request that stops half-way, a flood of connections. Each is
refused with its status, and a refused huge body costs the process (its peak RSS, VmHWM)
no more than a stated bound."""

import http.server
import json
import os
import socket
import threading
import time

import httpx
import pytest

import helpers
from jaxkv.tools.bench.http import ServerProcess

HUGE = 192 << 20  # the content-length sent; only its head and a few MiB are
SENT = 4 << 20
RSS_BOUND = 48 << 20  # what the refused body may add to the process's peak RSS
PROXY_CONNECTIONS = 8
ROUTER_NOFILE = 128  # the router's file limit: its default max_connections is half of it

# Runs the script (the arguments after it) with a lower file-descriptor limit, as an
# operator's ``ulimit -n`` would: the router's default connection bound comes from it.
_WITH_NOFILE = ("import os, resource, runpy, sys\n"
                f"resource.setrlimit(resource.RLIMIT_NOFILE, ({ROUTER_NOFILE}, "
                "resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
                "sys.argv = sys.argv[1:]\n"
                "sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")


class _StandIn(http.server.BaseHTTPRequestHandler):
  """A node: /health 200, /v1/models, and any POST answered with one choice and the
  hand-off parameters a prefill node gives."""

  protocol_version = "HTTP/1.1"

  def do_GET(self):
    self._send({"status": "ok"} if self.path == "/health" else {"object": "list", "data": []})

  def do_POST(self):
    self.rfile.read(int(self.headers.get("content-length") or 0))
    self._send({"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": "x", "finish_reason": "length"}],
        "kv_transfer_params": {"do_remote_prefill": True}})

  def _send(self, obj):
    body = json.dumps(obj).encode()
    self.send_response(200)
    self.send_header("content-type", "application/json")
    self.send_header("content-length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, *args):
    pass


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
  work = tmp_path_factory.mktemp("fronts")
  node = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
  thread = threading.Thread(target=node.serve_forever, daemon=True)
  thread.start()
  url = f"http://127.0.0.1:{node.server_address[1]}"
  procs = []
  try:
    procs.append(ServerProcess([f"--replicas={url}", "--routing=round_robin"],
                               script=os.path.join("launch", "router.py"),
                               prefix=("-c", _WITH_NOFILE), workdir=str(work)))
    procs.append(ServerProcess([f"--prefill={url}", f"--decode={url}",
                                f"--max_connections={PROXY_CONNECTIONS}",
                                "--header_timeout_s=1", "--body_timeout_s=1"],
                               script=os.path.join("launch", "pd_proxy.py"),
                               workdir=str(work)))
    for p in procs:
      p.wait_ready(120)
    yield {"router": procs[0], "proxy": procs[1]}
  finally:
    for p in procs:
      p.close(5)
    node.shutdown()
    node.server_close()


def connect(server, timeout_s=10.0) -> socket.socket:
  return socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s)


def status_of(sock: socket.socket) -> int:
  """The status of the answer on ``sock`` (its deadline: the socket's timeout)."""
  data = b""
  while b"\r\n" not in data:
    chunk = sock.recv(4096)
    if not chunk:
      raise AssertionError(f"the connection closed with no answer (read {data!r})")
    data += chunk
  return int(data.split(b" ", 2)[1])


def send_quietly(sock: socket.socket, data: bytes) -> None:
  """Sends what the server may refuse to read (it closes once it answered)."""
  try:
    sock.sendall(data)
  except OSError:
    pass


def peak_rss(server) -> int:
  with open(f"/proc/{server.proc.pid}/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) << 10
  raise AssertionError("no VmHWM in /proc/PID/status")


def head(length_header: str) -> bytes:
  return ("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
          f"{length_header}\r\n\r\n").encode()


@pytest.mark.parametrize("front", ["router", "proxy"])
def test_a_huge_body_is_refused_before_it_is_read(fronts, front):
  server = fronts[front]
  before = peak_rss(server)
  with connect(server) as sock:
    sock.sendall(head(f"content-length: {HUGE}"))
    sender = threading.Thread(target=send_quietly, args=(sock, b"[" * SENT), daemon=True)
    sender.start()
    assert status_of(sock) == 413
    sender.join(10)
  grew = peak_rss(server) - before
  assert grew < RSS_BOUND, f"{front}: a refused {HUGE >> 20} MiB body grew its peak RSS {grew}"
  # A chunked body says no length: it is cut off once it passes the bound (4 MiB).
  with connect(server) as sock:
    sock.sendall(head("transfer-encoding: chunked"))
    piece = b"%x\r\n%s\r\n" % (1 << 20, b"[" * (1 << 20))
    sender = threading.Thread(target=send_quietly, args=(sock, piece * 6), daemon=True)
    sender.start()
    assert status_of(sock) == 413
    sender.join(10)
  # And the front still answers.
  assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("front", ["router", "proxy"])
def test_a_header_that_never_ends_gets_431(fronts, front):
  with connect(fronts[front]) as sock:
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-endless: ")
    send_quietly(sock, b"a" * (80 << 10))
    assert status_of(sock) == 431


def test_a_half_sent_request_gets_408(fronts):
  proxy = fronts["proxy"]  # started with --header_timeout_s=1 --body_timeout_s=1
  with connect(proxy) as sock:  # the headers stop half-way
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    assert status_of(sock) == 408
  with connect(proxy) as sock:  # the body stops half-way
    sock.sendall(head("content-length: 100") + b'{"model": ')
    assert status_of(sock) == 408


def accepted(server) -> int:
  """Connections the front's process holds on its port, as the kernel counts them: its
  open sockets that are established TCP connections with the front's port as their own
  (a connection gets a descriptor only once the process has accepted it)."""
  inodes = set()
  fd_dir = f"/proc/{server.proc.pid}/fd"
  for fd in os.listdir(fd_dir):
    try:
      link = os.readlink(os.path.join(fd_dir, fd))
    except FileNotFoundError:  # closed meanwhile
      continue
    if link.startswith("socket:["):
      inodes.add(link[len("socket:["):-1])
  count = 0
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
      next(f)  # the header
      for line in f:
        fields = line.split()
        port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
        count += port == server.port and state == "01" and inode in inodes  # 01: ESTABLISHED
  return count


@pytest.mark.parametrize("front", ["router", "proxy"])
def test_connections_past_the_bound_get_503(fronts, front):
  server = fronts[front]
  bound = PROXY_CONNECTIONS if front == "proxy" else ROUTER_NOFILE // 2
  held = []
  try:
    for _ in range(bound):
      held.append(connect(server))
    helpers.wait_for(lambda: accepted(server) >= bound, 10,
                     f"{front} accepted the {bound} held connections", interval_s=0.01)
    with connect(server) as extra:
      assert status_of(extra) == 503
  finally:
    for sock in held:
      sock.close()
  deadline = time.monotonic() + 10
  while True:  # the held ones closed: the front takes connections again
    try:
      if httpx.get(f"{server.base}/health", timeout=5).status_code == 200:
        break
    except httpx.HTTPError:
      pass
    assert time.monotonic() < deadline, f"{front} takes no connection after a flood"
    time.sleep(0.1)
