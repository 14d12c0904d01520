"""The checks every config section uses: types against the annotations, finiteness,
ranges and choices. Each raises `ConfigError` naming the field, its value and the fix."""
import math
import typing
from typing import Any

from pjit_ppo.errors import ConfigError


def need(ok: bool, message: str) -> None:
    """Raises ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def choice(field: str, value: Any, allowed) -> None:
    """`value` is one of `allowed`."""
    need(value in allowed, f"{field}={value!r}; choose one of {', '.join(map(repr, allowed))}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_number(field: str, value: Any) -> None:
    """`value` is an int or float, not NaN or infinite."""
    need(_is_number(value) and math.isfinite(value), f"{field}={value!r} must be a finite number")


def int_at_least(field: str, value: Any, low: int, fix: str = "") -> None:
    """`value` is an int (not a bool) >= low."""
    need(isinstance(value, int) and not isinstance(value, bool) and value >= low,
         f"{field}={value!r} must be an integer >= {low}{fix}")


def number_in(field: str, value: Any, low: float, high: float, fix: str = "", *,
              low_open: bool = False, high_open: bool = False) -> None:
    """`value` is a number in the interval from low to high (closed unless *_open)."""
    ok = _is_number(value) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high)
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    need(ok, f"{field}={value!r} must be a number in {interval}{fix}")


def positive(field: str, value: Any, fix: str = "") -> None:
    """`value` is a finite number > 0."""
    finite_number(field, value)
    need(value > 0, f"{field}={value!r} must be > 0{fix}")


def non_negative(field: str, value: Any, fix: str = "") -> None:
    """`value` is a finite number >= 0."""
    finite_number(field, value)
    need(value >= 0, f"{field}={value!r} must be >= 0{fix}")


def _type_name(hint: Any) -> str:
    """How a field's annotation reads in an error message ("int", "float or None", ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return f"a tuple of {_type_name(args[0])}" if args else "a tuple"
    if origin is dict:
        return "a dict"
    return getattr(hint, "__name__", str(hint))


def _has_type(value: Any, hint: Any) -> bool:
    """Whether `value` fits a field annotation (an int is a float; a bool is not an int)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is typing.Union:
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        return isinstance(value, (tuple, list)) and all(
            _has_type(v, args[0]) for v in value) if args else isinstance(value, tuple)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return _is_number(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is typing.Literal:
        return value in args
    if origin is not None:  # list[...], Sequence[...], ...: the container type only
        return isinstance(value, origin)
    return isinstance(value, hint) if isinstance(hint, type) else True


def check_field_types(section: Any, prefix: str) -> None:
    """Every field of a config dataclass has its annotated type; raises ConfigError."""
    for name, hint in typing.get_type_hints(type(section)).items():
        value = getattr(section, name)
        need(_has_type(value, hint), f"{prefix}{name}={value!r} has type {type(value).__name__}; "
                                     f"it must be {_type_name(hint)}")


def check_values_finite(tree: Any, prefix: str = "") -> None:
    """No NaN or infinity anywhere in a nested dict / list of config values (e.g. a
    config's `to_dict()`, including model.random); raises ConfigError naming the field."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            check_values_finite(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            check_values_finite(value, f"{prefix}[{i}]")
    elif isinstance(tree, float):
        need(math.isfinite(tree), f"{prefix}={tree!r}: NaN and infinity are not valid config "
                                  f"values; give a finite number")


def check_types_and_finiteness(config: Any) -> None:
    """The checks every stage config starts with: each field's and each section's field
    types, then no NaN / infinity anywhere (sections are dataclass fields)."""
    import dataclasses
    check_field_types(config, "")
    for field in dataclasses.fields(config):
        section = getattr(config, field.name)
        if dataclasses.is_dataclass(section):
            check_field_types(section, f"{field.name}.")
    check_values_finite(config.to_dict())
