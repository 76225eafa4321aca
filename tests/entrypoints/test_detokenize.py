"""Incremental detokenization: an answer's text, delta by delta, is what decoding every
token gives, id by id, on a byte-level BPE tokenizer, a SentencePiece-style one (a leading
space marker, byte fallback) and SmolLM2's GGUF tokenizer; and each delta decodes a
window, not the whole answer."""

import os

import numpy as np
import pytest

import gguf_fixtures as gf
import hf_fixtures as hf
import jaxkv
from jaxkv.entrypoints.openai.tokenizer import IncrementalDecoder

TEXT = ("Café déjà vu — naïve 🙂 ok.\n  Two  spaces, tabs\tand 日本語 text; "
        "the cache keeps keys and values of every page. ") * 3


def sentencepiece_style(path) -> str:
  """A BPE tokenizer with a Metaspace pre-tokenizer and decoder and byte fallback (how
  Llama 2 and Mistral tokenizers decode), trained here."""
  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  os.makedirs(path, exist_ok=True)
  tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
  tok.normalizer = normalizers.Replace(" ", "\u2581")
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
  tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
  tok.train_from_iterator(hf.CORPUS + [TEXT], trainers.BpeTrainer(
      vocab_size=600, special_tokens=specials, show_progress=False))
  tok.save(os.path.join(path, "tokenizer.json"))
  return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  work = tmp_path_factory.mktemp("tok")
  byte_level = str(work / "byte_level")
  hf.write_tokenizer(byte_level)
  smollm2 = str(work / "smollm2")
  os.makedirs(smollm2)
  os.symlink(gf.smollm2_path(), os.path.join(smollm2, os.path.basename(gf.smollm2_path())))
  return {name: jaxkv.Tokenizer.from_dir(path) for name, path in (
      ("byte_level", byte_level), ("sentencepiece", sentencepiece_style(str(work / "sp"))),
      ("smollm2", smollm2))}


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece", "smollm2"])
def test_the_text_after_every_delta_is_the_whole_decode(tokenizers, name):
  tok = tokenizers[name]
  rng = np.random.default_rng(0)
  vocab = tok.vocab_size
  cases = [tok.encode(TEXT, add_special_tokens=False)]  # real text, emoji and CJK included
  cases += [rng.integers(0, vocab, 200).tolist() for _ in range(12)]  # anything, specials too
  for ids in cases:
    for sizes in (1, 3):
      dec = IncrementalDecoder(tok.decode)
      at = 0
      while at < len(ids):
        n = int(rng.integers(1, sizes + 1))
        dec.extend(ids[at:at + n])
        at += n
        assert dec.text == tok.decode(ids[:at]), (name, at)
  assert "\ufffd" not in tok.decode(cases[0]) and tok.decode(cases[0]) == TEXT


def test_each_delta_decodes_a_window_not_the_answer(tokenizers):
  tok = tokenizers["byte_level"]
  decoded = []

  def counting(ids):
    decoded.append(len(ids))
    return tok.decode(ids)

  ids = (tok.encode(TEXT, add_special_tokens=False) * 40)[:4096]
  dec = IncrementalDecoder(counting)
  for t in ids:
    dec.extend([t])
  assert dec.text == tok.decode(ids) and dec.whole_decodes == 0
  assert sum(decoded) <= 6 * len(ids)  # a few tokens per delta (a whole decode: ~2,000)
  assert max(decoded) <= 16
