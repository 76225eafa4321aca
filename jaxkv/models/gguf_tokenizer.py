"""The tokenizer a GGUF file carries, built into the ``tokenizers`` library's form that
``jaxkv.Tokenizer`` reads (``tokenizer_parts``): its vocabulary, merges, token types,
special ids and chat template, from the file's ``tokenizer.ggml.*`` metadata.

Two kinds (``tokenizer.ggml.model``), each encoding and decoding as llama.cpp does:
- ``gpt2``: byte-level BPE with the file's merges and its pre-split (``tokenizer.ggml.pre``).
- ``llama``: SentencePiece-style (Llama 1/2, Gemma 3): tokens with scores and no merges
  list. llama.cpp splits a text into characters (spaces written as "▁"; a "▁" before the
  text when ``tokenizer.ggml.add_space_prefix``, its default, says so) and joins adjacent
  pieces whose union is a token, the highest-scoring union first (leftmost among equals);
  a character no token holds becomes its UTF-8 bytes' ``<0xNN>`` tokens. That is a BPE
  whose merges are every split of every token into two tokens, ranked by the joined
  token's score: ``tokenizers``' BPE with ``byte_fallback`` runs it. Decoding writes "▁"
  as a space and byte tokens as their bytes; with the space prefix, the text's first space
  is dropped (llama.cpp drops it too, but keeps it when the ids start with BOS).
In both, control tokens (and unknown ones) are special tokens (parsed from text unless
``encode_special_tokens``; left out of a decode that skips special tokens) and user-defined
tokens (Gemma's runs of newlines, spaces and tabs, HTML tags) are always taken from the
raw text before anything else, as llama.cpp does.

The build reads the whole vocabulary (Gemma 3's 262k tokens: seconds), so it is kept per
file while the file is unchanged (the path, modification time and size)."""

from __future__ import annotations

import functools
import os

# The header reader, without the model's architecture check: a file's tokenizer does not
# depend on whether jaxkv computes its model.
from jaxkv.models.gguf import GGUFError, Header, field

# ``tokenizer.ggml.pre`` names how llama.cpp splits text before BPE; these are the splits
# of the names jaxkv reads (regular expressions over Unicode classes, applied in order,
# each piece kept), and whether GPT-2's byte-level split follows (else the pieces are only
# mapped to bytes) and merges apply to a piece that is a token already (Llama 3's do not).
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
           r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"gpt-2": ((), True), "smollm": ((r"\p{N}",), True),
               "starcoder": ((r"\p{N}",), True), "refact": ((r"\p{N}",), True),
               "llama-bpe": ((_LLAMA3,), False)}
# Control tokens that end a turn, by their text, for files whose metadata names only one
# end-of-sequence id (llama.cpp finds these the same way).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                "<|endoftext|>", "</s>")
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values
_SPACE = "\u2581"  # how SentencePiece writes a space inside a token ("▁")
_KINDS = ("gpt2", "llama")


def tokenizer_parts(file: str) -> dict:
  """What ``jaxkv.Tokenizer`` reads from a GGUF file: ``json`` (a ``tokenizers`` library
  tokenizer, serialised), ``bos_token``/``eos_token`` (their text or None),
  ``eos_token_ids`` and ``chat_template`` (or None)."""
  st = os.stat(file)
  return dict(_parts(os.path.realpath(file), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=2)
def _parts(file: str, mtime_ns: int, size: int) -> dict:
  del mtime_ns, size  # the cache's key
  from tokenizers import AddedToken
  reader = Header(file)
  kind = field(reader, "tokenizer.ggml.model")
  tokens = field(reader, "tokenizer.ggml.tokens")
  if kind not in _KINDS:
    raise GGUFError(f"{file} has a tokenizer of kind {kind!r}; jaxkv reads GGUF's byte-level "
                    "BPE ('gpt2') and SentencePiece-style ('llama') tokenizers; pass token "
                    "ids instead.")
  if tokens is None:
    raise GGUFError(f"{file} has no tokenizer.ggml.tokens; convert the model again or pass "
                    "token ids instead.")
  types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  _check_lists(file, tokens=(tokens, str, "string"), token_type=(types, int, "integer"))
  if len(types) != len(tokens):
    raise GGUFError(f"{file} has {len(tokens)} tokens but {len(types)} token types.")
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    twice = next(t for i, t in enumerate(tokens) if vocab[t] != i)
    raise GGUFError(f"{file} lists token {twice!r} twice (ids {tokens.index(twice)} and "
                    f"{vocab[twice]}); convert the model again.")
  spm = kind == "llama"
  tok = _spm(file, reader, tokens, vocab) if spm else _bpe(file, reader, tokens, vocab)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, kind in zip(tokens, types) if kind in (_CONTROL, _UNKNOWN)])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
  # llama.cpp's defaults where the metadata says nothing: Llama 1/2's ids, BOS added.
  bos = _token_id(file, reader, tokens, "bos", 1 if spm else None)
  eos = _token_id(file, reader, tokens, "eos", 2 if spm else None)
  _add_bos_eos(tok, tokens,
               bos if field(reader, "tokenizer.ggml.add_bos_token", spm) else None,
               eos if field(reader, "tokenizer.ggml.add_eos_token", False) else None)
  ends = [i for i in (eos, _token_id(file, reader, tokens, "eot"),
                      _token_id(file, reader, tokens, "eom")) if i is not None]
  ends += [i for i, (t, kind) in enumerate(zip(tokens, types))
           if kind == _CONTROL and t in _END_OF_TURN]
  return {"json": tok.to_str(), "bos_token": tokens[bos] if bos is not None else None,
          "eos_token": tokens[eos] if eos is not None else None,
          "eos_token_ids": tuple(dict.fromkeys(ends)),
          "chat_template": field(reader, "tokenizer.chat_template")}


