"""Errors by kind: what a caller gave is wrong, or jaxkv itself is wrong.

``InputError`` (a ``ValueError``) is raised where a value a user gave — a config field, a
flag, a request, a file or directory they point at — is checked and found unusable; its
message names the value and the fix. Launch scripts report it in one line with exit
status 2 (``launch/_common.run``).

``InvariantError`` (an ``AssertionError``) is raised where jaxkv's own bookkeeping finds
itself broken: a refcount released below zero, a block published into a slot nobody
holds, a shard or slot id that no pool has. No user value can cause one; it is a bug in
jaxkv (or in code driving its internals, such as ``PrefixIndex``, by hand). It is
deliberately not a ``ValueError``, so that no ``except ValueError`` meant for bad input
(or for a bad network answer) can swallow it or report it as bad input; launch scripts
let it propagate with its traceback and exit status 1. Unlike an ``assert`` statement it
is raised under ``python -O`` too.

Any other exception is also a bug in jaxkv (or its environment) and keeps its traceback.
"""


class InputError(ValueError):
  """A value given to jaxkv cannot be used; the message says which and what to do."""


class CapacityError(InputError):
  """A request needs more pages than the cache can ever give it: what the caller asked
  for does not fit this cache (an ``InputError``: launchers report it in one line)."""


class InvariantError(AssertionError):
  """jaxkv's internal state broke a rule it keeps; a bug, never bad input. The message
  names the state and the rule."""


def check_text(value, what: str, *, max_chars: int | None = None) -> str:
  """``value`` if it is a non-empty string of Unicode scalar values (what UTF-8 can encode),
  at most ``max_chars`` long; else ``InputError`` naming ``what``. JSON can carry a lone
  surrogate (``"\\ud800"``) that Python decodes into a ``str`` no encoder takes: such a
  string is refused where it enters, not where it is first encoded."""
  if not isinstance(value, str) or not value:
    raise InputError(f"{what}={value!r} must be a non-empty string.")
  if max_chars is not None and len(value) > max_chars:
    raise InputError(f"{what} has {len(value)} characters; at most {max_chars}.")
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise InputError(f"{what} holds {value[e.start]!r} at character {e.start}, a lone "
                     "surrogate (not a Unicode character); send valid UTF-8 text.") from None
  return value
