"""Helpers shared by the launch scripts: start JAX the way a config asks, report figures.

Kept out of the library on purpose: this is the only place that touches the process
environment, and it must run before JAX is imported.
"""

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import sys
import warnings

from absl import flags

COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", None, "Keep compiled steps here, so that a restart of the same "
    "model, shapes, flags and JAX version compiles nothing (JAX's persistent compilation "
    "cache: an entry's key is the program, the devices, the XLA flags and the versions). "
    "Default: $JAX_COMPILATION_CACHE_DIR when set, else ~/.cache/jaxkv/jit; '' turns it "
    "off. The directory is trimmed to --compilation_cache_max_mb, oldest use first.")
COMPILATION_CACHE_MAX_MB = flags.DEFINE_integer(
    "compilation_cache_max_mb", 2048, "Most megabytes --compilation_cache_dir may hold.",
    lower_bound=1)


def refuse(message: str) -> None:
  """Bad input: one line on stderr naming the value and the fix, exit status 2."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
  sys.exit(2)


def load_config(holder):
  """The config a ``config_flags`` flag names, or a one-line refusal when the file does not
  load (config_flags defers that error until the value is read)."""
  try:
    cfg = holder.value
    if cfg is not None:
      cfg.keys()  # a config that failed to load raises on first use
    return cfg
  except Exception as e:  # a missing file, a syntax error or exception inside it
    if _is_bug(e):
      raise
    refuse(f"--{holder.name} did not load: {e}")


def start_jax(cfg) -> None:
  """Sets the platform and the virtual CPU device count, imports JAX and (outside a
  multi-process job) starts its backend: a config made for a platform this machine does
  not have is refused here, in one line, before anything is built or compiled.

  Logging: jaxkv's INFO lines (start-up, calibration, compile progress) are shown; other
  libraries' INFO (Orbax, XLA backends) only when --verbosity asks for them."""
  from absl import flags, logging
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.INFO)
    logging.get_absl_handler().addFilter(_jaxkv_info_only)
  if "jax" not in sys.modules:
    platform = cfg.get("platform", None)
    # 'gpu' is left to JAX (it picks the GPU where there is one; JAX 0.11 takes only
    # 'cuda' or 'rocm' in JAX_PLATFORMS); check_platform refuses a machine without one.
    if platform and platform != "gpu":
      os.environ.setdefault("JAX_PLATFORMS", platform)
    count = cfg.get("host_device_count", None)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if count and "xla_force_host_platform_device_count" not in xla_flags:
      os.environ["XLA_FLAGS"] = (
          f"{xla_flags} --xla_force_host_platform_device_count={count}".strip())
  import jax  # noqa: F401  (imported here, after the environment is set)
  use_compilation_cache()
  if not os.environ.get("JAXKV_COORDINATOR"):  # a job's processes check after joining it
    check_platform(cfg)


def use_compilation_cache() -> str | None:
  """Points JAX's persistent compilation cache at --compilation_cache_dir (see the flag);
  returns the directory, or None when it is off. Every compile is kept, however short: a
  warm restart is the point."""
  import jax
  # (A script that parses its own arguments, not absl's, gets the defaults.)
  parsed = flags.FLAGS.is_parsed()
  directory = COMPILATION_CACHE_DIR.value if parsed else None
  if directory is None:
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
      return os.environ["JAX_COMPILATION_CACHE_DIR"]  # JAX reads it itself
    directory = os.path.join(os.path.expanduser("~"), ".cache", "jaxkv", "jit")
  if not directory:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  max_mb = COMPILATION_CACHE_MAX_MB.value if parsed else COMPILATION_CACHE_MAX_MB.default
  jax.config.update("jax_compilation_cache_max_size", max_mb << 20)
  return directory


def check_platform(cfg) -> None:
  """Starts JAX's backend and refuses, in one line, a config made for a platform this
  machine does not have. In a multi-process job, call it after ``distributed.initialize``
  (which must come before the backend starts).

  What JAX says while it starts its backends (a plugin that fails, a GPU it cannot use, the
  TPU probe) is held back: a refusal folds the part that explains it into its one line; a
  run that goes on logs it as it would have."""
  import jax
  want = cfg.get("platform", None)
  name = cfg.get("name", None)
  what = f"config {name} is" if name else "this run is"
  with _held_backend_messages() as held:
    try:
      backend = jax.default_backend()
    except RuntimeError as e:
      backend = None
      held.failure = str(e)
  if want and backend != want:
    has = f"runs {backend!r}" if backend else f"cannot start JAX's {want!r} backend"
    said = held.explaining(want)
    refuse(f"{what} for platform {want!r} but this machine {has} (JAX_PLATFORMS="
           f"{os.environ.get('JAX_PLATFORMS', '')!r}); run it where that platform is"
           + (", or size it with launch/plan.py --config=... on any machine." if name else
              ", or choose --platform=cpu.")
           + (f" JAX said: {' | '.join(said)}" if said else ""))
  held.replay()


