"""A checkpoint's chat template is code from elsewhere that runs on every request's
messages (issue #25, "Loader limits"): a template that would build or print a huge string
or list (a dict view included), or run without end, is refused with an ``InputError`` that
names the checkpoint and the limit (a server answers it with 400), and real templates
render exactly as jinja renders them. Each template runs through ``Tokenizer`` on a real
tokenizer directory in ``tmp_path``, so these are the sandbox of
``jaxkv.entrypoints.openai.chat_template`` as a server meets it.
"""

import json
import os
import tracemalloc
import types

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import hf_fixtures as hf
import jaxkv
from jaxkv.entrypoints.openai.chat_template import TemplateLimits
from jaxkv.entrypoints.openai.protocol import ApiError
from jaxkv.entrypoints.openai.tokenizer import TokenizerError
from jaxkv.errors import InputError


# ---- chat templates -----------------------------------------------------------------------
def tokenizer_with(tmp_path, template: str, limits: TemplateLimits = TemplateLimits()):
  path = str(tmp_path / "tok")
  hf.write_tokenizer(path)
  with open(os.path.join(path, "tokenizer_config.json")) as f:
    config = json.load(f)
  config["chat_template"] = template
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  return jaxkv.Tokenizer.from_dir(path, template_limits=limits)


HELLO = [{"role": "user", "content": "hello"}]
OUTPUT_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}"
                "{% endfor %}{% endfor %}")
DOUBLING = ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
            "{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s|length }}")


@pytest.mark.parametrize("template,needle", [
    ("{{ 'a' * 200000000 }}", "would build (operator *) a value of 200,000,000 characters"),
    (OUTPUT_LOOPS, "would write a prompt of"),
    (DOUBLING.replace("OP", "+"), "would build (operator +) a value of 2,097,152 characters"),
    (DOUBLING.replace("OP", "~"), "would build (operator ~) a string of 2,097,152 characters"),
    ("{% set ns = namespace(s='a' * 1000) %}{% for i in range(9) %}"
     "{% set ns.s = ns.s|replace('a', ns.s) %}{% endfor %}", "would replace into a string of"),
    ("{{ 'a'.ljust(1000000000) }}", "would build (.ljust) a string of 1,000,000,000"),
    ("{{ '{:>1000000000}'.format(1) }}", "would format a string of"),
    ("{{ '%1000000000d' % 1 }}", "would format a string of"),
    ("{{ '%200000000d'.encode() % 1 }}", "would format a string of"),
    ("{{ 'a'|center(1000000000) }}", "would pad a string to 1,000,000,000 characters"),
    ("{{ ['a' * 1000000] * 100000 }}", "would print at least"),
    ("{{ (['a' * 1000000] * 100000)|join }}", "would make text (filter join) of at least"),
])
def test_a_template_building_past_the_size_limit_is_refused(tmp_path, template, needle):
  tok = tokenizer_with(tmp_path, template)
  with pytest.raises(TokenizerError) as e:
    tok.encode_chat(HELLO)
  message = str(e.value)
  assert needle in message, message
  assert f"the chat template of {tok.path!r}" in message and "TemplateLimits" in message
  assert "shorten the messages or fix the template" in message and "\n" not in message


@pytest.mark.parametrize("template,needle", [
    ("{{ ([1] * 1000000)|length }}", "a value of 1,000,000 items"),
    ("{{ ([[1] * 100000] * 100000)|sum(start=[])|length }}", "would sum into a list of"),
    ("{{ [1]|batch(1000000000, 'x')|list|length }}", "would fill batches of 1,000,000,000"),
])
def test_a_template_building_a_long_list_is_refused(tmp_path, template, needle):
  with pytest.raises(TokenizerError, match="TemplateLimits.max_items") as e:
    tokenizer_with(tmp_path, template).render_chat(HELLO)
  assert needle in str(e.value)


# dict.fromkeys of 100k keys is within max_items; each route prints all its values, 2,000
# characters each: 200 MB of text, which before was built first and measured after.
VALUES = "{% set d = dict.fromkeys(range(100000), 'a' * 2000) %}"


