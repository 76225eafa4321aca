"""The one error type for bad input.

``InputError`` is raised where a value a user gave — a config field, a flag, a request, a
file or directory they point at — is checked and found unusable; its message names the
value and the fix. Launch scripts report it in one line with exit status 2. Any other
exception is a bug in jaxkv (or its environment) and keeps its traceback.
"""


class InputError(ValueError):
  """A value given to jaxkv cannot be used; the message says which and what to do."""
