"""Deterministic request workloads for serving demos, tests and benchmarks.

A workload produces the prompts of each round and learns the answers, so later rounds
can build on them (a chat's history grows with every answer). Everything is a function
of the seed: two runs with the same seed and the same answers see the same prompts.
"""

from __future__ import annotations

import dataclasses

import numpy as np


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
        raise ValueError(f"ChatSpec.{name}={v!r} must be a positive integer.")
    if self.system_prompt_tokens < 0:
      raise ValueError(f"ChatSpec.system_prompt_tokens={self.system_prompt_tokens} must be >= 0.")
    lo, hi = self.user_tokens
    if not 1 <= lo <= hi:
      raise ValueError(f"ChatSpec.user_tokens={self.user_tokens} must satisfy 1 <= low <= high.")
    if self.vocab_size < 2:
      raise ValueError(f"ChatSpec.vocab_size={self.vocab_size} must be at least 2.")

  def max_seq_len(self) -> int:
    """An upper bound on prompt + answer tokens of the last turn."""
    return (self.system_prompt_tokens
            + self.turns * (self.user_tokens[1] + self.max_new_tokens))


class Chat:
  """Drives a ``ChatSpec``: ``prompts(turn)``, then ``record(turn, answers)``."""

  def __init__(self, spec: ChatSpec):
    self.spec = spec
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
      raise ValueError(f"turn {turn} requested, but turn {self._next_turn} is next.")
    return [h + self._message(u, turn) for u, h in enumerate(self.history)]

  def record(self, turn: int, answers: list[list[int]]) -> None:
    prompts = self.prompts(turn)
    if len(answers) != len(prompts):
      raise ValueError(f"{len(answers)} answers for {len(prompts)} prompts.")
    self.history = [p + list(a) for p, a in zip(prompts, answers)]
    self._next_turn += 1