@pytest.mark.parametrize("template,needle", [
    (VALUES + "{{ d.values() }}", "would print at least"),
    (VALUES + "{{ d.items() }}", "would print at least"),
    (VALUES + "{{ [d.values()] }}", "would print at least"),
    (VALUES + "{{ d.values()|string }}", "would make text (filter string) of at least"),
    (VALUES + "{{ '%s' % d.values() }}", "would format a string of"),
    (VALUES + "{{ '{}'.format(d.values()) }}", "would format a string of"),
    (VALUES + "{{ 'x' ~ d.values() }}", "would make text (operator ~) of at least"),
    (VALUES + "{{ d.values()|join }}", "would make text (filter join) of at least"),
    (VALUES + "{{ ''.join(d.values()) }}", "would build (.join) a string of"),
    (VALUES + "{{ d.values()|list|join }}", "would make text (filter join) of at least"),
    # A string prints escaped inside a list: "\x00" is 4 characters there, not 1.
    ("{{ [messages[0]['content']] * 3 }}", "would print at least"),
    ("{{ messages[0]['content']|tojson }}", "would make JSON (filter tojson) of at least"),
    ("{{ messages[0]['content']|e }}", "would make text (filter e) of up to"),
])
def test_what_a_template_prints_is_sized_before_it_is_built(tmp_path, template, needle):
  tok = tokenizer_with(tmp_path, template)
  messages = [{"role": "user", "content": ("\x00" if "content" in template else "a") * 200_000}]
  if "|e" in template:  # &amp;: 5 characters for 1, past the 4 a message character allows
    messages = [{"role": "user", "content": "&" * 1_200_000}]
  tracemalloc.start()
  try:
    with pytest.raises(TokenizerError) as e:
      tok.render_chat(messages)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert needle in str(e.value), str(e.value)
  assert "TemplateLimits" in str(e.value) and "\n" not in str(e.value)
  assert peak < 48 * 2**20, f"the render held {peak:,} bytes at its peak"


class _Opaque:
  """A value a Python caller may pass in a message, whose text is not its structure."""

  def __repr__(self):
    return "x" * 100_000_000


def test_a_value_whose_text_cannot_be_sized_is_refused_when_printed(tmp_path):
  tok = tokenizer_with(tmp_path, "{{ messages[0]['content'] }}")
  with pytest.raises(TokenizerError, match="would print a value of type _Opaque, whose text "
                                           "jaxkv cannot size"):
    tok.render_chat([{"role": "user", "content": _Opaque()}])
  # What prints short whatever it holds still renders: a loop, a function, a generator.
  tok = tokenizer_with(tmp_path, "{% for m in messages %}{{ loop|length }}{{ range(3) }}"
                                 "{{ m.content.upper }}{{ messages|map('string') }}{% endfor %}")
  assert tok.render_chat(HELLO).startswith("1range(0, 3)<built-in method upper of str object")


def test_what_a_render_builds_in_all_is_bounded(tmp_path):
  # Each string is within the size limit, but a list keeps every one alive.
  template = ("{% set ns = namespace(kept=[]) %}{% for i in range(100000) %}"
              "{% set ns.kept = ns.kept + [('a' * 500000) ~ i] %}{% endfor %}")
  with pytest.raises(TokenizerError, match="TemplateLimits.max_total_chars"):
    tokenizer_with(tmp_path, template).render_chat(HELLO)


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # No loop at all: each call doubles the work; a macro's body is one string, not a stream.
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
    "{{ f(60) }}",
])
def test_a_template_running_past_its_time_budget_is_refused(tmp_path, template):
  tok = tokenizer_with(tmp_path, template, TemplateLimits(max_render_s=0.05))
  with pytest.raises(TokenizerError) as e:
    tok.render_chat(HELLO)
  assert "ran past its time budget" in str(e.value)
  assert "TemplateLimits.max_render_s" in str(e.value)


def test_integers_are_bounded(tmp_path):
  tok = tokenizer_with(tmp_path, "{{ 3 ** 100000000 }}")
  with pytest.raises(TokenizerError, match="200,000,000 bits"):
    tok.render_chat(HELLO)


def test_a_template_failing_on_the_messages_is_bad_input(tmp_path):
  # Before, these escaped as jinja's or Python's own exceptions (a server's 500).
  with pytest.raises(TokenizerError, match="failed on these messages: UndefinedError"):
    tokenizer_with(tmp_path, "{{ messages[5]['content'] }}").render_chat(HELLO)
  with pytest.raises(TokenizerError, match="failed on these messages: OverflowError"):
    tokenizer_with(tmp_path, "{{ range(1000000)|length }}").render_chat(HELLO)
  with pytest.raises(TokenizerError, match="does not compile"):
    tokenizer_with(tmp_path, "{% for %}").render_chat(HELLO)
  with pytest.raises(TokenizerError, match="refused the messages: roles must alternate"):
    tokenizer_with(tmp_path, "{{ raise_exception('roles must alternate') }}").render_chat(HELLO)


