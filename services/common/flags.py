"""How a settings class (settings.py) becomes flags and back. Each setting is a dataclass
field that carries its own help text, choices and flags (`setting(...)`), so a field is
declared once and everything else is generated from it:

  add_arguments(parser, cls)   the argparse flags (`kv_cache_tokens` -> --kv-cache-tokens;
                               a bool -> --pin-cpus / --no-pin-cpus)
  env_defaults(parser)         PDSERVE_<FIELD> sets any flag's default: the field name upper
                               cased (PDSERVE_KV_CACHE_TOKENS=4096, PDSERVE_PIN_CPUS=0); the
                               command line still wins
  from_args(cls, namespace)    the settings object
  to_argv(settings)            the one rendering of a settings object as flags: what
                               `pdserve up` starts its services with

Environment variables are read here and nowhere else.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import field
from typing import Any, Iterable

ENV_PREFIX = "PDSERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flags: tuple[str, ...] = (),
            choices: Iterable | None = None, metavar: str | None = None, roles: tuple[str, ...] = (),
            factory=None, several: bool = False):
    """A field that is also a command-line flag. `flags`: its option strings (default
    --field-name); `roles`: the worker roles it applies to (default all); `several`: a
    list that one flag may give several values of (`--name a b`, as vLLM's nargs="+"
    flags take them), besides repeating the flag."""
    metadata = {"help": help, "flags": flags, "choices": tuple(choices) if choices else None,
                "metavar": metavar, "roles": roles, "several": several}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class _FromTheCommandLine:
    """A list flag whose values on the command line replace its default (what the
    environment gave, env_defaults) rather than add to it: the command line wins, as it
    does for every other flag, and a child started with `to_argv` sees exactly those."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)


class _Append(_FromTheCommandLine, argparse._AppendAction):
    pass


class _Extend(_FromTheCommandLine, argparse._ExtendAction):
    pass


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _settings_fields(cls, role: str | None = None) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "flags" in f.metadata
            and (role is None or not f.metadata["roles"] or role in f.metadata["roles"])]


def _flags(f: dataclasses.Field) -> list[str]:
    return list(f.metadata["flags"]) or ["--" + f.name.replace("_", "-")]


def _base_type(tp) -> tuple[type, bool]:
    """(element type, is a list) of an annotation such as int, str | None or list[str]."""
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (args[0] if args else tp), False


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls, *, role: str | None = None,
                  only: Iterable[str] | None = None, skip: Iterable[str] = ()) -> None:
    """Flags for the settings fields of `cls` (those of `role` only, if given)."""
    hints = typing.get_type_hints(cls)
    only = set(only) if only is not None else None
    for f in _settings_fields(cls, role):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        md = f.metadata
        kind, is_list = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "help": md["help"] or None, "default": _default(f)}
        shown = kwargs["help"] and kwargs["help"] is not argparse.SUPPRESS and "default" not in kwargs["help"]
        if shown and kind is not bool and not is_list and kwargs["default"] is not None:
            # argparse adds a boolean's default itself; %(default)s: a PDSERVE_ variable's value, where one is set
            kwargs["help"] += " (default: %(default)s)"
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if md["choices"]:
                kwargs["choices"] = md["choices"]
            if md["metavar"]:
                kwargs["metavar"] = md["metavar"]
            if is_list:
                kwargs["action"] = _Extend if md["several"] else _Append
                kwargs["default"] = None            # argparse appends to a given default
                if md["several"]:
                    kwargs["nargs"] = "+"
        parser.add_argument(*_flags(f), **kwargs)


def env_defaults(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    """Let PDSERVE_<DEST> set any flag's default, in every subcommand. Values go through
    the flag's type conversion; settings validate them. A boolean also reads
    PDSERVE_NO_<DEST>=1 as false."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                env_defaults(sub, environ)
            continue
        if not action.option_strings or action.dest in ("help", argparse.SUPPRESS):
            continue
        name = env_name(action.dest)
        value = environ.get(name)
        if isinstance(action, argparse.BooleanOptionalAction):
            negated = environ.get(ENV_PREFIX + "NO_" + action.dest.upper())
            if value is None and negated is not None:
                value, name = ("0" if _parse_bool(negated, name) else "1"), ENV_PREFIX + "NO_" + action.dest.upper()
            if value is not None:
                action.default = _parse_bool(value, name)
        elif value is None:
            continue
        elif isinstance(action, argparse._AppendAction):
            action.default = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            action.default = _parse_bool(value, name) ^ isinstance(action, argparse._StoreFalseAction)
        else:
            action.default = value


def _parse_bool(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {', '.join(_TRUE + _FALSE[:-1])}")


def from_args(cls, namespace: argparse.Namespace, **overrides):
    """A settings object from parsed flags (fields the namespace lacks keep defaults)."""
    kwargs = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)
              if f.init and hasattr(namespace, f.name)}
    for f in dataclasses.fields(cls):                   # an append flag given no value
        if kwargs.get(f.name, 0) is None and f.default_factory is list:
            kwargs[f.name] = []
    kwargs.update(overrides)
    return cls(**kwargs)


def to_argv(settings, skip: Iterable[str] = ()) -> list[str]:
    """`settings` as the flags that build it again: every setting of its role, so the
    child sees exactly these values whatever its own environment says."""
    skip = set(skip)
    out: list[str] = []
    for f in _settings_fields(type(settings), getattr(settings, "role", None)):
        value = getattr(settings, f.name)
        if f.name in skip or value is None:
            continue
        flag = _flags(f)[0]
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            for v in value:
                out.append(f"{flag}={v}")
        else:
            out.append(f"{flag}={value}")
    return out


def copy_fields(source, cls, **overrides):
    """A `cls` settings object taking every field `source` also has."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {f.name: getattr(source, f.name) for f in dataclasses.fields(source) if f.name in names}
    kwargs.update(overrides)
    return cls(**kwargs)
