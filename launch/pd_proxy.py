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
_HTTP_LIMITS = _common.define_http_limit_flags()

def main(argv):
  del argv
  for name, url in (("prefill", _PREFILL.value), ("decode", _DECODE.value)):
    if not url.startswith(("http://", "https://")):
      raise app.UsageError(f"--{name}={url!r} is not an http://HOST:PORT URL.")
  _common.check_output(_READY_FILE.value, "ready_file")
  from jaxkv.entrypoints.openai import pd_proxy
  api = pd_proxy.make_app(_PREFILL.value.rstrip("/"), _DECODE.value.rstrip("/"),
                          timeout_s=_TIMEOUT.value, max_body_bytes=_MAX_BODY_BYTES.value)
  _common.serve_app(api, host=_HOST.value, port=_PORT.value, ready_file=_READY_FILE.value,
                    banner="pd proxy", limits=_HTTP_LIMITS())

if __name__ == "__main__":
  _common.run(main)
