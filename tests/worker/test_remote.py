"""REMOTE tier: another job's blocks fetched over ZeroMQ (inline, or a jax.experimental.transfer
pull), verified, and a dead or lying peer only ever costs a recompute."""

import json
import threading
import time

import pytest
import zmq

import jaxkv
from jaxkv.worker.tiers import remote
from jaxkv.worker.tiers.base import Fetch
from jaxkv.worker.tiers.remote import Lookup, RemoteClient, RemoteError

import helpers

PREFIX = list(range(1, 42))  # 10 full blocks of 4 tokens
KEY = helpers.REMOTE_KEY  # a deployment key: 32 bytes, 32 distinct values


@pytest.fixture
def owners(remote_owners):
  """The session's owner job (conftest's ``remote_owners``): honest, keyed and lying
  servers over its blocks."""
  return remote_owners


def reader(mesh, peers, deadline=5.0, deployment_key=None, transport="inline"):
  return helpers.make_engine(mesh, tiers=jaxkv.TierConfig(remote_peers=tuple(peers),
                                                          read_deadline_s=deadline,
                                                          remote_transport=transport),
                             deployment_key=deployment_key)


@pytest.fixture(scope="module")
def want(mesh):
  fresh = helpers.make_engine(mesh, prefix_reuse=False)
  return fresh.generate([PREFIX + [50, 51, 52]], 5)


@pytest.mark.parametrize("transport", ["inline", "transfer"])
def test_a_prefix_computed_by_another_job_is_pulled_and_exact(mesh, want, owners, transport):
  engine = reader(mesh, [owners.address["none"]], transport=transport)
  assert engine.generate([PREFIX + [50, 51, 52]], 5) == want
  s = engine.stats()
  assert s["hits"]["remote"] == 10 and s["blocks_fetched"] == 10
  assert s["hits"]["device"] == 0 and s["verify_failures"] == 0
  # Now local: the next request reuses the pulled blocks from device.
  assert engine.generate([PREFIX + [50, 51, 52]], 5) == want
  assert engine.stats()["hits"]["device"] == 10


def test_without_the_deployment_key_a_peer_is_refused_and_counted(mesh, want, owners):
  """The owner runs with a deployment key: a client without it, or with another, is
  refused in the handshake (another key's is counted); a client with it pulls the prefix.
  The handshake is not the only check: a connection with its token (which crosses in
  clear) sending the right block keys without the MAC is refused too, and counted."""
  addr = owners.address["keyed"]
  refused, handshakes_refused = owners.counts("keyed")
  for key in (None, bytes(range(100, 132))):
    engine = reader(mesh, [addr], deployment_key=key)
    assert engine.generate([PREFIX + [50, 51, 52]], 5) == want
    assert engine.stats()["hits"]["remote"] == 0
  keyed = reader(mesh, [addr], deployment_key=KEY)
  keys = keyed.cache.index.block_keys(PREFIX, "default")
  lookup = Lookup(nonce="probe", fingerprint=keyed.cache.config.fingerprint().hex(),
                  keys=tuple(keys))
  bare = RemoteClient(addr, keyed.cache.config.fingerprint())  # no handshake token
  with pytest.raises(RemoteError, match="handshake"):
    bare._call(lookup, time.monotonic() + 10)
  sock = zmq.Context.instance().socket(zmq.DEALER)  # the token, right keys, no MAC
  sock.setsockopt(zmq.LINGER, 0)
  sock.plain_username, sock.plain_password = remote.HANDSHAKE_USER, remote.handshake_token(KEY)
  sock.connect(f"tcp://{addr}")
  sock.send_multipart([b"probe", lookup.encode(), b""])
  assert sock.poll(10_000)
  assert json.loads(sock.recv_multipart()[1])["error"].startswith("unauthenticated")
  sock.close(0)
  assert RemoteClient(addr, keyed.cache.config.fingerprint(), secret=KEY).lookup(keys) == 10
  assert keyed.generate([PREFIX + [50, 51, 52]], 5) == want
  assert keyed.stats()["hits"]["remote"] == 10
  # A server without the key cannot answer a keyed client (it takes no handshake token).
  with pytest.raises(RemoteError, match="handshake"):
    RemoteClient(owners.address["none"], keyed.cache.config.fingerprint(), secret=KEY)._call(
        lookup, time.monotonic() + 10)
  # The call with the token but no MAC; the wrongly keyed reader's handshakes (the keyless
  # ones offer no token at all: they fail before the server's handler is asked).
  now_refused, now_handshakes_refused = owners.counts("keyed")
  assert now_refused == refused + 1 and now_handshakes_refused >= handshakes_refused + 1