def test_the_server_answers_a_refused_render_with_400(tmp_path):
  from jaxkv.entrypoints.openai.server import _Reader
  tok = tokenizer_with(tmp_path, "{% for m in messages %}{{ m['content'] * 100000 }}"
                                 "{% endfor %}")
  assert issubclass(TokenizerError, InputError)
  server = types.SimpleNamespace(tokenizer=tok)  # _chat_prompt reads only the tokenizer
  with pytest.raises(ApiError) as e:
    _Reader._chat_prompt(server, [{"role": "user", "content": "abcdefghijklmnopqrstuvwxyz"}])
  assert e.value.status == 400 and e.value.param == "messages"
  assert "TemplateLimits.max_chars" in e.value.message


def test_limits_are_validated():
  with pytest.raises(InputError, match=r"TemplateLimits.max_chars=0 must be a positive integer"):
    TemplateLimits(max_chars=0)
  with pytest.raises(InputError, match=r"max_render_s=-1 must be a positive number"):
    TemplateLimits(max_render_s=-1)


# Real templates (as their checkpoints ship them, or in their style) and what they use:
# `+` and `~` on strings, trim/tojson/selectattr/format filters, namespaces, macros, string
# methods, slicing, loop.last/index0, raise_exception.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")
TOOLS_STYLE = """{%- macro header(role) -%}<|{{ role }}|>{{ '\\n' }}{%- endmacro -%}
{%- set ns = namespace(system='', last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = m.content.strip() -%}{%- endif -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- if ns.system -%}{{ header('system') ~ ns.system ~ '\\n' }}{%- endif -%}
{{- 'Tools: ' ~ (messages|selectattr('role', 'equalto', 'user')|list|length) ~ ' user turns\\n' -}}
{{- {'name': 'lookup', 'args': ['q', 1, none, true]}|tojson(indent=4) ~ '\\n' -}}
{%- for m in messages[1:] if m.role != 'system' -%}
  {%- set text = m.content.split('</think>')[-1].lstrip('\\n') -%}
  {{- header(m.role) -}}{{ '%s (%d/%d)'|format(text, loop.index, loop.length) }}
  {%- if loop.index0 + 1 == ns.last_user %} <last>{% endif %}
  {{- '{0}:{1:>4}'.format(m.role|upper, loop.index) ~ ('-' * 3) -}}
  {%- if not loop.last -%}{{ eos_token }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ header('assistant') }}{%- endif -%}"""


def jinja_renders(template: str, messages, tok) -> str:
  """The template as jinja's immutable sandbox renders it, with nothing bounded (as the
  tokenizer rendered before)."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                              indent=indent)

  def raise_exception(message):
    raise ValueError(message)
  env.globals["raise_exception"] = raise_exception
  return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                          bos_token=tok.bos_token, eos_token=tok.eos_token)


@pytest.mark.parametrize("template", [hf.CHAT_TEMPLATE, LLAMA3, QWEN2, MISTRAL, TOOLS_STYLE],
                         ids=["fixture", "llama3", "qwen2", "mistral", "tools_style"])
def test_real_templates_render_as_jinja_renders_them(tmp_path, template):
  # The last message is longer than max_chars: bounds grow with the messages' size.
  long = "the cache keeps keys and values " * 40_000  # 1.28M characters
  messages = [{"role": "system", "content": " be brief "},
              {"role": "user", "content": "hello </think>\nworld"},
              {"role": "assistant", "content": "hi"}, {"role": "user", "content": long}]
  if template is MISTRAL:
    messages = messages[1:]
  tok = tokenizer_with(tmp_path, template)
  want = jinja_renders(template, messages, tok)
  assert len(long) > TemplateLimits().max_chars and long.strip() in want
  assert tok.render_chat(messages) == want
  short = messages[:-1]
  assert tok.encode_chat(short) == tok.encode(jinja_renders(template, short, tok),
                                              add_special_tokens=False)
