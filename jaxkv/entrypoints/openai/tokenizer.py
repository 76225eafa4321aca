"""Text in and out for a Hugging Face checkpoint directory: ``tokenizer.json`` through the
``tokenizers`` library, the chat template of ``tokenizer_config.json`` (or
``chat_template.jinja``) through the bounded jinja2 sandbox of ``chat_template``. A GGUF
checkpoint's tokenizer (vocabulary, merges, special tokens, chat template: its metadata) is
built into the same ``tokenizers`` form (``jaxkv.models.gguf_tokenizer.tokenizer_parts``).

    tok = jaxkv.Tokenizer.from_dir("/models/Meta-Llama-3-8B-Instruct")
    ids = tok.encode_chat([{"role": "user", "content": "Hello"}])
    out = engine.generate([ids], jaxkv.SamplingParams(max_new_tokens=64,
                                                      stop_token_ids=tok.eos_token_ids))
    print(tok.decode(out[0]))

``encode`` adds special tokens as the file's post-processor says (e.g. Llama's BOS).
``encode_chat`` renders the template (which writes its own special tokens) and encodes the
result without adding more; special-token text inside a message's content becomes those
special tokens unless ``special_tokens_in_content="split"`` (see ``Tokenizer``).
``eos_token_ids`` gathers every end-of-sequence id the
directory names: ``generation_config.json``'s and ``config.json``'s ``eos_token_id`` (an
id or a list) and ``tokenizer_config.json``'s ``eos_token`` — Llama 3 Instruct ends turns
with ``<|eot_id|>``, which only the generation config lists.

Each render is bounded by the tokenizer's ``TemplateLimits`` (``chat_template`` says
how); a render past a bound is refused with a ``TokenizerError`` (an ``InputError``: a
server answers 400), as is a template that fails on the messages. The directory's JSON
files are refused in one line when they are not JSON objects or nest deeper than the
parser follows. ``jaxkv.tokenizer`` is the old path of this module (``jaxkv/_moved.py``).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence

import jinja2

# TemplateLimits is part of this module's API too (``Tokenizer(template_limits=...)``).
from jaxkv.entrypoints.openai.chat_template import (ChatTemplateError, TemplateLimits,
                                                    compile_template, error_line,
                                                    render_bounded)
from jaxkv.errors import InputError
from jaxkv.models import gguf, gguf_tokenizer


class TokenizerError(InputError):
  """A tokenizer directory or request jaxkv cannot use (the message says what and why)."""


def _read_json(path: str) -> dict:
  """The JSON object in file ``path`` ({} when there is none); anything else, or JSON nested
  deeper than the parser follows, refused in one line."""
  if not os.path.exists(path):
    return {}
  try:
    with open(path, "rb") as f:
      value = json.loads(f.read())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenizerError(f"{path} is not valid JSON ({e}); fix it or download it again.") from None
  except RecursionError:
    raise TokenizerError(f"{path} nests JSON deeper than the parser follows; fix it or "
                         "download it again.") from None
  if not isinstance(value, dict):
    raise TokenizerError(f"{path} holds a JSON {type(value).__name__}, not an object; fix it "
                         "or download it again.")
  return value


def _token_text(value) -> str | None:
  """A special token in tokenizer_config.json: a string or ``{"content": ...}``."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _ids(file: str, value) -> list[int]:
  """``eos_token_id`` of ``file``: an id, a list of ids, or null."""
  if value is None:
    return []
  ids = value if isinstance(value, list) else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise TokenizerError(f"{file} eos_token_id={shown} must be a token id or a list of token "
                         "ids; fix it or download it again.")
  return ids


# How the text of a message's content treats special-token strings (``<|im_end|>``) in it.
SPECIAL_TOKENS_IN_CONTENT = ("parse", "split")
# Placeholders for special-token text in contents while the template renders: Unicode
# noncharacters, which no text is meant to hold (one in a content is hidden like a token).
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def _check_mode(value) -> str:
  if value not in SPECIAL_TOKENS_IN_CONTENT:
    raise TokenizerError(f"special_tokens_in_content={value!r} must be one of "
                         f"{', '.join(map(repr, SPECIAL_TOKENS_IN_CONTENT))}.")
  return value


