"""A chat template rendered in a bounded sandbox: jinja2's immutable sandbox with every
value a render builds checked against that render's budget.

A chat template is code that came with the checkpoint and runs on every request's
messages, so each render is bounded (``TemplateLimits``): no string, list or integer it
builds may pass a size, nor all it builds together a total, nor the render a time budget.
Sizes are checked before a string is built where the size is known in advance (``*``,
``+``, ``~``, ``%``, ``str.format``, padding, escaping, case and ``replace``-like methods
and filters), and the result of every operator, call and filter is checked after; the
prompt is streamed and counted chunk by chunk, and every loop step checks the clock.
Every value a template turns into text (``{{ v }}``, ``|string``, ``~``, ``%``, ``join``,
``tojson``) is sized from its structure first, counting stopped past the limit: strings
with the escapes ``repr`` and JSON give them inside a container, containers, dict views
(``d.values()`` prints every value) and namespaces item by item; a value whose text may be
long and is none of these (an object with its own ``repr``) is refused rather than built.
A render past a bound, or a template that fails on the messages, raises
``ChatTemplateError`` (an ``InputError``: a server answers 400; ``Tokenizer`` raises it as
its ``TokenizerError``).

    template = compile_template(source)
    text = render_bounded(template, messages, TemplateLimits(), "the chat template of ...",
                          add_generation_prompt=True, bos_token="<s>", eos_token="</s>")

The sandbox relies on jinja2's compiler internals as they are within ``jinja2>=3.1,<3.2``,
the range pyproject.toml pins: ``_BoundedCodeGenerator`` overrides ``CodeGenerator``'s
code generation, ``_BoundedEnvironment`` the sandbox's ``call_binop``, ``call``,
``wrap_str_format`` and ``concat``. A newer jinja2 is to be checked against
``tests/entrypoints/test_chat_template.py`` before the pin moves.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import itertools
import json
import math
import re
import string
import time
import types
from collections.abc import ItemsView, KeysView, Mapping, ValuesView

import jinja2
import jinja2.runtime
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from jaxkv.errors import InputError


class ChatTemplateError(InputError):
  """A render refused by its bounds, or a template failing on the messages (the message
  names the template, the bound or the failure, and the fix)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TemplateLimits:
  """What one chat-template render may build and spend.

  Each bound grows with the request, so a long prompt renders while a short request cannot
  make the template blow up: a render of messages holding ``n`` characters may build
  strings of ``max_chars + 4 n`` characters (the prompt included), lists, tuples and dicts
  of ``max_items + n`` items, ``max_total_chars + 16 n`` characters and items in all (every
  string and list any operator, call or filter returns, summed: what bounds memory, since
  each one may be kept), and may run ``max_render_s + n`` microseconds. Real templates build
  a few times the messages' size and render in milliseconds.
  """

  max_chars: int = 2**20
  max_items: int = 100_000  # jinja's own cap on range()
  max_total_chars: int = 2**24
  max_render_s: float = 1.0

  def __post_init__(self):
    for name in ("max_chars", "max_items", "max_total_chars"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"TemplateLimits.{name}={value!r} must be a positive integer; "
                         f"pass e.g. {name}={getattr(TemplateLimits, name)}.")
    if (not isinstance(self.max_render_s, (int, float)) or isinstance(self.max_render_s, bool)
        or not 0 < self.max_render_s < math.inf):
      raise InputError(f"TemplateLimits.max_render_s={self.max_render_s!r} must be a positive "
                       "number of seconds; pass e.g. max_render_s=1.0.")

def render_bounded(template, messages: list, limits: TemplateLimits, where: str,
                   **variables) -> str:
  """The text ``template`` (from ``compile_template``) makes of ``messages`` and
  ``variables``, rendered within ``limits`` grown by the messages' size; ``where`` names
  the template in every refusal."""
  render = _Render(limits, _input_size(messages), where)
  token = _RENDER.set(render)
  stream = template.generate(messages=messages, **variables)
  try:
    chunks, size = [], 0
    for chunk in stream:
      size += len(chunk)
      render.check(size, "characters", "would write a prompt of")
      render.tick()
      chunks.append(chunk)
    return "".join(chunks)
  except ChatTemplateError:
    raise
  # What the template's own expressions raise on these messages (a missing key, a str
  # added to an int, range() past jinja's cap, recursion without end) is the request's
  # or the template's doing, not jaxkv's.
  except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError,
          RecursionError, MemoryError) as e:
    raise ChatTemplateError(f"{where} failed on these messages: {type(e).__name__}: "
                            f"{error_line(e)}") from None
  finally:
    stream.close()  # a refused render stops here, within its budget, not when collected
    _RENDER.reset(token)


