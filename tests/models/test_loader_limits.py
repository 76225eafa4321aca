"""What a checkpoint from elsewhere may make the loader do (issue #25, "Loader limits").

A checkpoint directory is input: its safetensors headers are read into memory, its index
names files to open. Each is bounded here with real files in ``tmp_path``: a header longer
than the safetensors library's cap is refused before it is read, and a header entry whose
shape its offsets do not hold (``[2**62, 4]`` included) when the file is opened; a
config.json claiming a million layers is refused at its first missing tensor, before any
model is built; JSON files nested past the parser's depth or of the wrong kind are refused
in one line; an index naming a shard outside the directory (``..``, an absolute path, a
symlink out) is refused, while the Hugging Face hub cache's own symlinks load. (Its chat
template, which runs on every request: tests/entrypoints/test_chat_template.py.)
"""

import json
import os
import shutil

import numpy as np
import pytest

import helpers
import hf_fixtures as hf
import jaxkv
from jaxkv.entrypoints.openai.tokenizer import TokenizerError
from jaxkv.models import CheckpointError, from_pretrained
from jaxkv.models.hf import MAX_HEADER_BYTES, SafetensorsFile


# ---- safetensors headers ------------------------------------------------------------------
def checkpoint_with_weights_file(tmp_path, header_length: int, file_size: int) -> str:
  """A checkpoint whose model.safetensors declares ``header_length`` and holds
  ``file_size`` bytes (sparse: the filesystem stores none of the zeros)."""
  path = str(tmp_path / "ckpt")
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf.hf_config("llama"), f)
  with open(os.path.join(path, "model.safetensors"), "wb") as f:
    f.write(header_length.to_bytes(8, "little") + b"{}")
    f.truncate(file_size)
  return path


@pytest.mark.parametrize("header_length", [2**40, MAX_HEADER_BYTES + 1])
def test_a_header_longer_than_the_cap_is_refused_before_it_is_read(tmp_path, header_length):
  # The file is long enough to hold the header: only the cap can refuse it.
  path = checkpoint_with_weights_file(tmp_path, header_length, header_length + 8 + 64)
  with pytest.raises(CheckpointError) as e:
    from_pretrained(path)
  message = str(e.value)
  assert f"declares a safetensors header of {header_length:,} bytes" in message
  assert f"at most {MAX_HEADER_BYTES:,} bytes" in message
  assert "model.safetensors" in message and "download or convert it again" in message
  assert "\n" not in message


def test_a_header_at_the_cap_is_read(tmp_path):
  # The boundary: a header of exactly the cap passes the cap and is parsed (its zeros are
  # not JSON); the cap refuses nothing a safetensors library would read.
  path = checkpoint_with_weights_file(tmp_path, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 8)
  with pytest.raises(CheckpointError, match="unreadable safetensors header"):
    from_pretrained(path)


def test_a_header_longer_than_the_file_is_refused(tmp_path):
  path = checkpoint_with_weights_file(tmp_path, 1000, 100)
  with pytest.raises(CheckpointError, match=r"header length 1000, file size 100\)"):
    from_pretrained(path)


def write_safetensors(file: str, header: dict, data_bytes: int) -> str:
  """A safetensors file with ``header`` as it is (no check) and ``data_bytes`` of zeros."""
  raw = json.dumps(header).encode()
  with open(file, "wb") as f:
    f.write(len(raw).to_bytes(8, "little") + raw + bytes(data_bytes))
  return file


@pytest.mark.parametrize("entry,needle", [
    # 2**62 x 4 x 4 bytes is 2**66: np.prod wraps it to 0, which 0..0 offsets "hold".
    (dict(dtype="F32", shape=[2**62, 4], data_offsets=[0, 0]),
     "has shape [4611686018427387904, 4] F32 (73,786,976,294,838,206,464 bytes) but offsets 0..0"),
    (dict(dtype="F32", shape=[4], data_offsets=[0, 64]), "(16 bytes) but offsets 0..64"),
    (dict(dtype="F32", shape=[64], data_offsets=[0, 256]),
     "but offsets 0..256, and the file holds 128 bytes of data (truncated?)"),
    (dict(dtype="F32", shape=[-4], data_offsets=[0, 0]), "shape: [non-negative ints]"),
    (dict(dtype="Q4", shape=[4], data_offsets=[0, 16]), "dtype: one of BOOL, U8"),
    (dict(dtype="F32", shape=[4], data_offsets=[0]), "data_offsets: [start, end]"),
    ([1, 2], "has header entry [1, 2]"),
])
def test_a_header_entry_its_offsets_do_not_hold_is_refused(tmp_path, entry, needle):
  file = write_safetensors(str(tmp_path / "x.safetensors"),
                           {"huge": entry, "ok": dict(dtype="F32", shape=[2], data_offsets=[0, 8])},
                           128)
  with pytest.raises(CheckpointError) as e:
    SafetensorsFile(file).view("huge")
  message = str(e.value)
  assert f"tensor 'huge' in {file}" in message and needle in message, message
  assert "download or convert it again" in message and "\n" not in message