@pytest.mark.parametrize("fault", ["checksum", "dtype", "shape", "keys"])
def test_wrong_pulls_are_rejected_never_used(mesh, want, owners, fault):
  engine = reader(mesh, [owners.address[fault]])
  assert engine.generate([PREFIX + [50, 51, 52]], 5) == want
  s = engine.stats()
  assert s["hits"]["remote"] == 0 and s["remote_failures"] == 10
  reason = {"checksum": "checksum", "keys": "key", "shape": "shape", "dtype": None}[fault]
  reasons = s["verify_failures_by_reason"]
  if reason:
    assert reasons == {reason: 10}
  else:  # widened values: the pull itself fails or its bytes do not match their digests
    assert set(reasons) <= {"pull", "checksum", "shape"} and sum(reasons.values()) == 10


def test_killed_or_hanging_peer_costs_only_a_recompute(mesh, want, owners, spare_owner):
  keys = None
  for transport in ("inline", "transfer"):  # no answer; an offer never served
    engine = reader(mesh, [owners.address["hang"]], deadline=1.0, transport=transport)
    keys = engine.cache.index.block_keys(PREFIX, "default")
    assert engine.generate([PREFIX + [50, 51, 52]], 5) == want  # the blocks never come
    s, client = engine.stats(), engine.cache.worker.remotes[0]
    # The wait ended at its deadline, counted; the prompt was recomputed, not taken.
    assert s["read_timeouts"] >= 1 and s["hits"]["remote"] == 0, (transport, s)
    assert s["blocks_recomputed"] >= 10, (transport, s)
    # One fetch, over at its deadline: the request waited once, then recomputed.
    assert client.failures_by_reason == {"deadline": 1}, (transport, client.failures_by_reason)
    assert client.lookup(keys) == 10  # the peer still answers what it holds
  try:
    engine = reader(mesh, [spare_owner.address["none"]], deadline=2.0)
    engine.generate([[9, 9, 9, 9, 9]], 2)  # the peer is alive and answering
  finally:
    spare_owner.kill()  # kill -9: its sockets vanish with it
  client = engine.cache.worker.remotes[0]
  for _ in range(4):  # every request still finishes, with the right tokens
    assert engine.generate([PREFIX + [50, 51, 52]], 5) == want
    engine.cache.index.evict_all_unreferenced(0)
    for s in range(4):
      engine.cache.index.evict_all_unreferenced(s)
  assert engine.stats()["hits"]["remote"] == 0
  assert not client.available  # the breaker is open: the dead peer is not asked again
  failures = dict(client.failures_by_reason)
  assert client.lookup([b"x" * 32]) == 0
  # Refused by the open breaker alone: no connection made, nothing else counted.
  assert client.failures_by_reason == {**failures, "breaker": failures.get("breaker", 0) + 1}
  assert client._sock is None


def test_a_peers_blocks_cross_the_link_while_the_caller_computes(mesh, owners):
  """``start_fetch`` starts the pull and returns: the blocks arrive while the caller does
  something else (a step recomputing a split's front), before it comes to wait, and
  ``finish_fetch`` says when they arrived (the link is learned from that, not from the
  wait)."""
  engine = reader(mesh, [owners.address["none"]])
  tier = engine.cache.worker.remote
  keys = engine.cache.index.block_keys(PREFIX, "default")
  fetches = [Fetch(request=0, block=j, shard=0, tier=jaxkv.Tier.REMOTE, slot=0, key=key,
                   page=j + 1) for j, key in enumerate(keys)]
  t0 = time.perf_counter()
  _, pulls = tier.start_fetch(fetches)
  helpers.wait_for(pulls.done.is_set, 10, "the pull ended with no one waiting for it")
  t_wait = time.perf_counter()
  outcome = tier.finish_fetch(pulls, time.monotonic() + 5, stage=list)
  assert outcome.failures == (None,) * len(keys)
  assert [page for _, page, _ in outcome.landing] == [f.page for f in fetches]
  assert t0 < outcome.arrived <= t_wait