def _check_lists(file: str, **lists) -> None:
  """Each ``key=(value, types, what)``: ``tokenizer.ggml.<key>`` must be a list of
  ``types`` (``what`` names them)."""
  for key, (value, kind, what) in lists.items():
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
      raise GGUFError(f"tokenizer.ggml.{key} of {file} is not a list of {what}s; convert "
                      "the model again.")


def _token_id(file, reader, tokens, key, default=None):
  """``tokenizer.ggml.<key>_token_id`` (``default`` when absent), checked to be a token."""
  i = field(reader, f"tokenizer.ggml.{key}_token_id", default)
  if i is not None and not 0 <= i < len(tokens):
    raise GGUFError(f"tokenizer.ggml.{key}_token_id={i} of {file} is not a token id "
                    f"(0..{len(tokens) - 1}).")
  return i


def _add_bos_eos(tok, tokens, bos, eos) -> None:
  """A post-processor that adds the BOS/EOS tokens (each None: not added) around a text."""
  from tokenizers import processors
  single = ([tokens[bos]] if bos is not None else []) + ["$A"]
  single += [tokens[eos]] if eos is not None else []
  if len(single) > 1:
    used = sorted({(tokens[i], i) for i in (bos, eos) if i is not None})
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single),
                                                       special_tokens=used)


def _bpe(file, reader, tokens, vocab):
  """The byte-level BPE of a ``gpt2`` file: its merges, split as ``tokenizer.ggml.pre``."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  pre = field(reader, "tokenizer.ggml.pre")
  if pre not in _PRE_SPLITS:
    raise GGUFError(f"{file} splits text as {pre!r} (tokenizer.ggml.pre); jaxkv reads "
                    f"{', '.join(_PRE_SPLITS)}; pass token ids instead.")
  merges = field(reader, "tokenizer.ggml.merges", [])
  _check_lists(file, merges=(merges, str, "string"))
  pairs = []
  for m in merges:
    left, sep, right = m.partition(" ")
    if not sep or left not in vocab or right not in vocab:
      raise GGUFError(f"merge {m!r} of {file} does not join two tokens of its vocabulary.")
    pairs.append((left, right))
  patterns, gpt2_split = _PRE_SPLITS[pre]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=not gpt2_split))
  splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in patterns]
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_split)])
  tok.decoder = decoders.ByteLevel()
  return tok


def _spm(file, reader, tokens, vocab):
  """The SentencePiece-style tokenizer of a ``llama`` file (see the module docstring)."""
  from tokenizers import Tokenizer, decoders, models, normalizers
  scores = field(reader, "tokenizer.ggml.scores")
  if scores is None:  # llama.cpp scores every token 0 then: joins leftmost first
    scores = [0.0] * len(tokens)
  _check_lists(file, scores=(scores, (int, float), "number"))
  if len(scores) != len(tokens):
    raise GGUFError(f"{file} has {len(tokens)} tokens but {len(scores)} scores; convert the "
                    "model again.")
  missing = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
  if missing:  # a character no token holds is written as these
    raise GGUFError(f"{file} has no byte token <0x{missing[0]:02X}> ({len(missing)} of the "
                    "256 <0xNN> tokens are missing); jaxkv needs them all to write characters "
                    "its vocabulary lacks; convert the model again.")
  model = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, vocab),
                     byte_fallback=True, fuse_unk=False)
  tok = Tokenizer(model)
  # The tokens' own space ("▁"), and the space llama.cpp writes before each stretch of text
  # that starts the input or follows a token taken whole (Prepend skips an empty stretch).
  space = [normalizers.Replace(" ", _SPACE)]
  decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
  if field(reader, "tokenizer.ggml.add_space_prefix", True):
    space = [normalizers.Prepend(_SPACE)] + space
    decode.append(decoders.Strip(" ", 1, 0))  # after Fuse: the text's first space only
  tok.normalizer = normalizers.Sequence(space)
  tok.decoder = decoders.Sequence(decode)
  return tok


def spm_merges(tokens: list[str], scores: list[float], vocab: dict) -> list[tuple[str, str]]:
  """The merges that make BPE join pieces as llama.cpp's SentencePiece-style tokenizer
  does: every split of a token into two tokens, the joined token's score highest first.
  Splits that make the same token never compete for a piece (two of them overlapping would
  make the same text from both sides, so be one split), and tokens of equal score break
  ties by id (llama.cpp: leftmost; only Gemma's user-defined runs tie, which the raw text
  loses before merging)."""
  pairs = []
  for i in sorted(range(len(tokens)), key=scores.__getitem__, reverse=True):  # (stable)
    text = tokens[i]
    for cut in range(1, len(text)):
      left = text[:cut]
      if left in vocab:
        right = text[cut:]
        if right in vocab:
          pairs.append((left, right))
  return pairs
