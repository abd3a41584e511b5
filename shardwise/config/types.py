"""Config value types and their checks: the bottom layer of configuration (imports nothing from the
package). A value read from TOML keeps its type; a value from the command line arrives as a string
and is parsed here."""

from __future__ import annotations

import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key and the fix."""


def type_name(tp: Any) -> str:
    """A readable name for a field type, as used in error messages and help."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join(type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is Literal:
        return "one of " + _choices(typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        return "table of strings"
    if typing.get_origin(tp) is list:
        return "list of tables"
    return getattr(tp, "__name__", str(tp))


def _choices(args: tuple) -> str:
    """A Literal's choices as the user types them (true, not True)."""
    return ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True,
               "false": False, "0": False, "no": False, "off": False}


def coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Check ``value`` against the field type ``tp``; CLI values arrive as strings and are parsed."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        # "none" on the command line unsets an optional field -- unless "none" is one of its choices
        # (model.moe_balance=none), which it then means
        chosen = from_cli and value == "none" and "none" in typing.get_args(inner[0])
        if value is None or (from_cli and str(value).lower() in ("none", "null") and not chosen):
            return None
        return coerce(key, inner[0], value, from_cli)
    if typing.get_origin(tp) is Literal:  # the field's choices are its type
        if from_cli and isinstance(value, str) and any(isinstance(a, bool) for a in args):
            value = _BOOL_WORDS.get(value.lower(), value)  # e.g. compile.enabled: auto/true/false
        # (type too: TOML's 1 equals True, and must not pass for it)
        if not any(value == a and type(value) is type(a) for a in args):
            raise ConfigError(f"{key} must be one of {_choices(args)}, got {value!r}")
        return value
    bad = ConfigError(f"config key '{key}' expects {type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _BOOL_WORDS:
            return _BOOL_WORDS[str(value).lower()]
        raise bad
    if tp in (int, float):  # an int is a float too, never the other way round; a bool is neither
        if isinstance(value, tp if tp is int else (int, float)) and not isinstance(value, bool):
            return tp(value)
        if from_cli and isinstance(value, str):
            try:
                return tp(value.replace("_", ""))
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(tp) is dict:
        if from_cli and isinstance(value, str):
            out: dict[str, str] = {}
            for item in filter(None, value.split(",")):
                k, sep, v = item.partition("=")
                if not sep:
                    raise ConfigError(f"config key '{key}' expects k=v[,k=v...], got {value!r}")
                out[k.strip()] = v.strip()
            return out
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return dict(value)
        raise bad
    if typing.get_origin(tp) is list:  # [[section.key]] tables; on the CLI "k=v,k=v;k=v,k=v"
        if from_cli and isinstance(value, str):
            return [coerce(key, dict[str, str], item, True) for item in filter(None, value.split(";"))]
        if isinstance(value, list) and all(isinstance(v, dict) for v in value):
            return [dict(v) for v in value]
        raise bad
    raise ConfigError(f"config key '{key}' has an unsupported type {tp}")


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The tables of a TOML file; unreadable or invalid: one line naming ``what`` and the file."""
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} '{path}' cannot be read ({e}): check the path") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not valid TOML: {e}") from None


def toml_value(value: Any) -> str:
    """``value`` as a TOML file writes it (``false``, ``"auto"``, ``[]``)."""
    return tomli_w.dumps({"v": value}).partition("=")[2].strip()