def test_a_pull_that_never_comes_leaves_no_thread(mesh, owners):
  """The peer offers a transfer it never serves: the fetch is a deadline miss, and the
  thread that waited on the pull ends (its connection is broken) instead of waiting on."""
  addr = owners.address["hang"]
  engine = reader(mesh, [addr], transport="transfer")
  client = RemoteClient(addr, engine.cache.config.fingerprint(), transport="transfer")
  keys = engine.cache.index.block_keys(PREFIX, "default")
  before = set(threading.enumerate())
  for _ in range(2):
    with pytest.raises(RemoteError) as e:
      client.fetch(keys, engine.cache.payload_shape, engine.cache.config.jnp_dtype,
                   time.monotonic() + 1.0)
    assert e.value.reason == "deadline"
  helpers.wait_for(lambda: not set(threading.enumerate()) - before, 10,
                   "the threads that waited on the pulls ended")


def test_malformed_requests_get_answers_and_the_server_keeps_serving(mesh):
  """Garbage on the wire (wrong frame counts, bytes that are not JSON, an unknown op, an
  oversized request, an answer to an earlier request) never stops the server or confuses
  a client: each gets an error or is dropped, and the next real request is answered."""
  import json
  import threading
  import zmq
  from jaxkv.worker.tiers import remote
  owner = helpers.make_engine(mesh)
  owner.generate([PREFIX], 1)
  server = remote.BlockServer(owner.cache)
  stop = threading.Event()
  thread = threading.Thread(target=lambda: [server.poll(0.05) for _ in iter(stop.is_set, True)])
  thread.start()
  try:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{server.address}")

    def ask(frames):
      raw.send_multipart(frames)
      assert raw.poll(10_000), frames
      return json.loads(raw.recv_multipart()[1])  # [nonce, answer, tag]

    assert "3 frames" in ask([b"only one"])["error"]
    assert "JSONDecodeError" in ask([b"n0", b"{not json", b""])["error"]
    fp = owner.cache.config.fingerprint().hex()
    bad = {"op": "drop", "protocol": remote.PROTOCOL, "fingerprint": fp, "nonce": "n1"}
    answer = ask([b"n1", json.dumps(bad).encode(), b""])
    assert "unknown op" in answer["error"] and answer["nonce"] == "n1"
    wrong = {"op": "lookup", "protocol": remote.PROTOCOL - 1, "fingerprint": fp, "keys": []}
    assert "protocol" in ask([b"n2", json.dumps(wrong).encode(), b""])["error"]
    huge = zmq.Context.instance().socket(zmq.DEALER)  # over the request size limit: dropped
    huge.setsockopt(zmq.LINGER, 0)
    gone = huge.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    huge.connect(f"tcp://{server.address}")
    oversized = server.counts["oversized"]
    huge.send_multipart([b"n3", b"x" * (remote.MAX_REQUEST_BYTES + 1), b""])
    # The server hangs up on it, counted: once the client has seen the hang-up, whatever the
    # server sent before it has arrived. Nothing had.
    helpers.wait_for(lambda: gone.poll(0), 30, "the server hung up on the oversized request")
    assert server.counts["oversized"] == oversized + 1
    assert not huge.poll(0)
    huge.disable_monitor()
    gone.close(0)
    huge.close(0)
    keys = owner.cache.index.block_keys(PREFIX, "default")
    client = RemoteClient(server.address, owner.cache.config.fingerprint())
    assert client.lookup(keys) == 10
    # An answer to another request waiting on the connection is skipped, not taken.
    client.expect(owner.cache.payload_shape, owner.cache.config.jnp_dtype)
    assert client.lookup(keys) == 10
    answered = server.counts["answered"]
    client._sock.send_multipart([b"stale", json.dumps({**bad, "nonce": "stale"}).encode(), b""])
    helpers.wait_for(lambda: server.counts["answered"] > answered, 30,
                     "the server answered the stale request")  # its answer waits, unread
    stack = client.fetch(keys, owner.cache.payload_shape, owner.cache.config.jnp_dtype,
                         time.monotonic() + 30)
    assert stack.shape[0] == 10 and client.breaker.available
    assert client.stale_answers == 1 and not client.failures_by_reason
    raw.close(0)
  finally:
    stop.set()
    thread.join()
    server.close()


