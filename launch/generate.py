"""Generate text from a Hugging Face checkpoint directory (Llama, Mistral, Qwen2).

  python launch/generate.py --model_dir=/models/Llama-3.2-1B-Instruct \
      --prompt="Why is the sky blue?" --chat --max_new_tokens=64
  python launch/generate.py --model_dir=DIR --prompt_ids=1,450,3303 --json_out=/tmp/g.json
  python launch/generate.py --model_dir=DIR --prompt="..." --platform=gpu --dtype=bfloat16

Greedy unless --temperature > 0. Stops at the tokenizer's end-of-sequence ids (or
config.json's without a tokenizer) unless --ignore_eos. Prints the answer's text (its
token ids when the directory has no tokenizer.json); --json_out writes ``token_ids``
(the generated ids), ``text`` (with a tokenizer), ``prompt_ids`` and timings. Runs on CPU
unless --platform says otherwise; --mesh_model splits the KV heads over that many devices.

Defaults per platform (logged at load): on CPU the weights are converted to float32 and
prefill runs in 128-token steps (XLA:CPU's bfloat16 dots are several times slower, and
a narrow step reads every weight for few tokens); on GPU and TPU the checkpoint's dtype
and 64-token steps. --dtype always wins.
"""

import math
import time

from absl import app, flags, logging

import _common

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Hugging Face checkpoint directory "
                                 "(config.json, *.safetensors, tokenizer.json), or a .gguf "
                                 "file.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (needs a tokenizer: tokenizer.json "
                              "or the GGUF file's).")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "Prompt token ids, comma-separated.")
_CHAT = flags.DEFINE_bool("chat", False, "Send --prompt as a user message through the "
                          "checkpoint's chat template.")
_SYSTEM = flags.DEFINE_string("system", None, "With --chat: a system message first.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Most tokens generated.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy.", lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (with --temperature).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample from this many tokens (0: all).",
                              lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0)
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "Generate --max_new_tokens tokens even "
                                "past an end-of-sequence token.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "Weights and activations (default: the platform's: float32 on "
                           "CPU, the checkpoint's torch_dtype on GPU and TPU).")
_PLATFORM = flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu", "tpu"], "JAX backend.")
_MESH_MODEL = flags.DEFINE_integer("mesh_model", 1, "Devices the KV heads are split over.",
                                   lower_bound=1)
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", lower_bound=1)
_JSON_OUT = flags.DEFINE_string("json_out", "", "Write the result here as one JSON object.")

flags.mark_flag_as_required("model_dir")
flags.register_validator("prompt", lambda v: v is None or v != "",
                         "--prompt is empty; give some text or use --prompt_ids.")