# ---- bounded rendering --------------------------------------------------------------------
# One render's budget lives in a context variable: compiled templates are shared by every
# request (and thread), a budget belongs to one render. Outside a render (jinja folding
# constant expressions at compile time) the checks find none and refuse, and jinja then
# leaves the expression to run time, where it is checked.
_MAX_INT_BITS = 2**16  # str() of an int refuses past 4300 digits (~14k bits) anyway
_LEAF_CHARS = 24  # a number, None or a boolean as text, or an object's short repr
_LIMIT_NAMES = {"characters": "TemplateLimits.max_chars", "items": "TemplateLimits.max_items",
                "bits": "the bound on integers"}
_RENDER: contextvars.ContextVar[_Render] = contextvars.ContextVar("jaxkv_chat_render")


def error_line(e: BaseException) -> str:
  """An error as one line for a refusal: its message's first line, or its type's name when
  it has none (a template error's message may span lines and quote the template)."""
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


class _Render:
  """One render's bounds (``TemplateLimits`` grown by the request's ``input_chars``), what
  it has built so far and its deadline."""

  def __init__(self, limits: TemplateLimits, input_chars: int, where: str):
    self.limits = {"characters": limits.max_chars + 4 * input_chars,
                   "items": limits.max_items + input_chars, "bits": _MAX_INT_BITS}
    self.max_total = limits.max_total_chars + 16 * input_chars
    self.max_s = limits.max_render_s + 1e-6 * input_chars
    self.deadline = time.monotonic() + self.max_s
    self.total = 0
    self.where = where

  @property
  def max_chars(self) -> int:
    return self.limits["characters"]

  def check(self, size: int, unit: str, what: str) -> None:
    """Refuses a value of ``size`` ``unit`` (before or after it is built)."""
    if size > self.limits[unit]:
      raise ChatTemplateError(
          f"{self.where} {what} {size:,} {unit}, over the limit of {self.limits[unit]:,} "
          f"for these messages ({_LIMIT_NAMES[unit]}); shorten the messages or fix the template.")
    if unit != "bits" and self.total + size > self.max_total:
      raise ChatTemplateError(
          f"{self.where} {what} {size:,} {unit} after building {self.total:,} characters "
          f"and items, over the limit of {self.max_total:,} in all for these messages "
          "(TemplateLimits.max_total_chars); shorten the messages or fix the template.")

  def tick(self) -> None:
    if time.monotonic() > self.deadline:
      raise ChatTemplateError(
          f"{self.where} ran past its time budget of {self.max_s:.3g} s for these messages "
          "(TemplateLimits.max_render_s); shorten the messages or fix the template.")

  def count(self, size: int, unit: str) -> None:
    """Adds a checked value to the total (an integer's bits are bounded, not summed)."""
    if unit != "bits":
      self.total += size
    self.tick()

  def built(self, value, what: str = "built"):
    """``value``, once it is known to be within the bounds, counted in the total."""
    measured = _measure(value)
    if measured is not None:
      self.check(*measured, f"{what} a value of")
      self.count(*measured)
    else:
      self.tick()
    return value


def _render() -> _Render:
  return _RENDER.get()  # LookupError outside a render: see above


def _measure(value) -> tuple[int, str] | None:
  if isinstance(value, (str, bytes)):
    return len(value), "characters"
  if isinstance(value, (list, tuple, dict, set, frozenset)):
    return len(value), "items"
  if isinstance(value, int) and not isinstance(value, bool):
    return value.bit_length(), "bits"
  return None


