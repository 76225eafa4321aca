"""The tokenizer a GGUF file carries, built into the ``tokenizers`` library's form that
``jaxkv.Tokenizer`` reads (``tokenizer_parts``): its vocabulary, merges, token types,
special ids and chat template, from the file's ``tokenizer.ggml.*`` metadata."""

from __future__ import annotations

from jaxkv.models.gguf import GGUFError, checkpoint, field


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
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def tokenizer_parts(file: str) -> dict:
  """What ``jaxkv.Tokenizer`` reads from a GGUF file: ``json`` (a ``tokenizers`` library
  tokenizer, serialised), ``bos_token``/``eos_token`` (their text or None),
  ``eos_token_ids`` and ``chat_template`` (or None)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  from tokenizers import processors
  reader = checkpoint(file).meta
  kind = field(reader, "tokenizer.ggml.model")
  tokens = field(reader, "tokenizer.ggml.tokens")
  if kind != "gpt2" or tokens is None:
    raise GGUFError(f"{file} has a tokenizer of kind {kind!r}; jaxkv reads GGUF's byte-level "
                    "BPE tokenizers ('gpt2'); pass token ids instead.")
  pre = field(reader, "tokenizer.ggml.pre")
  if pre not in _PRE_SPLITS:
    raise GGUFError(f"{file} splits text as {pre!r} (tokenizer.ggml.pre); jaxkv reads "
                    f"{', '.join(_PRE_SPLITS)}; pass token ids instead.")
  merges = field(reader, "tokenizer.ggml.merges", [])
  types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  for key, value, kind in (("tokens", tokens, str), ("merges", merges, str),
                           ("token_type", types, int)):
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
      raise GGUFError(f"tokenizer.ggml.{key} of {file} is not a list of {kind.__name__}s; "
                      "convert the model again.")
  if len(types) != len(tokens):
    raise GGUFError(f"{file} has {len(tokens)} tokens but {len(types)} token types.")
  vocab = {t: i for i, t in enumerate(tokens)}
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
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

  def token(key):
    i = field(reader, f"tokenizer.ggml.{key}_token_id")
    if i is not None and not 0 <= i < len(tokens):
      raise GGUFError(f"tokenizer.ggml.{key}_token_id={i} of {file} is not a token id "
                      f"(0..{len(tokens) - 1}).")
    return i

  bos, eos = token("bos"), token("eos")
  single = ["$A"]
  if field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
    single = [tokens[bos]] + single
  if field(reader, "tokenizer.ggml.add_eos_token", False) and eos is not None:
    single = single + [tokens[eos]]
  if len(single) > 1:
    used = sorted({(t, vocab[t]) for t in single if t != "$A"})
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single),
                                                       special_tokens=used)
  ends = [i for i in (eos, token("eot"), token("eom")) if i is not None]
  ends += [i for i, (t, kind) in enumerate(zip(tokens, types))
           if kind == _CONTROL and t in _END_OF_TURN]
  return {"json": tok.to_str(), "bos_token": tokens[bos] if bos is not None else None,
          "eos_token": tokens[eos] if eos is not None else None,
          "eos_token_ids": tuple(dict.fromkeys(ends)),
          "chat_template": field(reader, "tokenizer.chat_template")}
