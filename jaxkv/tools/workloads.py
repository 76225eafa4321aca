"""Deterministic request workloads for serving demos, tests and benchmarks.

A workload produces the prompts of each round and learns the answers, so later rounds
can build on them (a chat's history grows with every answer). Everything is a function
of the seed: two runs with the same seed and the same answers see the same prompts.
Every workload has ``rounds``, ``max_new_tokens``, ``max_seq_len()``, ``prompts(round)``
and ``record(round, answers)``: multi-turn chat, RAG over shared documents in varying
order, an agent loop with a growing context, or a JSONL trace.

For online load (``jaxkv.tools.online``) a workload is also a set of ``users`` who each send
their rounds in order, one request at a time: ``user_request(user, round)`` gives the
prompt and its ``SamplingParams``, ``user_record(user, round, answer)`` learns the answer
(a chat user's next prompt builds on it). ``arrivals()`` gives fixed first-arrival times
(a trace that carries them) or None.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.config import SamplingParams
from jaxkv.errors import InputError


class Workload:
  """What every workload shares: per-request sampling and the per-user (online) view.

  Subclasses define ``prompts(round)``, ``record(round, answers)``, ``rounds``,
  ``max_new_tokens``, ``users``, and ``_user_prompt``/``_user_answer`` for the online
  view (the defaults suit workloads whose prompts do not build on answers)."""

  def sampling(self, turn: int):
    """What ``Engine.generate`` takes as its second argument for round ``turn``."""
    del turn
    return self.max_new_tokens

  @property
  def turns_per_user(self) -> int:
    """Requests each user sends online, one after another."""
    return self.rounds

  def user_request(self, user: int, turn: int) -> tuple[list[int], SamplingParams]:
    if not 0 <= user < self.users or not 0 <= turn < self.rounds:
      raise InputError(f"user {user}, round {turn}: this workload has {self.users} users "
                       f"and {self.rounds} rounds.")
    return self._user_prompt(user, turn), SamplingParams(max_new_tokens=self.max_new_tokens)

  def _user_prompt(self, user: int, turn: int) -> list[int]:
    return self.prompts(turn)[user]

  def user_record(self, user: int, turn: int, answer) -> None:
    del user, turn, answer

  def arrivals(self) -> list[float] | None:
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatSpec:
  """A multi-turn chat: every user's next prompt is its whole history plus a new message.

  ``system_prompt_tokens`` are shared by every user (a common system prompt);
  message lengths are drawn uniformly from ``user_tokens = (low, high)`` inclusive.
  """

  users: int = 8
  turns: int = 4
  system_prompt_tokens: int = 0
  user_tokens: tuple[int, int] = (16, 48)
  max_new_tokens: int = 16
  vocab_size: int = 256
  seed: int = 0

  def __post_init__(self):
    for name in ("users", "turns", "max_new_tokens", "vocab_size"):
      v = getattr(self, name)
      if not isinstance(v, int) or v <= 0:
        raise InputError(f"ChatSpec.{name}={v!r} must be a positive integer.")
    if self.system_prompt_tokens < 0:
      raise InputError(f"ChatSpec.system_prompt_tokens={self.system_prompt_tokens} must be >= 0.")
    lo, hi = self.user_tokens
    if not 1 <= lo <= hi:
      raise InputError(f"ChatSpec.user_tokens={self.user_tokens} must satisfy 1 <= low <= high.")
    if self.vocab_size < 2:
      raise InputError(f"ChatSpec.vocab_size={self.vocab_size} must be at least 2.")

  def max_seq_len(self) -> int:
    """An upper bound on prompt + answer tokens of the last turn."""
    return (self.system_prompt_tokens
            + self.turns * (self.user_tokens[1] + self.max_new_tokens))


class Chat(Workload):
  """Drives a ``ChatSpec``: ``prompts(turn)``, then ``record(turn, answers)``."""

  def __init__(self, spec: ChatSpec):
    self.spec = spec
    self.rounds = spec.turns
    self.users = spec.users
    self.max_new_tokens = spec.max_new_tokens
    system = self._tokens(-1, -1, spec.system_prompt_tokens)
    self.history = [list(system) for _ in range(spec.users)]
    self._next_turn = 0

  def _tokens(self, user: int, turn: int, n: int) -> list[int]:
    rng = np.random.default_rng([self.spec.seed, user + 1, turn + 1])
    return rng.integers(1, self.spec.vocab_size, size=n).tolist()

  def _message(self, user: int, turn: int) -> list[int]:
    lo, hi = self.spec.user_tokens
    n = int(np.random.default_rng([self.spec.seed, user + 1, turn + 1, 7]).integers(lo, hi + 1))
    return self._tokens(user, turn, n)

  def prompts(self, turn: int) -> list[list[int]]:
    if turn != self._next_turn:
      raise InputError(f"turn {turn} requested, but turn {self._next_turn} is next.")
    return [h + self._message(u, turn) for u, h in enumerate(self.history)]

  def max_seq_len(self) -> int:
    return self.spec.max_seq_len()

  def record(self, turn: int, answers: list[list[int]]) -> None:
    prompts = self.prompts(turn)
    if len(answers) != len(prompts):
      raise InputError(f"{len(answers)} answers for {len(prompts)} prompts.")
    self.history = [p + list(a) for p, a in zip(prompts, answers)]
    self._next_turn += 1

  def _user_prompt(self, user: int, turn: int) -> list[int]:
    return self.history[user] + self._message(user, turn)

  def user_record(self, user: int, turn: int, answer) -> None:
    self.history[user] = self._user_prompt(user, turn) + list(answer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RagSpec:
  """Retrieval-augmented requests: each prompt is a system prompt, ``docs_per_request``
  documents drawn from a shared pool of ``num_docs`` (in varying order), and a question.
  Only a prefix in the same order is shared, so reuse depends on how orders repeat."""

  requests: int = 8
  rounds: int = 4
  num_docs: int = 6
  doc_tokens: int = 128
  docs_per_request: int = 2
  system_prompt_tokens: int = 64
  question_tokens: tuple[int, int] = (8, 24)
  max_new_tokens: int = 16
  vocab_size: int = 256
  seed: int = 0

  def max_seq_len(self) -> int:
    return (self.system_prompt_tokens + self.docs_per_request * self.doc_tokens
            + self.question_tokens[1] + self.max_new_tokens)


class Rag(Workload):
  """Drives a ``RagSpec``."""

  def __init__(self, spec: RagSpec):
    if spec.docs_per_request > spec.num_docs:
      raise InputError(f"RagSpec.docs_per_request={spec.docs_per_request} exceeds num_docs="
                       f"{spec.num_docs}.")
    self.spec = spec
    rng = np.random.default_rng([spec.seed, 1])
    self.system = rng.integers(1, spec.vocab_size, spec.system_prompt_tokens).tolist()
    self.docs = [rng.integers(1, spec.vocab_size, spec.doc_tokens).tolist()
                 for _ in range(spec.num_docs)]
    self.rounds = spec.rounds
    self.users = spec.requests
    self.max_new_tokens = spec.max_new_tokens

  def max_seq_len(self) -> int:
    return self.spec.max_seq_len()

  def prompts(self, turn: int) -> list[list[int]]:
    s = self.spec
    out = []
    for r in range(s.requests):
      rng = np.random.default_rng([s.seed, 2, turn, r])
      picks = rng.choice(s.num_docs, s.docs_per_request, replace=False)
      q = rng.integers(1, s.vocab_size, int(rng.integers(s.question_tokens[0],
                                                         s.question_tokens[1] + 1))).tolist()
      out.append(self.system + [t for d in picks for t in self.docs[d]] + q)
    return out

  def record(self, turn: int, answers) -> None:
    del turn, answers  # requests do not build on answers


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentSpec:
  """An agent loop: ``agents`` contexts that grow every step by a tool result and the
  agent's own answer; every step's prompt is the whole context so far."""

  agents: int = 4
  steps: int = 6
  system_prompt_tokens: int = 128
  tool_tokens: tuple[int, int] = (32, 96)
  max_new_tokens: int = 16
  vocab_size: int = 256
  seed: int = 0

  def max_seq_len(self) -> int:
    return (self.system_prompt_tokens
            + self.steps * (self.tool_tokens[1] + self.max_new_tokens))


class Agent(Workload):
  """Drives an ``AgentSpec``."""

  def __init__(self, spec: AgentSpec):
    self.spec = spec
    rng = np.random.default_rng([spec.seed, 3])
    system = rng.integers(1, spec.vocab_size, spec.system_prompt_tokens).tolist()
    self.context = [list(system) for _ in range(spec.agents)]
    self.rounds = spec.steps
    self.users = spec.agents
    self.max_new_tokens = spec.max_new_tokens

  def max_seq_len(self) -> int:
    return self.spec.max_seq_len()

  def _tool(self, agent: int, step: int) -> list[int]:
    rng = np.random.default_rng([self.spec.seed, 4, agent, step])
    lo, hi = self.spec.tool_tokens
    return rng.integers(1, self.spec.vocab_size, int(rng.integers(lo, hi + 1))).tolist()

  def prompts(self, step: int) -> list[list[int]]:
    return [c + self._tool(a, step) for a, c in enumerate(self.context)]

  def record(self, step: int, answers) -> None:
    self.context = [p + list(a) for p, a in zip(self.prompts(step), answers)]

  def _user_prompt(self, user: int, turn: int) -> list[int]:
    return self.context[user] + self._tool(user, turn)

  def user_record(self, user: int, turn: int, answer) -> None:
    self.context[user] = self._user_prompt(user, turn) + list(answer)


class Trace(Workload):
  """Requests from a JSONL file, one object per line: ``{"prompt": [1, 2, 3]}`` with
  optional ``"round"`` (default 0; rounds run in order), ``"max_new_tokens"`` (default 16),
  ``"stop_token_ids"`` (ids that end the answer) and ``"arrival_s"`` (seconds from the
  start: online runs submit the request then; give it on every line or on none).
  Online, each line is one user with one request.

  With a ``tokenizer`` (``jaxkv.Tokenizer``), a line may give text instead:
  ``"prompt": "some text"`` (encoded with the tokenizer's special tokens) or
  ``"messages": [{"role": ..., "content": ...}]`` (through its chat template); such a line
  stops at the tokenizer's end-of-sequence ids unless it names ``stop_token_ids``."""

  _FORMAT = ('each line needs {"prompt": [token ids]} (or, with a tokenizer, "prompt": '
             '"text" or "messages": [...]) and may have "round": int, "max_new_tokens": int, '
             '"stop_token_ids": [ids], "arrival_s": seconds')

  def __init__(self, path: str, vocab_size: int, tokenizer=None):
    import json
    import math
    import os
    if not os.path.isfile(path):
      raise InputError(f"trace file {path!r} does not exist; give a JSONL file of requests.")
    self._requests = []  # (round, prompt, SamplingParams, arrival or None), file order
    with open(path) as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          obj = json.loads(line)
          prompt, stops = self._prompt(obj, tokenizer)
          sp = SamplingParams(max_new_tokens=int(obj.get("max_new_tokens", 16)),
                              stop_token_ids=tuple(int(t) for t in obj.get("stop_token_ids",
                                                                           stops)))
          arrival = obj.get("arrival_s")
          if arrival is not None:
            arrival = float(arrival)
            if not math.isfinite(arrival) or arrival < 0:
              raise InputError(f"arrival_s={arrival} must be a finite number >= 0")
          self._requests.append((int(obj.get("round", 0)), prompt, sp, arrival))
        except (ValueError, KeyError, TypeError) as e:
          raise InputError(f"trace file {path!r} line {n} is not a request ({e}); "
                           f"{self._FORMAT}.") from None
        if any(not 0 <= t < vocab_size for t in prompt + list(sp.stop_token_ids)):
          raise InputError(f"trace file {path!r} line {n} has token ids outside [0, "
                           f"{vocab_size}).")
    if not self._requests:
      raise InputError(f"trace file {path!r} holds no requests.")
    timed = sum(r[3] is not None for r in self._requests)
    if timed not in (0, len(self._requests)):
      raise InputError(f"trace file {path!r} gives arrival_s on {timed} of "
                       f"{len(self._requests)} lines; give it on every line or on none.")
    by_round: dict = {}
    for r in self._requests:
      by_round.setdefault(r[0], []).append(r)
    self._rounds = [by_round[r] for r in sorted(by_round)]
    self.rounds = len(self._rounds)
    self.users = len(self._requests)
    self.max_new_tokens = max(r[2].max_new_tokens for r in self._requests)

  @staticmethod
  def _prompt(obj: dict, tokenizer) -> tuple[list[int], tuple]:
    """A line's prompt ids and its default stop ids."""
    text = obj.get("prompt") if isinstance(obj.get("prompt"), str) else None
    if text is None and "messages" not in obj:
      return [int(t) for t in obj["prompt"]], ()
    if tokenizer is None:
      raise InputError("a text prompt needs a tokenizer (serve a --model_dir that has "
                       "tokenizer.json)")
    ids = (tokenizer.encode(text) if text is not None
           else tokenizer.encode_chat(obj["messages"]))
    return ids, tokenizer.eos_token_ids

  @property
  def turns_per_user(self) -> int:
    return 1

  def prompts(self, turn: int) -> list[list[int]]:
    return [r[1] for r in self._rounds[turn]]

  def sampling(self, turn: int) -> list[SamplingParams]:
    return [r[2] for r in self._rounds[turn]]

  def record(self, turn: int, answers) -> None:
    del turn, answers

  def user_request(self, user: int, turn: int) -> tuple[list[int], SamplingParams]:
    if not 0 <= user < self.users or turn != 0:
      raise InputError(f"user {user}, round {turn}: this trace has {self.users} requests, "
                       "one round each online.")
    return self._requests[user][1], self._requests[user][2]

  def arrivals(self) -> list[float] | None:
    if self._requests[0][3] is None:
      return None
    return [r[3] for r in self._requests]

  def max_seq_len(self) -> int:
    return max(len(r[1]) + r[2].max_new_tokens for r in self._requests)


def from_config(w, vocab_size: int, seed: int, tokenizer=None):
  """A workload from a config's ``workload`` section: ``kind`` picks the type and the
  sub-section of that name holds its fields (``workload.chat.users``, ...). A
  ``tokenizer`` lets a trace give text prompts."""
  w = dict(w.to_dict() if hasattr(w, "to_dict") else w)
  kind = w.get("kind", "chat")
  kinds = {"chat": (ChatSpec, Chat), "rag": (RagSpec, Rag), "agent": (AgentSpec, Agent)}
  if kind not in kinds and kind != "trace":
    raise InputError(f"workload kind={kind!r} is not one of {sorted(kinds) + ['trace']}.")
  w = dict(w.get(kind) or {})
  if kind == "trace":
    return Trace(w.get("path", ""), vocab_size, tokenizer)
  spec_cls, run_cls = kinds[kind]
  fields = {f.name for f in dataclasses.fields(spec_cls)}
  unknown = sorted(set(w) - fields)
  if unknown:
    raise InputError(f"workload {kind} has no fields {unknown}; it takes {sorted(fields)}.")
  for k, v in w.items():
    if isinstance(v, list):
      w[k] = tuple(v)
  spec = spec_cls(**{**w, "vocab_size": vocab_size, "seed": seed})
  return run_cls(spec)