def test_a_wrapping_shape_in_a_checkpoint_is_refused_before_loading(tmp_path):
  # Beside every tensor the model reads, one more whose shape wraps np.prod to 0.
  cfg = hf.hf_config("llama")
  path = hf.write_checkpoint(str(tmp_path / "ckpt"), cfg, hf.random_weights(cfg, seed=0))
  file = os.path.join(path, "model.safetensors")
  reader = SafetensorsFile(file)
  header = {name: dict(reader.header[name]) for name in reader.keys()}
  data = max(e["data_offsets"][1] for e in header.values())
  header["model.layers.9.mlp.up_proj.weight"] = dict(dtype="BF16", shape=[2**62, 4],
                                                     data_offsets=[data, data])
  with open(file, "rb") as f:
    f.seek(8 + int.from_bytes(f.read(8), "little"))
    blob = f.read()
  write_safetensors(file, header, 0)
  with open(file, "ab") as f:
    f.write(blob)
  with pytest.raises(CheckpointError, match=r"tensor 'model.layers.9.mlp.up_proj.weight' in .*"
                                            r"has shape \[4611686018427387904, 4\] BF16"):
    from_pretrained(path)


def test_a_config_claiming_a_million_layers_is_refused_at_its_first_missing_tensor(tmp_path):
  # Before, the abstract model of 10**6 layers was built first (no answer after 90 s). A
  # subprocess, so that a regression fails by its timeout instead of hanging the session.
  cfg = hf.hf_config("llama", num_hidden_layers=10**6)
  path = hf.write_checkpoint(str(tmp_path / "ckpt"), cfg,
                             hf.random_weights(hf.hf_config("llama"), seed=0))
  code = ("import sys; from jaxkv.models import CheckpointError, from_pretrained\n"
          "try:\n  from_pretrained(sys.argv[1])\n"
          "except CheckpointError as e:\n  print(e)\n")
  rc, out, err = helpers.run_script(["-c", code, path], timeout_s=300)
  assert rc == 0, err[-2000:]
  assert out.strip() == (
      f"tensor 'model.layers.2.input_layernorm.weight' is missing from {path!r}; a "
      "1000000-layer checkpoint of this architecture needs it (the checkpoint holds tensors "
      "of 2 layers): fix config.json or download the checkpoint again.")


# ---- JSON files: nesting, and values of the wrong kind -------------------------------------
DEEP = "[" * 100_000


