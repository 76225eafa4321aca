"""Drives a prefill node and a decode node as one OpenAI-compatible server
(jaxkv/entrypoints/openai/pd_proxy.py: what it sends where, and what a client may cost it).

  python launch/pd_proxy.py --prefill=http://127.0.0.1:8100 --decode=http://127.0.0.1:8200 \
      --port=8000

The servers are ``launch/server.py --role=prefill`` and ``--role=decode`` on one ``--pool``.
Like the API server it serves under pre-auth HTTP limits (connections, headers, slow
clients, body size: the flags below).
"""

from absl import app, flags

import _common

_PREFILL = flags.DEFINE_string("prefill", None, "Base URL of the prefill node "
                               "(http://HOST:PORT).", required=True)
_DECODE = flags.DEFINE_string("decode", None, "Base URL of the decode node.", required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port, written "
                             "to --ready_file).", lower_bound=0, upper_bound=65535)
_READY_FILE = flags.DEFINE_string("ready_file", None, "Write {\"port\": P} here once it listens.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 600.0, "The longest either node may take to answer.")
_MAX_BODY_BYTES = flags.DEFINE_integer(
    "max_body_bytes", 4 << 20, "The largest request body taken (the API server's); larger "
    "ones get 413 before they are read.", lower_bound=1)
_MAX_CONNECTIONS = flags.DEFINE_integer(
    "max_connections", None, "HTTP connections open at once; more are answered 503 and "
    "closed (default: half the file-descriptor limit, at most 1000).", lower_bound=1)
_HEADER_TIMEOUT = flags.DEFINE_float(
    "header_timeout_s", 10.0, "A request's line and headers must arrive within this (408).",
    lower_bound=0.001)
_BODY_TIMEOUT = flags.DEFINE_float(
    "body_timeout_s", 30.0, "A request's body must arrive within this after its headers "
    "(408).", lower_bound=0.001)


def main(argv):
  del argv
  for name, url in (("prefill", _PREFILL.value), ("decode", _DECODE.value)):
    if not url.startswith(("http://", "https://")):
      raise app.UsageError(f"--{name}={url!r} is not an http://HOST:PORT URL.")
  _common.check_output(_READY_FILE.value, "ready_file")
  from jaxkv.entrypoints.openai import limits, pd_proxy
  api = pd_proxy.make_app(_PREFILL.value.rstrip("/"), _DECODE.value.rstrip("/"),
                          timeout_s=_TIMEOUT.value, max_body_bytes=_MAX_BODY_BYTES.value)
  bounds = limits.HttpLimits(
      **({} if _MAX_CONNECTIONS.value is None else {"max_connections": _MAX_CONNECTIONS.value}),
      head_timeout_s=_HEADER_TIMEOUT.value, body_timeout_s=_BODY_TIMEOUT.value)
  _common.serve_app(api, host=_HOST.value, port=_PORT.value, ready_file=_READY_FILE.value,
                    banner="pd proxy", limits=bounds)

if __name__ == "__main__":
  _common.run(main)