def main(argv):
  del argv
  _common.check_output(_JSON_OUT.value, "json_out")
  if (_PROMPT.value is None) == (_PROMPT_IDS.value is None):
    raise app.UsageError("give exactly one of --prompt=TEXT or --prompt_ids=1,2,3.")
  if _CHAT.value and _PROMPT.value is None:
    raise app.UsageError("--chat needs --prompt (the user message's text).")
  prompt_ids = None
  if _PROMPT_IDS.value is not None:
    try:
      prompt_ids = [int(t) for t in _PROMPT_IDS.value]
    except ValueError:
      raise app.UsageError(f"--prompt_ids={','.join(_PROMPT_IDS.value)} must be integers "
                           "separated by commas.") from None
    if not prompt_ids:
      raise app.UsageError("--prompt_ids is empty; give at least one token id.")
  _common.start_jax({"platform": _PLATFORM.value})
  import jax

  import jaxkv
  from jaxkv.entrypoints.openai.tokenizer import Tokenizer, TokenizerError
  from jaxkv.tools import builder

  model_dir = _MODEL_DIR.value
  hf = jaxkv.models.hf.read_config(model_dir)
  platform = jax.default_backend()
  stored = jaxkv.models.hf.checkpoint_dtype(hf)
  if _DTYPE.value is not None:
    dtype, why = _DTYPE.value, f"asked for with --dtype; checkpoint stores {stored}"
  else:
    dtype, why = jaxkv.models.hf.platform_dtype(stored, platform)
    if dtype != stored:
      why += f"; --dtype={stored} keeps it"
  model_cfg = jaxkv.models.model_config(hf, dtype=dtype)  # by the checkpoint's architecture
  tok = None
  try:
    tok = Tokenizer.from_dir(model_dir)
  except TokenizerError:
    if prompt_ids is None:
      raise
  if prompt_ids is None:
    if _CHAT.value:
      messages = ([{"role": "system", "content": _SYSTEM.value}] if _SYSTEM.value else [])
      prompt_ids = tok.encode_chat(messages + [{"role": "user", "content": _PROMPT.value}])
    else:
      prompt_ids = tok.encode(_PROMPT.value)
  stops = ()
  if not _IGNORE_EOS.value:
    eos = hf.get("eos_token_id")
    stops = tok.eos_token_ids if tok is not None else tuple(
        eos if isinstance(eos, list) else [] if eos is None else [eos])

  total = len(prompt_ids) + _MAX_NEW.value
  # A Llama-family window is one jaxkv does not apply (a hybrid model's windows it does).
  if (isinstance(model_cfg, jaxkv.models.LlamaConfig) and model_cfg.sliding_window
      and total > model_cfg.sliding_window):
    raise app.UsageError(f"prompt ({len(prompt_ids)} tokens) + --max_new_tokens="
                         f"{_MAX_NEW.value} exceeds the model's sliding window of "
                         f"{model_cfg.sliding_window} tokens, which jaxkv does not apply.")
  devices = jax.devices()[:_MESH_MODEL.value]
  if len(devices) < _MESH_MODEL.value:
    raise app.UsageError(f"--mesh_model={_MESH_MODEL.value} but this machine has "
                         f"{len(jax.devices())} {jax.default_backend()} device(s).")
  mesh = jaxkv.make_mesh(data=1, model=_MESH_MODEL.value, devices=devices)

  t0 = time.perf_counter()
  model = jaxkv.models.from_pretrained(model_dir, dtype=dtype, mesh=mesh)
  load_s = time.perf_counter() - t0
  pages = math.ceil(total / _PAGE_SIZE.value)
  chunk_pages = 4
  if platform == "cpu":  # as wide as a served checkpoint's (builder.CPU_PREFILL_TOKENS): each
    # step reads every weight once, so a wide step is bound by the cores, not by memory
    chunk_pages = min(pages, math.ceil(builder.CPU_PREFILL_TOKENS / _PAGE_SIZE.value))
  logging.info("loaded %s in %.1f s: dtype %s (%s); prefill chunk %d pages", model_dir,
               load_s, dtype, why, chunk_pages)
  cache = jaxkv.CacheConfig.for_model(  # the shapes (and a window group) are the model's
      model_cfg, model_name=model_dir, page_size=_PAGE_SIZE.value, pages_per_shard=pages,
      max_pages_per_seq=pages, attention_chunk_pages=min(pages, 8), dtype=model_cfg.dtype)
  engine = jaxkv.Engine(model, jaxkv.KVCache(cache, mesh),
                        jaxkv.EngineConfig(max_seqs_per_shard=1,
                                           prefill_chunk_pages=chunk_pages))
  sampling = jaxkv.SamplingParams(
      max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
      top_p=_TOP_P.value, seed=_SEED.value, stop_token_ids=stops)
  t1 = time.perf_counter()
  engine.warmup(max_seq_len=total)  # compiles the steps this request runs
  compile_s = time.perf_counter() - t1
  t1 = time.perf_counter()
  first = []
  handle = engine.submit(prompt_ids, sampling,
                         on_token=lambda _: first or first.append(time.perf_counter()))
  tokens = list(handle)
  t2 = time.perf_counter()
  text = tok.decode(tokens) if tok is not None else None
  print(text if text is not None else " ".join(map(str, tokens)))
  decode_s = t2 - first[0] if first else 0.0
  result = {
      "model_dir": model_dir,
      "architecture": hf.get("architectures", [None])[0],
      "dtype": model_cfg.dtype,
      "dtype_reason": why,
      "checkpoint_dtype": stored,
      "prefill_chunk_pages": chunk_pages,
      "prompt_ids": prompt_ids,
      "token_ids": tokens,
      "text": text,
      "stopped_at_eos": bool(tokens) and tokens[-1] in stops,
      "load_s": load_s,
      "compile_s": compile_s,
      "ttft_s": (first[0] - t1) if first else None,
      "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None,
      "weights_digest": engine.cache.config.weights_digest,
      "machine": _common.machine_info(),
  }
  _common.write_json(_JSON_OUT.value, result)


if __name__ == "__main__":
  _common.run(main)