# The names a platform's backends go by in JAX's messages.
_BACKEND_NAMES = {"gpu": ("gpu", "cuda", "rocm", "nvidia"), "tpu": ("tpu",)}


class _HeldMessages(logging.Handler):
  """JAX's backend log records and Python warnings from one backend start, kept."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.records, self.warnings, self.failure = [], [], None

  def emit(self, record):
    self.records.append(record)

  def explaining(self, platform: str) -> list:
    """Each warning, error and failure's first line, and what was said about ``platform``."""
    names = _BACKEND_NAMES.get(platform, (platform,))
    lines = [r.getMessage() for r in self.records
             if r.levelno >= logging.WARNING or any(n in r.getMessage().lower() for n in names)]
    lines += [str(w.message) for w in self.warnings]
    lines += [self.failure] if self.failure else []
    return [line.strip().splitlines()[0] for line in lines if line.strip()]

  def replay(self):
    for record in self.records:
      logger = logging.getLogger(record.name)
      if logger.isEnabledFor(record.levelno):
        logger.handle(record)
    for w in self.warnings:
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@contextlib.contextmanager
def _held_backend_messages():
  logger = logging.getLogger("jax._src.xla_bridge")
  held = _HeldMessages()
  level, propagate = logger.level, logger.propagate
  logger.addHandler(held)
  logger.setLevel(logging.INFO)
  logger.propagate = False
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      yield held
  finally:
    held.warnings = list(caught)
    logger.removeHandler(held)
    logger.setLevel(level)
    logger.propagate = propagate


def _jaxkv_info_only(record) -> bool:
  if record.levelno >= 30:  # warnings and errors from anyone
    return True
  return _is_ours(record.pathname)


@functools.lru_cache(maxsize=None)
def _is_ours(pathname: str) -> bool:
  """Whether a log line's file is in the jaxkv package or beside this module (launch/).
  Decided by those directories, not by a name in the path: a user's virtual environment in
  a clone named ``jaxkv`` puts every library under ``.../jaxkv/.venv/``, and JAX's backend
  probe (``Unable to initialize backend 'tpu'``) would then print ahead of a refusal."""
  path = os.path.realpath(pathname)
  return any(os.path.commonpath([path, mine]) == mine for mine in _our_dirs())


@functools.lru_cache(maxsize=1)
def _our_dirs() -> tuple:
  spec = importlib.util.find_spec("jaxkv")  # finds the package without importing it
  package = list(spec.submodule_search_locations or []) if spec else []
  return tuple(os.path.realpath(d) for d in [os.path.dirname(__file__), *package])


