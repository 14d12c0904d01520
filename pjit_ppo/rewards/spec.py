"""SPEC strings that name a Python callable: `package.module:callable` (importable from the
current directory or the Python path) or `path/to/file.py:callable` (a file, relative to
the current directory). The attribute may be dotted (`module:Class.method`).

`parse` checks the form without importing anything (the config check); `load` imports
and returns the callable. Both raise `RewardFunctionError` (a ConfigError: the launch
prints one line and exits 2) naming the config field, the SPEC and the fix. jax-free.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from typing import Callable, Tuple

from pjit_ppo.errors import ConfigError

FORMS = "'package.module:callable' or 'path/to/file.py:callable'"
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ATTRIBUTE = _MODULE


class RewardFunctionError(ConfigError):
    """A reward function the user wrote cannot be used: its SPEC does not import, its
    signature does not fit, it raised, or it returned something other than one finite
    number per row. One line, naming the config field, the SPEC and what to do."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """`TypeName: first line of the message` (at most `limit` characters)."""
    text = str(error).strip()
    text = text.splitlines()[0] if text else ""
    out = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return out if len(out) <= limit else out[:limit - 3] + "..."


def parse(spec: str, field: str) -> Tuple[str, str, bool]:
    """(module name or file path, attribute path, whether it is a file) of a SPEC.

    Raises RewardFunctionError for an empty SPEC or one of neither form.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardFunctionError(f"{field} is empty: name the reward function as {FORMS}")
    where, sep, attribute = spec.strip().rpartition(":")
    if not sep or not where or not _ATTRIBUTE.match(attribute):
        raise RewardFunctionError(f"{field}={spec!r} is not a SPEC: write it as {FORMS}")
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    if not is_file and not _MODULE.match(where):
        raise RewardFunctionError(f"{field}={spec!r}: {where!r} is neither a module name nor a "
                                  f".py file; write the SPEC as {FORMS}")
    return where, attribute, is_file


def _import_file(path: str, field: str, spec: str):
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise RewardFunctionError(f"{field}={spec!r}: no such file {path!r} (relative to "
                                  f"{os.getcwd()}); give the path of the .py file that "
                                  f"defines the function")
    name = "pjit_ppo_reward_" + re.sub(r"\W", "_", os.path.splitext(full)[0].lstrip(os.sep))
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(module_spec)
    directory = os.path.dirname(full)
    if directory not in sys.path:  # the file may import modules next to it
        sys.path.append(directory)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 -- any failure is the user's file
        del sys.modules[name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RewardFunctionError(f"{field}={spec!r}: importing {path} failed "
                                  f"({first_line(e)}); fix the file") from None
    return module


def _import_module(name: str, field: str, spec: str):
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # modules in the directory the run starts from
    try:
        return importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 -- any failure is the user's module
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RewardFunctionError(f"{field}={spec!r}: cannot import module {name!r} "
                                  f"({first_line(e)}); give a module importable from "
                                  f"{os.getcwd()} or the Python path, or a .py file as "
                                  f"'path/to/file.py:callable'") from None


def load(spec: str, field: str) -> Callable:
    """The callable SPEC names (imported now). RewardFunctionError when the module or file
    does not import, lacks the attribute, or the attribute is not callable."""
    where, attribute, is_file = parse(spec, field)
    module = (_import_file if is_file else _import_module)(where, field, spec)
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            have = sorted(n for n, v in vars(module).items()
                          if callable(v) and not n.startswith("_")
                          and getattr(v, "__module__", None) == module.__name__)
            listed = f" (callables defined there: {', '.join(have)})" if have else ""
            raise RewardFunctionError(f"{field}={spec!r}: {where} has no attribute "
                                      f"{attribute!r}{listed}")
        value = getattr(value, part)
    if not callable(value):
        raise RewardFunctionError(f"{field}={spec!r}: {attribute} is a "
                                  f"{type(value).__name__}, not a callable; name a function "
                                  f"fn(prompts, responses, **metadata)")
    return value
