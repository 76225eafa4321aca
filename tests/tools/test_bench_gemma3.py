"""The gemma3 bench's own logic (``launch/bench.py --suite=gemma3``): the prompt every
system is given and how two greedy answers are compared. The suite itself is not run here:
even ``--quick`` takes minutes (transformers alone spends ~50 s dequantizing the file)."""

from jaxkv.tools.bench import gemma3

import helpers


def test_prompt_is_the_asked_count_of_tokens_one_bos_first():
  path = helpers.gemma3_gguf()
  long = gemma3.prompt_tokens(path, gemma3.PROMPT_TOKENS)
  short = gemma3.prompt_tokens(path, gemma3.QUICK_PROMPT_TOKENS)
  assert len(long) == gemma3.PROMPT_TOKENS and len(short) == gemma3.QUICK_PROMPT_TOKENS
  assert long[0] == 2 and 2 not in long[1:]  # Gemma's <bos>, once: the text is repeated
  assert short == long[:gemma3.QUICK_PROMPT_TOKENS]  # the same text, cut shorter


def test_agreement_counts_equal_positions_and_the_first_difference():
  same = gemma3.agreement([5, 6, 7, 8], [5, 6, 7, 8], 4)
  assert same == {"compared": 4, "equal": 4, "same": True, "first_difference": None}
  one_off = gemma3.agreement([5, 6, 7, 8], [5, 9, 7, 8], 4)
  assert one_off == {"compared": 4, "equal": 3, "same": False, "first_difference": 1}
  assert gemma3.agreement([5, 6, 7, 1], [5, 6, 7, 2], 3)["same"]  # only the first n count
  short = gemma3.agreement([5, 6], [5, 6, 7], 3)  # an answer that stopped early differs
  assert (short["equal"], short["same"], short["first_difference"]) == (2, False, 2)