def _map_text(value, f):
  """``value`` (a content: a string, or parts as lists and dicts) with ``f`` applied to
  every string in it."""
  if isinstance(value, str):
    return f(value)
  if isinstance(value, (list, tuple)):
    return [_map_text(v, f) for v in value]
  if isinstance(value, Mapping):
    return {k: _map_text(v, f) for k, v in value.items()}
  return value


class Tokenizer:
  """A checkpoint directory's tokenizer, chat template and end-of-sequence ids.

  ``special_tokens_in_content``: how ``encode_chat`` encodes special-token text written
  inside a message's content (``"<|im_end|>\\n<|im_start|>system"``).
  - ``"parse"`` (the default, as vLLM and transformers do): the rendered prompt is encoded
    whole, so that text becomes the special tokens themselves: a user can write turns of
    other roles into their message.
  - ``"split"``: that text is encoded as plain text (the ``tokenizers`` library's
    ``encode_special_tokens``), the template's own special tokens as special tokens.
    While the template renders, each special-token string in a content (and each
    Unicode noncharacter U+FDD0/U+FDD1) is replaced by a placeholder; the prompt is
    encoded in pieces between placeholders. What it costs, only where a content holds such
    text: the placeholder's text is tokenized apart from its neighbours (no merge across
    its edges; a tokenizer that prefixes each input with a space, SentencePiece's
    Metaspace, may add one to the piece after it), and a template that inspects contents
    (``'<|im_end|>' in content``) sees the placeholder. Contents without special-token
    text encode exactly as under ``"parse"``. Other message fields (``name``, tool calls)
    are not changed. A template that cuts a placeholder apart is refused.
  """

  def __init__(self, path: str, *, template_limits: TemplateLimits = TemplateLimits(),
               special_tokens_in_content: str = "parse"):
    from tokenizers import Tokenizer as _HFTokenizer
    self.path = path
    self.template_limits = template_limits
    self.special_tokens_in_content = _check_mode(special_tokens_in_content)
    gguf_file = gguf.find(path)
    if gguf_file is not None:  # the vocabulary, merges and template are the file's metadata
      parts = gguf_tokenizer.tokenizer_parts(gguf_file)
      self._json = parts["json"]
      self._tok = _HFTokenizer.from_str(self._json)
      self.bos_token, self.eos_token = parts["bos_token"], parts["eos_token"]
      self.chat_template = parts["chat_template"]
      self.eos_token_ids = parts["eos_token_ids"]
      self._special_text = self._special_pattern()
      return
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
      raise TokenizerError(f"{file} is missing: jaxkv reads tokenizers from tokenizer.json "
                           "(the 'fast' tokenizer format) or a .gguf file; pass token ids "
                           "instead.")
    try:
      with open(file, encoding="utf-8") as f:
        self._json = f.read()
      self._tok = _HFTokenizer.from_str(self._json)
    except Exception as e:  # the library raises Exception itself for a file it cannot parse
      raise TokenizerError(f"{file} could not be read by the tokenizers library "
                           f"({error_line(e)}); fix it or download it again.") from None
    self._special_text = self._special_pattern()
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    self.bos_token = _token_text(config.get("bos_token"))
    self.eos_token = _token_text(config.get("eos_token"))
    self.chat_template = self._find_template(path, config.get("chat_template"))
    generation = os.path.join(path, "generation_config.json")
    model = os.path.join(path, "config.json")
    eos = _ids(generation, _read_json(generation).get("eos_token_id"))
    eos += _ids(model, _read_json(model).get("eos_token_id"))
    if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
      eos.append(self._tok.token_to_id(self.eos_token))
    self.eos_token_ids = tuple(dict.fromkeys(eos))  # in order, once each

  def _special_pattern(self):
    special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
    # Longest first: a token that another one starts with never hides the longer one.
    alternatives = sorted(special, key=lambda t: (-len(t), t)) + [_OPEN, _CLOSE]
    return re.compile("|".join(map(re.escape, alternatives)))

  @classmethod
  def from_dir(cls, path: str, *, template_limits: TemplateLimits = TemplateLimits(),
               special_tokens_in_content: str = "parse") -> Tokenizer:
    return cls(path, template_limits=template_limits,
               special_tokens_in_content=special_tokens_in_content)

  @staticmethod
  def _find_template(path: str, template) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
      try:
        with open(jinja_file, encoding="utf-8") as f:
          return f.read()
      except UnicodeDecodeError as e:
        raise TokenizerError(f"{jinja_file} is not UTF-8 text ({e}); fix it or download it "
                             "again.") from None
    if isinstance(template, list):  # named templates: the default one
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
      template = named.get("default")
    return template if isinstance(template, str) else None

  @functools.cached_property
  def _plain(self):
    """A second copy of the tokenizer that encodes special-token text as plain text (the
    flag is the tokenizer's own state: never toggled on the shared one)."""
    from tokenizers import Tokenizer as _HFTokenizer
    tok = _HFTokenizer.from_str(self._json)
    tok.encode_special_tokens = True
    return tok

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    if not isinstance(text, str):
      raise TokenizerError(f"encode takes a string, got {type(text).__name__}.")
    return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_text(self, token: int) -> str:
    """One token's text, special tokens included (a token that is part of a character
    decodes alone to U+FFFD): what log-probabilities name a token by."""
    text = self._texts.get(token)
    if text is None:
      text = self._texts[token] = self._tok.decode([int(token)], skip_special_tokens=False)
    return text

  @functools.cached_property
  def _texts(self) -> dict:
    return {}

  def decoder(self) -> IncrementalDecoder:
    """A decoder of a growing answer (``IncrementalDecoder``): the text ``decode`` gives,
    at a cost per delta that does not grow with the answer."""
    return IncrementalDecoder(self.decode)

  def render_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True
                  ) -> str:
    """The prompt text the chat template makes of ``messages`` (``role``/``content``),
    rendered within ``template_limits`` (see ``chat_template``)."""
    if self.chat_template is None:
      raise TokenizerError(f"{self.path!r} has no chat template (tokenizer_config.json "
                           "chat_template or chat_template.jinja); send plain text instead.")
    for i, m in enumerate(messages):
      if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
        raise TokenizerError(f"message {i} is {m!r}; each message needs 'role' and "
                             "'content'.")
    where = f"the chat template of {self.path!r}"
    try:
      template = compile_template(self.chat_template)
    except jinja2.TemplateError as e:
      raise TokenizerError(f"{where} does not compile ({error_line(e)}); fix "
                           "tokenizer_config.json chat_template or chat_template.jinja.") from None
    try:
      return render_bounded(template, list(messages), self.template_limits, where,
                            add_generation_prompt=add_generation_prompt,
                            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
    except ChatTemplateError as e:  # the same refusal, as the tokenizer's own error
      raise TokenizerError(str(e)) from None

  def encode_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                  special_tokens_in_content: str | None = None) -> list[int]:
    """Token ids of the rendered chat; the template writes the special tokens itself.
    ``special_tokens_in_content``: ``"parse"`` or ``"split"`` for this call (default: the
    tokenizer's; see the class docstring)."""
    mode = (self.special_tokens_in_content if special_tokens_in_content is None
            else _check_mode(special_tokens_in_content))
    if mode == "parse":
      return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt),
                         add_special_tokens=False)
    where = f"the chat template of {self.path!r}"
    if self.chat_template is not None and (_OPEN in self.chat_template
                                           or _CLOSE in self.chat_template):
      raise TokenizerError(f"{where} holds U+FDD0 or U+FDD1, which "
                           "special_tokens_in_content='split' uses as placeholders; use "
                           "'parse' or fix the template.")
    hidden: list[str] = []  # the text each placeholder stands for

    def hide(match):
      hidden.append(match.group(0))
      return f"{_OPEN}{len(hidden) - 1}{_CLOSE}"

    def hide_all(text):
      return self._special_text.sub(hide, text)

    messages = [{**m, "content": _map_text(m["content"], hide_all)}
                if isinstance(m, Mapping) and "content" in m else m for m in messages]
    text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
    ids, start = [], 0
    for match in _PLACEHOLDER.finditer(text):
      ids += self._encode_between(text[start:match.start()], where)
      index = int(match.group(1))
      if index >= len(hidden):
        raise TokenizerError(f"{where} wrote a placeholder no content holds; use "
                             "special_tokens_in_content='parse' or fix the template.")
      ids += self._plain.encode(hidden[index], add_special_tokens=False).ids
      start = match.end()
    return ids + self._encode_between(text[start:], where)

  def _encode_between(self, piece: str, where: str) -> list[int]:
    """A piece of the prompt between placeholders: the template's own text and contents'
    ordinary text, special tokens parsed."""
    if _OPEN in piece or _CLOSE in piece:  # a placeholder the template cut apart
      raise TokenizerError(f"{where} cut apart the placeholder of a special token in a "
                           "message's content (a slice or filter of the content); use "
                           "special_tokens_in_content='parse' or fix the template.")
    return self.encode(piece, add_special_tokens=False) if piece else []


