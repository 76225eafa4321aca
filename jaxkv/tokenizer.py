"""Text in and out for a Hugging Face checkpoint directory: ``tokenizer.json`` through the
``tokenizers`` library, the chat template of ``tokenizer_config.json`` through ``jinja2``.

    tok = jaxkv.Tokenizer.from_dir("/models/Meta-Llama-3-8B-Instruct")
    ids = tok.encode_chat([{"role": "user", "content": "Hello"}])
    out = engine.generate([ids], jaxkv.SamplingParams(max_new_tokens=64,
                                                      stop_token_ids=tok.eos_token_ids))
    print(tok.decode(out[0]))

``encode`` adds special tokens as the file's post-processor says (e.g. Llama's BOS).
``encode_chat`` renders the template (which writes its own special tokens) and encodes the
result without adding more. ``eos_token_ids`` gathers every end-of-sequence id the
directory names: ``generation_config.json``'s and ``config.json``'s ``eos_token_id`` (an
id or a list) and ``tokenizer_config.json``'s ``eos_token`` — Llama 3 Instruct ends turns
with ``<|eot_id|>``, which only the generation config lists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from jaxkv.errors import InputError


class TokenizerError(InputError):
  """A tokenizer directory or request jaxkv cannot use (the message says what and why)."""


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise TokenizerError(f"{path} is not valid JSON ({e}).") from None


def _token_text(value) -> str | None:
  """A special token in tokenizer_config.json: a string or ``{"content": ...}``."""
  if isinstance(value, Mapping):
    return value.get("content")
  return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in (value if isinstance(value, list) else [value])]


class Tokenizer:
  """A checkpoint directory's tokenizer, chat template and end-of-sequence ids."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer as _HFTokenizer
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
      raise TokenizerError(f"{file} is missing: jaxkv reads tokenizers from tokenizer.json "
                           "(the 'fast' tokenizer format); pass token ids instead.")
    self.path = path
    self._tok = _HFTokenizer.from_file(file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    self.bos_token = _token_text(config.get("bos_token"))
    self.eos_token = _token_text(config.get("eos_token"))
    self.chat_template = self._find_template(path, config.get("chat_template"))
    eos = _ids(_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id"))
    eos += _ids(_read_json(os.path.join(path, "config.json")).get("eos_token_id"))
    if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
      eos.append(self._tok.token_to_id(self.eos_token))
    self.eos_token_ids = tuple(dict.fromkeys(eos))  # in order, once each

  @classmethod
  def from_dir(cls, path: str) -> Tokenizer:
    return cls(path)

  @staticmethod
  def _find_template(path: str, template) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
      with open(jinja_file) as f:
        return f.read()
    if isinstance(template, list):  # named templates: the default one
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
      template = named.get("default")
    return template if isinstance(template, str) else None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    if not isinstance(text, str):
      raise TokenizerError(f"encode takes a string, got {type(text).__name__}.")
    return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True
                  ) -> str:
    """The prompt text the chat template makes of ``messages`` (``role``/``content``)."""
    if self.chat_template is None:
      raise TokenizerError(f"{self.path!r} has no chat template (tokenizer_config.json "
                           "chat_template or chat_template.jinja); send plain text instead.")
    for i, m in enumerate(messages):
      if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
        raise TokenizerError(f"message {i} is {m!r}; each message needs 'role' and "
                             "'content'.")
    return _compile(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "")

  def encode_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True
                  ) -> list[int]:
    """Token ids of the rendered chat; the template writes the special tokens itself."""
    return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt),
                       add_special_tokens=False)


_TEMPLATES: dict = {}


def _compile(source: str):
  """A chat template in a sandboxed Jinja environment with the helpers templates call."""
  if source not in _TEMPLATES:
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
      raise TokenizerError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.Undefined)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                                indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    _TEMPLATES[source] = env.from_string(source)
  return _TEMPLATES[source]