def _input_size(value) -> int:
  """About ``len(str(value))`` of the messages a render is given (what its bounds grow
  with): a string's length, 4 per item of a container, 24 per other value."""
  size, stack = 0, [value]
  while stack:
    v = stack.pop()
    if isinstance(v, (str, bytes)):
      size += len(v) + 4
    elif isinstance(v, Mapping):
      size += 2 + 4 * len(v)
      for key, item in v.items():
        stack += (key, item)
    elif isinstance(v, (list, tuple)):
      size += 2 + 2 * len(v)
      stack.extend(v)
    else:
      size += _LEAF_CHARS
  return size


# What a printed value's text may hold, sized from its structure before ``str`` builds it.
# ``str`` of a container writes ``repr`` of each item, so a string inside one is quoted and
# escaped; dict views (``d.values()``) print every item like the container they show.
_VIEWS = (KeysView, ValuesView, ItemsView)
_PLAIN_CONTAINERS = (dict, list, tuple, set, frozenset)
# Types whose text is short whatever they hold: their repr names a type or a function
# (plus a number or an address), never their contents.
_SHORT_TEXT = (float, complex, type, range, types.FunctionType, types.BuiltinFunctionType,
               types.MethodWrapperType, types.GeneratorType, jinja2.runtime.Macro,
               jinja2.runtime.LoopContext, datetime.date, datetime.time, datetime.timedelta)
_SHORT_TEXT_CHARS = 256  # an upper bound on those reprs (a qualified name and an address)
_TAB_NEWLINE_RETURN = str.maketrans("", "", "\t\n\r")


def _quoted_size(s: str, cap: float) -> int:
  """At least ``len(repr(s))`` and ``len(json.dumps(s, ensure_ascii=False))``: the text of
  a string inside a printed container, or of ``tojson``. A printable character is one
  character (two for a quote or backslash), tab, newline and return two, any other escape
  at most ten (``\\U0001f600``); counted in chunks, stopping past ``cap``."""
  size = 2 + s.count("\\") + s.count("'") + s.count('"')
  if s.isprintable():  # nearly every string: no escapes but quotes and backslashes
    return size + len(s)
  for i in range(0, len(s), 4096):
    chunk = s[i:i + 4096]
    rest = chunk.translate(_TAB_NEWLINE_RETURN)
    size += 2 * len(chunk) - len(rest)
    if not rest.isprintable():
      size += 9 * sum(not c.isprintable() for c in rest)
    if size > cap:
      break
  return size


def _unsized(value):
  raise ChatTemplateError(
      f"{_render().where} would print a value of type {type(value).__name__}, whose text "
      "jaxkv cannot size before it is built (TemplateLimits); print its items or fields "
      "instead: shorten the messages or fix the template.")


def _text_size(value, cap: float = math.inf, *, quoted: bool = False, indent: int = 0) -> int:
  """At least ``len(str(value))`` (``quoted``: as an item of a container, a string's repr),
  without building it, and at least the ``json.dumps`` of it with ``indent``. Counting
  stops past ``cap``, so a list of 100k references to one long string, or a view of such a
  dict, is measured in about ``cap`` steps (and items). A value of a type whose text may
  be long but is not one of these is refused (``_unsized``)."""
  size, stack = 0, [(value, quoted, 0)]  # (value, printed as an item, nesting depth)
  while stack and size <= cap:
    v, item, depth = stack.pop()
    size += indent * depth + (1 if indent else 0)  # json.dumps(indent=...) writes a line each
    if isinstance(v, str):
      size += _quoted_size(v, cap - size) if item else len(v)
    elif isinstance(v, bytes):
      size += 4 * len(v) + 3  # repr: b'...', \xNN for most bytes
    elif isinstance(v, bool) or v is None:
      size += 5
    elif isinstance(v, int):
      size += v.bit_length() // 3 + 2
    elif isinstance(v, (Mapping, Namespace, _VIEWS, list, tuple, set, frozenset)):
      if isinstance(v, Namespace):  # its repr prints the dict it hides
        v = getattr(v, "_Namespace__attrs", {})  # the one name Namespace lets through
        size += 12
      elif not isinstance(v, _PLAIN_CONTAINERS):  # a view, or a subclass: named in its repr
        size += len(type(v).__name__) + 4
      pairs = isinstance(v, Mapping)
      size += 2 + (4 if pairs else 2) * len(v)
      room = max(int(min(cap - size, len(v))) + 1, 0)  # each item adds at least 1 character
      for entry in itertools.islice(v.items() if pairs else v, room):
        stack += ((entry[0], True, depth + 1), (entry[1], True, depth + 1)) if pairs else (
            (entry, True, depth + 1),)
    elif isinstance(v, types.MethodType):  # <bound method X.f of {repr of its object}>
      size += _SHORT_TEXT_CHARS
      stack.append((v.__self__, True, depth))
    elif isinstance(v, _SHORT_TEXT) or isinstance(v, jinja2.Undefined) or (
        type(v).__repr__ is object.__repr__ and type(v).__str__ is object.__str__):
      size += _SHORT_TEXT_CHARS
    else:
      _unsized(v)
  return size