def test_every_wire_message_round_trips_and_a_broken_one_is_named():
  """One schema for both sides: what a side builds decodes to the same value, and a
  message that breaks a field's rule (built here or read off the wire) is refused with
  the field and the rule."""
  import json
  from jaxkv.worker.tiers import remote
  keys = (b"a" * 32, b"b" * 32)
  requests = [remote.Hello(nonce="n0"),
              remote.Lookup(nonce="n1", fingerprint="ff", keys=keys),
              remote.FetchBlocks(nonce="n2", fingerprint="ff", keys=keys, token="t",
                                 transport="transfer", sealed=True, wait_ms=500)]
  answers = [remote.Welcome(nonce="n0", challenge="c", valid_ms=60_000),
             remote.Have(nonce="n1", have=2),
             remote.Offer(nonce="n2", keys=keys, dtype="uint16", shape=(2, 4, 2, 4, 8),
                          crc32c=7, token="t", transfer_id=3, transfer_address="h:1",
                          expires_ms=500),
             remote.Offer(nonce="n2", keys=keys, dtype="uint16", shape=(2, 4, 2, 4, 8),
                          token="t", sealed=False, data_tag="ab" * 28),
             remote.Refusal(nonce="", error="why")]
  for msg in requests:
    assert remote.decode(msg.encode(), remote.REQUESTS) == msg
  for msg in answers:
    assert remote.decode(msg.encode(), remote.ANSWERS) == msg
  with pytest.raises(remote.WireError, match="unknown op 'offer'"):  # an answer as a request
    remote.decode(answers[2].encode(), remote.REQUESTS)
  with pytest.raises(remote.WireError, match=r"Lookup.keys=.*32-byte"):
    remote.Lookup(nonce="n", fingerprint="ff", keys=(b"short",))
  with pytest.raises(remote.WireError, match="transport"):
    remote.FetchBlocks(nonce="n", fingerprint="ff", keys=keys, token="t", transport="rdma",
                       sealed=False, wait_ms=0)
  with pytest.raises(remote.WireError, match="at most 512"):
    remote.FetchBlocks(nonce="n", fingerprint="ff", keys=(b"a" * 32,) * 513, token="t",
                       transport="inline", sealed=False, wait_ms=0)
  with pytest.raises(remote.WireError, match="data_tag"):
    remote.Offer(nonce="n", keys=keys, dtype="uint16", shape=(2,), token="t", data_tag="xy")
  wire = json.loads(requests[1].encode())
  for broken, match in (({**wire, "keys": "abc"}, "Lookup.keys must be"),
                        ({**wire, "have": 1}, r"no fields \['have'\]"),
                        ({k: v for k, v in wire.items() if k != "keys"}, "needs field 'keys'"),
                        ({**wire, "nonce": "é"}, "Lookup.nonce")):
    with pytest.raises(remote.WireError, match=match) as e:
      remote.decode(json.dumps(broken).encode(), remote.REQUESTS)
    assert e.value.nonce == ("" if broken["nonce"] == "é" else "n1")  # still answerable
  with pytest.raises(remote.WireError, match="Have.have"):
    remote.decode(json.dumps({"op": "have", "protocol": remote.PROTOCOL, "nonce": "n",
                              "have": True}).encode(), remote.ANSWERS)


