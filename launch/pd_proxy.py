"""Drives a prefill node and a decode node as one OpenAI-compatible server.

  python launch/pd_proxy.py --prefill=http://127.0.0.1:8100 --decode=http://127.0.0.1:8200 \
      --port=8000

Each POST /v1/completions or /v1/chat/completions goes to the prefill node with
``max_tokens=1``, ``stream=false`` and ``kv_transfer_params: {"do_remote_decode": true}``;
the ``kv_transfer_params`` of its answer (the prompt's blocks are in the pool by then) go on
with the original request to the decode node, whose answer (streamed or not) is passed back
as it comes. The Authorization header goes to both. A prefill that fails is answered with
its error; the decode node is not asked. GET /v1/models and /health are the decode node's.
The servers are ``launch/server.py --role=prefill`` and ``--role=decode`` on one ``--pool``.
"""

import json

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


def make_app(prefill: str, decode: str, timeout_s: float):
  import httpx
  from fastapi import FastAPI, Request
  from fastapi.responses import JSONResponse, Response, StreamingResponse

  api = FastAPI(title="jaxkv pd proxy", docs_url=None, redoc_url=None, openapi_url=None)
  client = httpx.AsyncClient(timeout=timeout_s)

  def headers(request: Request) -> dict:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}

  def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error",
                                   "param": None, "code": None}}, status_code=status)

  async def relay(request: Request, path: str):
    try:
      body = json.loads(await request.body())
    except ValueError:
      return error(400, "the body is not JSON; send a JSON object.")
    if not isinstance(body, dict):
      return error(400, "send a JSON object.")
    first = dict(body, max_tokens=1, stream=False,
                 kv_transfer_params={"do_remote_decode": True})
    first.pop("max_completion_tokens", None)
    first.pop("stream_options", None)
    try:
      pre = await client.post(f"{prefill}{path}", json=first, headers=headers(request))
    except httpx.HTTPError as e:
      return error(502, f"the prefill node did not answer: {e}")
    if pre.status_code != 200:
      return Response(pre.content, status_code=pre.status_code,
                      media_type=pre.headers.get("content-type"))
    params = pre.json().get("kv_transfer_params")
    second = dict(body, kv_transfer_params=params)
    req = client.build_request("POST", f"{decode}{path}", json=second, headers=headers(request))
    try:
      resp = await client.send(req, stream=True)
    except httpx.HTTPError as e:
      return error(502, f"the decode node did not answer: {e}")

    async def passthrough():
      try:
        async for chunk in resp.aiter_raw():
          yield chunk
      finally:
        await resp.aclose()

    return StreamingResponse(passthrough(), status_code=resp.status_code,
                             media_type=resp.headers.get("content-type"))

  @api.post("/v1/completions")
  async def completions(request: Request):
    return await relay(request, "/v1/completions")

  @api.post("/v1/chat/completions")
  async def chat(request: Request):
    return await relay(request, "/v1/chat/completions")

  @api.get("/v1/models")
  async def models(request: Request):
    r = await client.get(f"{decode}/v1/models", headers=headers(request))
    return Response(r.content, status_code=r.status_code,
                    media_type=r.headers.get("content-type"))

  @api.get("/health")
  async def health():
    try:
      codes = [(await client.get(f"{url}/health")).status_code for url in (prefill, decode)]
    except httpx.HTTPError as e:
      return error(503, f"a node does not answer: {e}")
    return ({"status": "ok"} if codes == [200, 200]
            else error(503, f"prefill /health {codes[0]}, decode /health {codes[1]}"))

  return api


def main(argv):
  del argv
  for name, url in (("prefill", _PREFILL.value), ("decode", _DECODE.value)):
    if not url.startswith(("http://", "https://")):
      raise app.UsageError(f"--{name}={url!r} is not an http://HOST:PORT URL.")
  _common.check_output(_READY_FILE.value, "ready_file")
  api = make_app(_PREFILL.value.rstrip("/"), _DECODE.value.rstrip("/"), _TIMEOUT.value)
  _common.serve_app(api, host=_HOST.value, port=_PORT.value, ready_file=_READY_FILE.value,
                    banner="pd proxy")

if __name__ == "__main__":
  _common.run(main)