def _as_text(render: _Render, value, what: str) -> str:
  """``str(value)``, measured before it is built."""
  if not isinstance(value, str):
    render.check(_text_size(value, render.max_chars), "characters",
                 f"would make text ({what}) of at least")
  return str(value)


def _int(value) -> int:
  return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _arg(args: tuple, kwargs: dict, i: int, name: str, default):
  return args[i] if len(args) > i else kwargs.get(name, default)


def _largest_text(values, cap: int) -> int:
  return max((_text_size(v, cap) for v in values), default=0)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")


def _percent_size(fmt: str, args, render: _Render) -> int:
  """Characters of ``fmt % args`` at most: each spec writes an argument padded to its
  width (``*`` widths taken from the arguments)."""
  values = (list(args.values()) if isinstance(args, Mapping)
            else list(args) if isinstance(args, tuple) else [args])
  size, largest = len(fmt), _largest_text(values, render.max_chars)
  widest = max((_int(v) for v in values), default=0)
  for spec in _PERCENT_SPEC.finditer(fmt):
    size += largest
    for part in spec.groups():
      size += widest if part == "*" else int(part or 0)
  return size


def _format_size(fmt: str, args: tuple, kwargs: Mapping, render: _Render) -> int:
  """Characters of ``fmt.format(*args, **kwargs)`` at most: each field writes an argument
  padded to the widths its spec names (a nested ``{}`` width is taken from the arguments)."""
  values = list(args) + list(kwargs.values())
  largest = _largest_text(values, render.max_chars)
  widest = max((_int(v) for v in values), default=0)
  size = len(fmt)
  for _, field, spec, _ in string.Formatter().parse(fmt):
    if field is not None:
      size += largest + sum(int(d) for d in re.findall(r"\d+", spec or ""))
      size += widest * (spec or "").count("{")
  return size


def _replace_size(s, old, new, count) -> int:
  if not isinstance(old, type(s)) or not isinstance(new, type(s)):
    return len(s)
  hits = s.count(old) if old else len(s) + 1
  if isinstance(count, int) and count >= 0:
    hits = min(hits, count)
  return len(s) + hits * max(len(new) - len(old), 0)


def _method_size(owner, name: str, args: tuple, kwargs: dict) -> int | None:
  """Characters a ``str`` (or ``bytes``) method called from the template would build,
  where it can grow a string past its inputs; None for the methods that cannot."""
  if name in ("ljust", "rjust", "center", "zfill"):
    return max(len(owner), _int(_arg(args, kwargs, 0, "width", 0)))
  if name == "expandtabs":
    tab = "\t" if isinstance(owner, str) else b"\t"
    return len(owner) + owner.count(tab) * _int(_arg(args, kwargs, 0, "tabsize", 8))
  if name == "replace":
    return _replace_size(owner, _arg(args, kwargs, 0, "old", None),
                         _arg(args, kwargs, 1, "new", None), _arg(args, kwargs, 2, "count", -1))
  if name == "join" and args and isinstance(args[0], (list, tuple)):
    parts = args[0]
    return (sum(len(p) for p in parts if isinstance(p, (str, bytes)))
            + len(owner) * max(len(parts) - 1, 0))
  if name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold"):
    return 3 * len(owner)  # one character to at most three ("\u0390".upper())
  if name == "encode":  # four bytes a character in UTF-8; an escaping codec up to ten
    encoding = _arg(args, kwargs, 0, "encoding", "utf-8")
    utf8 = isinstance(encoding, str) and encoding.lower().replace("-", "") in ("utf8", "ascii")
    return (4 if utf8 else 10) * len(owner)
  if name == "hex":
    return 3 * len(owner)  # two digits a byte, and a separator
  if name == "translate" and args and isinstance(args[0], Mapping):
    longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
    return len(owner) * max(longest, 1)
  return None