def test_the_remote_tier_modules_import_one_way():
  """wire <- auth <- connections <- server, client <- tier: each module imports only those
  before it (``tier`` the client; ``server`` and ``client`` never each other, nor ``client``
  the server's connections), and none imports the package's ``__init__`` (its re-exports
  are for the package's users)."""
  import ast
  import pathlib
  package = "jaxkv.worker.tiers.remote"
  where = pathlib.Path(helpers.ROOT, *package.split("."))
  names = {p.stem for p in where.glob("*.py")}
  assert names == {"__init__", "wire", "auth", "connections", "server", "client", "tier"}, (
      sorted(names))

  def imported(name: str) -> set[str]:
    """The package's modules ``name`` imports (``__init__`` for the package itself)."""
    out = set()
    for node in ast.walk(ast.parse((where / f"{name}.py").read_text())):
      if isinstance(node, ast.ImportFrom):
        base = package if node.level else (node.module or "")
        full = f"{base}.{node.module}" if node.level and node.module else base
        targets = [f"{full}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      else:
        continue
      for target in targets:
        for prefix in (package, "jaxkv.tiers.remote"):  # the old path is the same package
          if target == prefix or target.startswith(prefix + "."):
            rest = target[len(prefix) + 1:].split(".")[0]
            out.add(rest if rest in names - {"__init__"} else "__init__")
    return out

  never = {"wire": {"auth", "connections", "server", "client", "tier"},
           "auth": {"connections", "server", "client", "tier"},
           "connections": {"server", "client", "tier"}, "server": {"client", "tier"},
           "client": {"connections", "server", "tier"}, "tier": {"connections", "server"}}
  for name, forbidden in never.items():
    got = imported(name)
    assert not got & (forbidden | {"__init__"}), f"{name} imports {sorted(got)}"
  assert "client" in imported("tier") and "wire" in imported("auth")
  assert "connections" in imported("server")


JOB_READER = r"""
import json, sys
sys.path.insert(0, "tests")
from jaxkv import distributed
distributed.initialize()
import jax, jaxkv, helpers
peer, out, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = helpers.make_engine(jaxkv.make_mesh(data=2, model=1), tiers=jaxkv.TierConfig(
    remote_peers=(peer,), read_deadline_s=30.0))
# The first and third together; the second after them, so that the first's pulled blocks
# are on device when it is admitted (admitted in the same step, it would pull them too).
first = engine.generate([prompts[0], prompts[2]], 5)
tokens = [first[0], engine.generate([prompts[1]], 5)[0], first[1]]
s = engine.stats()
with open(f"{out}.p{jax.process_index()}.json", "w") as f:
  json.dump({"tokens": tokens, "hits": s["hits"], "fetched": s["blocks_fetched"],
             "lookups": s["peer_lookups"],
             "index": engine.cache.index.digest(),
             "pending": engine.cache.manager.peers_pending()}, f)
"""


def test_a_two_process_job_asks_the_peer_once_and_pulls_its_blocks_onto_every_process(
    owners, tmp_path):
  """A job of two processes (one data shard each) reading from a peer: process 0 asks the
  peer, off the step loop, and its answers reach both processes together (they admit
  alike); each process pulls the blocks its own shard needs and the job agrees on every
  outcome. The tokens are a recompute's, and both processes end with the same index."""
  import jax
  prompts = [PREFIX + [50, 51, 52], PREFIX[:21] + [7, 8, 9], list(range(90, 100))]
  fresh = helpers.make_engine(jaxkv.make_mesh(data=2, model=1, devices=jax.devices()[:2]),
                              prefix_reuse=False)
  want = fresh.generate(prompts, 5)
  script = tmp_path / "reader.py"
  script.write_text(JOB_READER)
  out = tmp_path / "job"
  code, _, err = helpers.run_script(
      ["launch/multihost.py", "--num_processes=2", "--devices=2", "--", str(script),
       owners.address["none"], str(out), json.dumps(prompts)], timeout_s=600)
  assert code == 0, err[-3000:]
  p0, p1 = (json.loads((tmp_path / f"job.p{i}.json").read_text()) for i in (0, 1))
  assert p0["tokens"] == p1["tokens"] == want
  assert p0["index"] == p1["index"] and p0["hits"] == p1["hits"]
  # The first prompt pulls the peer's 10 blocks; the second, admitted after it, finds its 5
  # among them, on the device of the shard they were pulled to; the third has none anywhere.
  assert p0["hits"]["remote"] == 10 and p0["hits"]["device"] == 5
  assert p0["fetched"] == p1["fetched"] == 10
  # Process 0 asked about the first and third prompts (the second's prefix was on device,
  # nothing longer to ask for); process 1 asked nothing.
  assert p0["lookups"] == 2 and p1["lookups"] == 0
  assert not p0["pending"] and not p1["pending"]