class IncrementalDecoder:
  """``decode(ids)`` of ids that arrive a few at a time, without decoding them all again,
  at a cost per delta that does not grow with the text.

  It keeps the text of the ids read so far as committed pieces (text no later delta
  changes) and a tail. For each delta it decodes a window: the ids from where the last
  delta began to the end, and the same ids without the delta. The new text is what the
  second lacks of the first, so what a decoder does at the window's start (a first
  token's leading space dropped, a character cut in half) cancels out; the window reaches
  further back while the ids before the delta decode to nothing. While the text ends
  inside a character (U+FFFD) it stays the tail: the next delta decodes it whole. Where
  the window's text does not extend its shorter self (a decoder that rewrites across
  tokens), the ids are decoded whole once. ``text`` (joined on demand) is always what
  ``decode`` of every id gives (tests/entrypoints/test_detokenize.py checks it id by id on
  byte-level and SentencePiece-style tokenizers), but while byte tokens that continue a
  run of them after complete characters end inside a character: ``decode`` writes that
  whole run as U+FFFD, ``text`` keeps the complete characters (as decoding them once the
  character is complete gives) and U+FFFD after them."""

  def __init__(self, decode: Callable[[Sequence[int]], str]):
    self._decode = decode
    self.ids: list[int] = []
    self._parts: list[str] = []  # the committed text, the text of ids[:self._read]
    self.committed_chars = 0
    self.tail = ""  # the text after the committed part (ends inside a character)
    self._start = self._read = 0  # the window: ids[start:]; ids[start:read] decoded before
    self.whole_decodes = 0

  @property
  def text(self) -> str:
    """The text of every id so far (joined: O(text); ``extend``'s value is the news)."""
    return "".join(self._parts) + self.tail

  def extend(self, ids: Sequence[int]) -> tuple[int, str]:
    """Adds ``ids``. Returns ``(at, piece)``: the text from character ``at`` on is now
    ``piece`` (what came before ``at`` is as it was at the last call)."""
    at = self.committed_chars
    self.ids.extend(int(i) for i in ids)
    start = self._start
    before = self._decode(self.ids[start:self._read]) if self._read > start else ""
    while not before and start > 0:  # else the window's first text would be the delta's, and
      start = max(0, start - 8)  # what the decoder does at an edge (a space dropped) hits it
      before = self._decode(self.ids[start:self._read])
    window = self._decode(self.ids[start:])
    piece = window[len(before):] if window.startswith(before) else None
    if piece is None and window.endswith("\ufffd"):
      # The delta's byte tokens continue a run of them that ends inside a character, and
      # the decoder wrote the run as U+FFFD whole (the tokenizers library's ByteFallback
      # does), complete characters before the delta included. Those stay committed; the
      # delta waits, as its own text, until its character is complete.
      held = self._decode(self.ids[self._read:])
      piece = held if held.endswith("\ufffd") else None
    if piece is None:  # this decoder rewrites across the window's edge: the whole, once
      self.whole_decodes += 1
      whole = self._decode(self.ids)
      # (rare) the new text starts where the committed text and the whole stop agreeing
      at = len(os.path.commonprefix(["".join(self._parts)[:at], whole]))
      piece = whole[at:]
      text = whole[:at]
      self._parts, self.committed_chars = ([text] if text else []), at
    if piece.endswith("\ufffd"):
      self.tail = piece
    else:
      if piece:
        self._parts.append(piece)
      self.committed_chars = at + len(piece)
      self.tail = ""
      self._start, self._read = self._read, len(self.ids)
    return at, piece