def check_output(path: str | None, flag: str, *, directory: bool = False) -> None:
  """Refuses, before any work, an output path that cannot be written: a directory where a
  file is wanted (or the reverse), or a location whose nearest existing parent is not a
  writable directory. Creates nothing."""
  if not path:
    return
  path = os.path.abspath(path)
  if directory:
    if os.path.exists(path) and not os.path.isdir(path):
      refuse(f"--{flag}={path} is a file; give a directory (it is created if missing).")
  elif os.path.isdir(path):
    refuse(f"--{flag}={path} is a directory; give a file path.")
  parent = path if directory and os.path.isdir(path) else os.path.dirname(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
    refuse(f"--{flag}={path} cannot be written: {parent} is not a writable directory; "
           "choose another path.")


def load_api_keys(path: str | None, flag: str = "api_keys_file") -> dict | None:
  """The keys file ``--api_keys_file`` names, ``{api key: tenant}`` (None without one),
  refused in one line when it does not load, is readable by group or others, or does not
  map keys of 16+ characters to tenant names. The API server and the router read the same
  file (``jaxkv.entrypoints.openai.auth``: how a request's key is checked). Imports no JAX."""
  import stat
  from absl import app
  if not path:
    return None
  try:
    mode = os.stat(path).st_mode
    with open(path) as f:
      keys = json.load(f)
  except (OSError, ValueError) as e:
    raise app.UsageError(f"--{flag}={path} did not load: {e}.") from None
  if mode & (stat.S_IRWXG | stat.S_IRWXO):
    raise app.UsageError(f"--{flag}={path} is readable by group or others (mode "
                         f"{stat.S_IMODE(mode):o}); chmod 600 {path}.")
  if not isinstance(keys, dict) or not keys or not all(
      isinstance(k, str) and len(k) >= 16 and isinstance(v, str) and v for k, v in keys.items()):
    raise app.UsageError(f"--{flag}={path} must hold a JSON object mapping API keys "
                         "(16+ characters) to tenant names, e.g. {\"sk-...\": \"team-a\"}.")
  return keys


def _is_bug(e: BaseException) -> bool:
  """True for ``jaxkv.errors.InvariantError``: never reported as bad input."""
  errors = sys.modules.get("jaxkv.errors")  # imported if jaxkv could have raised it
  return errors is not None and isinstance(e, errors.InvariantError)


def token_digest(token_lists) -> str:
  """SHA-256 over token ids in order: equal digests mean equal outputs."""
  h = hashlib.sha256()
  for tokens in token_lists:
    h.update(len(tokens).to_bytes(4, "little"))
    for t in tokens:
      h.update(int(t).to_bytes(4, "little", signed=True))
  return h.hexdigest()


def machine_info() -> dict:
  import jax
  import jaxkv
  return {"devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
          "cpu_cores": os.cpu_count(), "jax": jax.__version__, "jaxkv": jaxkv.__version__}


def write_json(path: str, obj: dict) -> None:
  if not path:
    return
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write("\n")


def renamed_flag(new, old) -> str:
  """The value of flag ``new`` (a ``FlagHolder``), or of its former name ``old`` when that was
  given (with a warning); both given with different values are refused."""
  from absl import app
  from absl import logging as absl_logging
  if old.value is None:
    return new.value
  if new.present and new.value != old.value:
    raise app.UsageError(f"--{new.name}={new.value} and its former name --{old.name}="
                         f"{old.value} disagree: give --{new.name} only.")
  absl_logging.warning("--%s is deprecated: it is --%s (--%s=%s).", old.name, new.name,
                       new.name, old.value)
  return old.value


def define_http_limit_flags():
  """Defines a front's pre-auth HTTP bound flags (``--max_connections``,
  ``--header_timeout_s``, ``--body_timeout_s``) for the script that calls it at import;
  returns a function building the ``HttpLimits`` they give once flags are parsed."""
  max_connections = flags.DEFINE_integer(
      "max_connections", None, "HTTP connections open at once; more are answered 503 and "
      "closed (default: half the file-descriptor limit, at most 1000).", lower_bound=1)
  header_timeout = flags.DEFINE_float(
      "header_timeout_s", 10.0, "A request's line and headers must arrive within this (408).",
      lower_bound=0.001)
  body_timeout = flags.DEFINE_float(
      "body_timeout_s", 30.0, "A request's body must arrive within this after its headers "
      "(408).", lower_bound=0.001)

  def http_limits():
    from jaxkv.entrypoints.openai import limits
    return limits.HttpLimits(
        **({} if max_connections.value is None else {"max_connections": max_connections.value}),
        head_timeout_s=header_timeout.value, body_timeout_s=body_timeout.value)

  return http_limits


def serve_app(app_, *, host: str, port: int, ready_file: str | None, banner: str,
              limits=None) -> None:
  """Listens on ``host:port`` (0: any free port), prints ``banner`` with the URL, writes
  ``{"port": P}`` to ``ready_file`` (whole or absent: written aside, then renamed) and
  serves the ASGI ``app_`` until stopped, under the same pre-auth bounds as the API server
  (``limits``: a ``jaxkv.entrypoints.openai.limits.HttpLimits``, default its defaults:
  connections, headers, URL, slow heads and bodies, idle keep-alives). A port that cannot
  be had is a usage error."""
  import socket
  import uvicorn
  from absl import app
  from jaxkv.entrypoints.openai import limits as httplimits
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    raise app.UsageError(f"--host={host} --port={port}: cannot listen there "
                         f"({e.strerror}); pick a free port.") from None
  port = sock.getsockname()[1]
  print(f"{banner} on http://{host}:{port}/v1", flush=True)
  if ready_file:
    write_json(ready_file + ".tmp", {"port": port})
    os.replace(ready_file + ".tmp", ready_file)
  uvicorn.Server(httplimits.uvicorn_config(app_, limits, log_level="warning",
                                            access_log=False)).run(sockets=[sock])


def parse_flags(argv):
  """``flags.FLAGS(argv)`` where a flag that does not parse or validate is a one-line
  refusal (``refuse``): the flags parser ``run`` gives ``app.run``."""
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    refuse(str(e))


def guarded(main):
  """``main`` where ``app.UsageError`` and ``jaxkv.errors.InputError`` (raised where jaxkv
  checks a value) are one-line refusals; anything else propagates with its traceback."""
  from absl import app

  def call(argv):
    try:
      return main(argv)
    except app.UsageError as e:
      refuse(str(e))
    except Exception as e:
      errors = sys.modules.get("jaxkv.errors")  # imported if jaxkv could have raised it
      if errors is not None and isinstance(e, errors.InputError):
        refuse(str(e))
      raise

  return call


def run(main) -> None:
  """``app.run(main)`` where bad input ends in one line on stderr and exit status 2: a flag
  that does not parse or validate, ``app.UsageError``, and ``jaxkv.errors.InputError``
  (raised where jaxkv checks a value). Anything else is a bug and keeps its traceback
  with exit status 1: ``jaxkv.errors.InvariantError`` (jaxkv's bookkeeping broke a rule),
  and a plain ``ValueError`` too, which is not mapped to 2 (only ``InputError`` is).
  (A test calls ``guarded(main)(parse_flags(argv))`` to run a script's main in process.)"""
  from absl import app
  app.run(guarded(main), flags_parser=parse_flags)