def _binop_size(operator: str, left, right) -> tuple[int, str] | None:
  """What ``left <operator> right`` would build, when it can grow past its operands."""
  if operator == "+" and type(left) is str and type(right) is str:  # most of any template
    return len(left) + len(right), "characters"
  sized = (str, bytes, list, tuple)
  if operator == "*":
    if isinstance(right, sized):
      left, right = right, left
    if isinstance(left, sized) and isinstance(right, int):
      return len(left) * max(right, 0), _measure(left)[1]
    if isinstance(left, int) and isinstance(right, int):
      return left.bit_length() + right.bit_length(), "bits"
  elif operator == "+":
    if isinstance(left, sized) and isinstance(right, sized):
      return len(left) + len(right), _measure(left)[1]
  elif operator == "**":
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
      return left.bit_length() * right, "bits"
  return None


# ---- filters: what each may build, checked before it runs --------------------------------
# Filters that make a string of their value: a list or dict value is measured as text first.
_TEXT_FILTERS = frozenset((
    "capitalize", "center", "e", "escape", "forceescape", "format", "indent", "join",
    "lower", "replace", "safe", "string", "striptags", "title", "tojson", "trim",
    "truncate", "upper", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"))


def _check_center(render, value, width=80):
  render.check(_int(width), "characters", "would pad a string to")
  return value


def _check_indent(render, value, width=4, first=False, blank=False):
  width = len(width) if isinstance(width, str) else _int(width)
  text = _as_text(render, value, "filter indent")
  render.check(len(text) + width * (text.count("\n") + 1), "characters", "would indent to")
  return value


def _check_format(render, value, *args, **kwargs):
  fmt = _as_text(render, value, "filter format")  # what the filter formats: str(value)
  render.check(_percent_size(fmt, kwargs or args, render), "characters",
               "would format a string of")
  return value


def _check_replace(render, value, old, new, count=None):
  text = _as_text(render, value, "filter replace")  # what the filter replaces in
  old, new = _as_text(render, old, "filter replace"), _as_text(render, new, "filter replace")
  render.check(_replace_size(text, old, new, count), "characters",
               "would replace into a string of")
  return value


def _check_join(render, value, d="", attribute=None):
  items = list(value)
  d = _as_text(render, d, "filter join")
  size = len(d) * len(items)
  for item in items:  # each joined as str(item); counting stops past the limit
    if size > render.max_chars:
      break
    size += _text_size(item, render.max_chars - size)
  render.check(size, "characters", "would join a string of")
  return items


def _check_wordwrap(render, value, width=79, break_long_words=True, wrapstring=None,
                    break_on_hyphens=True):
  text = _as_text(render, value, "filter wordwrap")
  breaks = len(wrapstring) if isinstance(wrapstring, str) else 1
  render.check(len(text) + (len(text) // max(_int(width), 1) + 1) * breaks, "characters",
               "would wrap into a string of")
  return value


def _check_sum(render, value, attribute=None, start=0):
  items = list(value)
  if attribute is None and isinstance(start, (str, list, tuple)):
    render.check(len(start) + sum(len(i) for i in items if isinstance(i, (str, list, tuple))),
                 "items", "would sum into a list of")
  return items


def _check_batch(render, value, linecount, fill_with=None):
  render.check(_int(linecount), "items", "would fill batches of")
  return value


def _check_slice(render, value, slices, fill_with=None):
  render.check(_int(slices), "items", "would cut slices:")
  return value


_FILTER_CHECKS = {"center": _check_center, "indent": _check_indent, "format": _check_format,
                  "replace": _check_replace, "join": _check_join, "wordwrap": _check_wordwrap,
                  "sum": _check_sum, "batch": _check_batch, "slice": _check_slice}


def _escaped_size(text: str) -> int:
  return (len(text) + 4 * (text.count("&") + text.count('"') + text.count("'"))
          + 3 * (text.count("<") + text.count(">")))  # &amp; &#34; &#39; &lt; &gt;


def _spaces(text: str) -> int:
  return sum(map(text.count, " \t\n\r\f\v"))


# Filters whose text can be longer than the text of their value: its size at most, from
# the value's text (checked before the filter runs).
_FILTER_GROWTH = {
    "e": _escaped_size, "escape": _escaped_size, "forceescape": _escaped_size,
    "urlencode": lambda text: 3 * len(text.encode("utf-8", "surrogatepass")),  # %XX a byte
    # Case mappings: one character to at most three ("\u0390".upper()).
    "upper": lambda text: 3 * len(text), "lower": lambda text: 3 * len(text),
    "title": lambda text: 3 * len(text), "capitalize": lambda text: 3 * len(text),
    # Each word may become <a href="https://word" rel="noopener">word</a>.
    "urlize": lambda text: 3 * len(text) + 64 * (_spaces(text) + 1),
}


def _bounded_filter(name: str, func):
  check, text = _FILTER_CHECKS.get(name), name in _TEXT_FILTERS
  growth = _FILTER_GROWTH.get(name)
  first = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # env or context

  @functools.wraps(func)  # keeps jinja_pass_arg: jinja passes the same first argument
  def bounded(*args, **kwargs):
    render = _render()
    render.tick()
    if len(args) > first:
      value, rest = args[first], args[first + 1:]
      if text and not isinstance(value, str):
        size = _text_size(value, render.max_chars)
        render.check(size, "characters", f"would make text (filter {name}) of at least")
      if growth is not None:
        render.check(growth(value if isinstance(value, str) else str(value)), "characters",
                     f"would make text (filter {name}) of up to")
      if check is not None:
        args = args[:first] + (check(render, value, *rest, **kwargs),) + rest
    return render.built(func(*args, **kwargs), f"built (filter {name})")
  return bounded


def _tojson(value, indent=None):
  """``json.dumps`` as Hugging Face renders ``tojson``; an indent is repeated once per
  nesting level on every line, so it is kept small."""
  width = len(indent) if isinstance(indent, str) else _int(indent)
  render = _render()
  if not 0 <= width <= 16:
    raise ChatTemplateError(f"{render.where} indents JSON by {width:,} characters (tojson); "
                         "jaxkv allows 0..16: fix the template.")
  render.check(_text_size(value, render.max_chars, quoted=True,
                          indent=width if indent is not None else 0),
               "characters", "would make JSON (filter tojson) of at least")
  return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message):
  raise ChatTemplateError(f"{_render().where} refused the messages: {message}")


class _Steps:
  """A loop's iterable, checking the clock at each step (and keeping ``len`` for
  ``loop.length``/``loop.last``)."""

  def __init__(self, items):
    self.items = items

  def __len__(self):
    return len(self.items)  # a TypeError here tells jinja to count the steps itself

  def __iter__(self):
    render = _render()
    for item in self.items:
      render.tick()
      yield item


_STEPS_FILTER = "jaxkv_loop_steps"


class _BoundedCodeGenerator(CodeGenerator):
  """Compiles every ``for`` to iterate through ``_Steps`` and every ``~`` to a checked
  join (jinja offers no hook for either: ``intercepted_binops`` covers ``*``, ``+``, ``%``,
  ``**`` only). It overrides code generation, which jinja2 does not promise to keep:
  pyproject.toml pins ``jinja2<3.2``, and ``test_chat_template`` renders real templates and
  hostile ones through it."""

  def visit_Template(self, node, frame=None):
    for loop in list(node.find_all(nodes.For)):
      loop.iter = nodes.Filter(loop.iter, _STEPS_FILTER, [], [], None, None,
                               lineno=loop.iter.lineno).set_environment(self.environment)
    super().visit_Template(node, frame)

  def visit_Concat(self, node, frame):
    self.write("environment.join_text((")
    for part in node.nodes:
      self.visit(part, frame)
      self.write(", ")
    self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
  """jinja's immutable sandbox (no attribute starting with ``_``, no mutation of lists and
  dicts, ``range`` of at most 100k) with every growth checked against the render's budget."""

  code_generator_class = _BoundedCodeGenerator
  intercepted_binops = frozenset(("*", "+", "%", "**"))

  def __init__(self):
    super().__init__(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined,
                     finalize=self.finalize_output)
    self.filters["tojson"] = _tojson
    del self.filters["pprint"]  # its indentation grows with nesting; no chat template uses it
    self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
    self.filters[_STEPS_FILTER] = _Steps
    del self.globals["lipsum"]  # lipsum(n) writes n paragraphs in one call
    self.globals["raise_exception"] = _raise_exception
    self.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)

  def call_binop(self, context, operator, left, right):
    render = _render()
    if operator == "%" and isinstance(left, (str, bytes)):
      fmt = left if isinstance(left, str) else left.decode("latin-1")  # (bytes: the same specs)
      render.check(_percent_size(fmt, right, render), "characters", "would format a string of")
      return render.built(super().call_binop(context, operator, left, right))
    expected = _binop_size(operator, left, right)
    if expected is None:  # numbers: measured after
      return render.built(super().call_binop(context, operator, left, right))
    render.check(*expected, f"would build (operator {operator}) a value of")
    result = super().call_binop(context, operator, left, right)
    render.count(*expected)  # exactly what was checked: no need to measure it again
    return result

  def call(self, context, obj, /, *args, **kwargs):
    render = _render()
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, (str, bytes)):
      if obj.__name__ == "join" and args and not isinstance(args[0], (list, tuple)):
        args = (list(args[0]),) + args[1:]  # a generator: its parts, measured once
      size = _method_size(owner, obj.__name__, args, kwargs)
      if size is not None:
        render.check(size, "characters", f"would build (.{obj.__name__}) a string of")
    return render.built(super().call(context, obj, *args, **kwargs),
                        f"built (calling {getattr(obj, '__name__', 'a function')})")

  def wrap_str_format(self, value):
    wrapped = super().wrap_str_format(value)
    if wrapped is None:
      return None
    fmt, is_map = value.__self__, value.__name__ == "format_map"

    def bounded(*args, **kwargs):
      render = _render()
      if is_map:
        size = _format_size(fmt, (), args[0] if args and isinstance(args[0], Mapping) else {},
                            render)
      else:
        size = _format_size(fmt, args, kwargs, render)
      render.check(size, "characters", "would format a string of")
      return render.built(wrapped(*args, **kwargs))
    return functools.update_wrapper(bounded, value)

  def concat(self, parts):
    """Joins the chunks of a macro, a block or ``{% set %}...{% endset %}`` (all strings
    already; only their join is new)."""
    parts = list(parts)
    render = _render()
    render.check(sum(map(len, parts)), "characters", "would join a string of")
    return render.built("".join(parts))

  def join_text(self, parts):
    """``a ~ b ~ ...``: each part as text, joined."""
    render = _render()
    parts = [_as_text(render, part, "operator ~") for part in parts]
    render.check(sum(map(len, parts)), "characters", "would build (operator ~) a string of")
    return render.built("".join(parts))

  @staticmethod
  def finalize_output(value):
    """Every ``{{ value }}`` before jinja makes it text: a list or dict is measured first."""
    if not isinstance(value, str):
      render = _render()
      render.check(_text_size(value, render.max_chars), "characters", "would print at least")
    return value


_TEMPLATES: dict = {}


def compile_template(source: str):
  """A chat template in the bounded sandbox (compiled once per source); a source jinja
  cannot compile raises ``jinja2.TemplateError``."""
  if source not in _TEMPLATES:
    _TEMPLATES[source] = _environment().from_string(source)
  return _TEMPLATES[source]


@functools.cache
def _environment() -> _BoundedEnvironment:
  return _BoundedEnvironment()
