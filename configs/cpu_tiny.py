"""The embedded default: CPU, a tiny random-weight Llama, 8 virtual devices (4 data x 2 model).

Small enough that `python launch/serve.py` finishes in about a minute on 2 cores, large
enough that a multi-turn chat overflows nothing and shows what prefix reuse saves. Every
value is `configs/default.py`'s.
"""

import os
import runpy

import ml_collections

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")


def get_config() -> ml_collections.ConfigDict:
  c = runpy.run_path(_DEFAULT)["get_config"]()
  c.name = "cpu_tiny"
  return c