@pytest.mark.parametrize("file,content,needle", [
    ("config.json", DEEP, "config.json nests JSON deeper than the parser follows"),
    ("config.json", "[1, 2]", "config.json holds a JSON list, not an object of settings"),
    ("config.json", "{", "config.json is not valid JSON"),
    ("model.safetensors.index.json", DEEP,
     "model.safetensors.index.json nests JSON deeper than the parser follows"),
    ("model.safetensors", DEEP,
     "has a safetensors header nesting JSON deeper than the parser follows"),
])
def test_a_checkpoint_json_file_nested_too_deep_or_not_an_object_is_refused(
    tmp_path, file, content, needle):
  cfg = hf.hf_config("llama")
  path = hf.write_checkpoint(str(tmp_path / "ckpt"), cfg, hf.random_weights(cfg, seed=0))
  if file == "model.safetensors":
    raw = content.encode()
    with open(os.path.join(path, file), "wb") as f:
      f.write(len(raw).to_bytes(8, "little") + raw)
  else:
    with open(os.path.join(path, file), "w") as f:
      f.write(content)
  with pytest.raises(CheckpointError) as e:
    from_pretrained(path)
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("file,content,needle", [
    ("tokenizer.json", DEEP, "tokenizer.json could not be read by the tokenizers library"),
    ("tokenizer.json", "[1]", "tokenizer.json could not be read by the tokenizers library"),
    ("tokenizer_config.json", DEEP, "tokenizer_config.json nests JSON deeper than"),
    ("tokenizer_config.json", "[1]", "tokenizer_config.json holds a JSON list, not an object"),
    ("generation_config.json", DEEP, "generation_config.json nests JSON deeper than"),
    ("config.json", '"text"', "config.json holds a JSON str, not an object"),
    ("generation_config.json", '{"eos_token_id": "two"}',
     "generation_config.json eos_token_id='two' must be a token id or a list of token ids"),
    ("config.json", '{"eos_token_id": [2, true]}',
     "config.json eos_token_id=[2, True] must be a token id or a list of token ids"),
])
def test_a_tokenizer_json_file_nested_too_deep_or_of_the_wrong_kind_is_refused(
    tmp_path, file, content, needle):
  path = str(tmp_path / "tok")
  hf.write_tokenizer(path)
  with open(os.path.join(path, file), "w") as f:
    f.write(content)
  with pytest.raises(TokenizerError) as e:
    jaxkv.Tokenizer.from_dir(path)
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- shard names --------------------------------------------------------------------------
def sharded_checkpoint(tmp_path) -> tuple[str, dict]:
  cfg = hf.hf_config("llama")
  weights = hf.random_weights(cfg, seed=0)
  return hf.write_checkpoint(str(tmp_path / "ckpt"), cfg, weights, shards=2), weights


def point_second_shard_at(path: str, target: str) -> str:
  """Rewrites the index so every tensor of the second shard is looked up in ``target``;
  returns the first such tensor's name."""
  index = os.path.join(path, "model.safetensors.index.json")
  with open(index) as f:
    data = json.load(f)
  second = "model-00002-of-00002.safetensors"
  moved = [name for name, file in data["weight_map"].items() if file == second]
  data["weight_map"].update({name: target for name in moved})
  with open(index, "w") as f:
    json.dump(data, f)
  return moved[0]


@pytest.mark.parametrize("kind,problem", [
    ("dotdot", "a path through '..'"),
    ("absolute", "an absolute path"),
    ("symlink", "it resolves to {outside!r}, outside the checkpoint directory"),
    ("symlinked_dir", "it resolves to {outside!r}, outside the checkpoint directory"),
])
def test_a_shard_outside_the_checkpoint_directory_is_refused(tmp_path, kind, problem):
  path, _ = sharded_checkpoint(tmp_path)
  outside = str(tmp_path / "outside.safetensors")
  shutil.move(os.path.join(path, "model-00002-of-00002.safetensors"), outside)
  if kind == "dotdot":
    target = "../outside.safetensors"
  elif kind == "absolute":
    target = outside
  elif kind == "symlink":  # a name inside the directory, a file outside it
    target = "linked.safetensors"
    os.symlink(outside, os.path.join(path, target))
  else:  # a directory inside that is the parent
    os.symlink("..", os.path.join(path, "up"))
    target = "up/outside.safetensors"
  tensor = point_second_shard_at(path, target)
  with pytest.raises(CheckpointError) as e:
    from_pretrained(path)
  message = str(e.value)
  problem = problem.format(outside=os.path.realpath(outside))
  assert f"lists {target!r} for tensor {tensor!r}: {problem}" in message
  assert "fix the weight_map" in message and "\n" not in message


def test_the_hub_cache_layout_loads(tmp_path):
  # huggingface_hub stores a snapshot's files as symlinks to ../../blobs/<hash>: a link out
  # of the directory that is not an escape.
  path, weights = sharded_checkpoint(tmp_path)
  repo = tmp_path / "hub" / "models--org--tiny"
  snapshot = repo / "snapshots" / "0123abcd"
  os.makedirs(repo / "blobs")
  os.makedirs(snapshot)
  for i, name in enumerate(sorted(os.listdir(path))):
    shutil.move(os.path.join(path, name), repo / "blobs" / f"blob{i}")
    os.symlink(f"../../blobs/blob{i}", snapshot / name)
  model = from_pretrained(str(snapshot))
  np.testing.assert_array_equal(np.asarray(model.embed.embedding.get_value()),
                                weights["model.embed_tokens.weight"])
