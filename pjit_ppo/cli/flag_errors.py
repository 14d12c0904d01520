"""Command-line mistakes as one line on stderr and exit status 2, never a traceback.

`parse_flags` is the `flags_parser` of every entry point's `app.run`. It covers what
absl and `ml_collections.config_flags` would otherwise report as a traceback or a
multi-line FATAL message: an unknown flag, a recipe file that does not exist or whose
`get_config` fails, an override of a field the config does not have
(`--config.ppo.lrr=1`, with the closest field names), a value of the wrong type
(`--config.ppo.lr=abc`, with the field's type and current value), a missing required
flag. Values that parse but cannot work are `RunConfig.validate()`'s and
`pjit_ppo.preflight`'s business.
"""
from __future__ import annotations

import difflib
import os
import re
import sys
import typing
from typing import Any, List, Optional, Sequence

from absl import flags
from ml_collections.config_flags import config_flags as _cf
from ml_collections.config_flags import config_path

#: The exit status of a launch refused for its flags or config.
USAGE_EXIT = 2


def fail(message: str, kind: str = "invalid config") -> None:
    """Prints `error: KIND: MESSAGE` (one line) on stderr and exits with status 2."""
    line = " ".join(str(message).split())
    print(f"error: {kind}: {line}", file=sys.stderr)
    sys.exit(USAGE_EXIT)


def parse_flags(argv: Sequence[str]) -> List[str]:
    """absl `flags_parser`: parses `argv` into absl.flags.FLAGS; returns the remaining args.

    Every parse failure ends the process with one line on stderr and exit status 2.
    """
    argv = list(argv)
    for name, path in _config_files(argv):
        file = path.split(":", 1)[0]
        if not os.path.isfile(file):
            fail(f"--{name}={path}: no such recipe file {file!r} (cwd {os.getcwd()}); give the "
                 f"path of a recipe such as configs/tiny_demo.py")
    try:
        rest = flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as e:
        fail(str(e), "unknown flag")
    except flags.Error as e:
        fail(_describe_flag_error(e, argv))
    except (KeyError, AttributeError, IndexError, TypeError, ValueError, OSError) as e:
        fail(_describe_override_error(e, argv))
    for name, path in _config_files(argv):
        value = flags.FLAGS[name].value
        if isinstance(value, _cf._ErrorConfig):  # noqa: SLF001 (the only way to see it)
            fail(f"--{name}={path}: the recipe could not be loaded ({_first_line(value._error)})")
    return rest


def _first_line(e: Any) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _config_flag_names() -> List[str]:
    return [name for name, flag in flags.FLAGS._flags().items()  # noqa: SLF001
            if _cf.is_config_flag(flag) and name == flag.name]


def _config_files(argv: Sequence[str]):
    """(flag name, value) of every `--NAME=FILE[:ARG]` config-file flag in argv."""
    names = _config_flag_names()
    for i, arg in enumerate(argv):
        for name in names:
            if arg.startswith((f"--{name}=", f"-{name}=")):
                yield name, arg.split("=", 1)[1]
            elif arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
                yield name, argv[i + 1]


def _describe_flag_error(e: flags.Error, argv: Sequence[str]) -> str:
    text = str(e)
    if "Error whilst parsing config file" in text:
        return _describe_recipe_failure(text)
    match = re.match(r"flag --(\w+)\.([\w.]+)=(.*?): (.*)", text, re.S)
    if match:
        name, path, value, reason = match.groups()
        config = _loaded_config(name)
        hint = ""
        if config is not None:
            try:
                current = config_path.get_value(path, config)
            except Exception:  # noqa: BLE001 (a hint only)
                current = None
            if hasattr(type(current), "__dataclass_fields__"):
                return (f"--{name}.{path}={value}: {path} is a section, not a value; set its "
                        f"fields (--{name}.{path}.FIELD=VALUE)")
            hint = f"; {path} takes {_field_type(config, path)} (now {current!r})"
        return f"--{name}.{path}={value}: {_first_line(reason)}{hint}"
    return _first_line(text)


def _describe_recipe_failure(text: str) -> str:
    """The recipe's own exception and where it was raised, from the trace config_flags
    puts in its message."""
    lines = [line for line in text.splitlines() if line.strip()]
    flag = re.match(r"flag (--\S+?): ", lines[0])
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    where = ""
    if frames:
        file, line, func = frames[-1]
        where = f" (at {file}:{line} in {func})"
    return (f"{flag.group(1) if flag else '--config'}: the recipe's get_config failed: "
            f"{lines[-1].strip()}{where}")


def _loaded_config(name: str) -> Optional[Any]:
    try:
        value = flags.FLAGS[name].value
    except Exception:  # noqa: BLE001 (the flag failed before it held a value)
        return None
    return None if value is None or isinstance(value, _cf._ErrorConfig) else value


def _field_type(config: Any, path: str) -> str:
    try:
        hint = config_path.get_type(path, config)
    except Exception:  # noqa: BLE001 (a hint only)
        return "a value of its type"
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    if hint is bool:
        return "a bool (true / false)"
    return f"{'an' if getattr(hint, '__name__', '')[:1] in 'aeiou' else 'a'} " \
           f"{getattr(hint, '__name__', str(hint))}"


def _describe_override_error(e: Exception, argv: Sequence[str]) -> str:
    """An override of a field the config does not have: which one, and the closest names."""
    for name, path in _config_files(argv):
        try:
            config = _cf.ConfigFileFlagParser(name).parse(path)
        except Exception:  # noqa: BLE001 (reported below from the original error)
            break
        if isinstance(config, _cf._ErrorConfig):
            return f"--{name}={path}: the recipe could not be loaded ({_first_line(config._error)})"
        for arg in argv:
            match = re.match(rf"-{{1,2}}(?:no)?{re.escape(name)}\.([\w.]+)(=.*)?$", arg)
            if match:
                problem = _unknown_part(config, match.group(1))
                if problem:
                    return f"{arg}: {problem}"
    return f"{type(e).__name__}: {_first_line(e)}"


def _unknown_part(config: Any, path: str) -> Optional[str]:
    """Why `path` names nothing in `config` (None if it does)."""
    holder, done = config, []
    for part in path.split("."):
        where = ".".join(done) or "the config"
        if isinstance(holder, dict):
            keys = sorted(map(str, holder))
            if part not in holder:
                return (f"{where} has no key {part!r}{_closest(part, keys)}; its keys are "
                        f"{', '.join(keys) or 'none'} (only keys the recipe sets can be "
                        f"overridden)")
            holder = holder[part]
        elif hasattr(type(holder), "__dataclass_fields__"):
            names = sorted(type(holder).__dataclass_fields__)
            if part not in names:
                return f"{where} has no field {part!r}{_closest(part, names)}"
            holder = getattr(holder, part)
        else:
            return f"{where} is a {type(holder).__name__} and has no field {part!r}"
        done.append(part)
    return None


def _closest(word: str, names: Sequence[str]) -> str:
    near = difflib.get_close_matches(word, names, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
