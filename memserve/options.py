"""Configuration options declared once, on their dataclass fields.

``option()`` is ``dataclasses.field()`` plus what the command line needs: the flag, its
help, choices, argument type, group and an environment variable that supplies its
default. ``add_options`` makes the argparse arguments from those fields and
``from_namespace`` builds the dataclass back from the parsed namespace, so a flag, its
default and its field cannot drift apart.

Invariants:

- The field's default is the flag's default; only an ``env`` variable, read when the
  parser is built, replaces it (so the generated docs can name the variable).
- A boolean field without choices is a switch: its flag turns a False default on and a
  True default off (so the latter's flag reads ``--no-...``). Switches store under the field's name;
  value flags under argparse's own name for them, so ``--help`` shows the metavar
  argparse derives from the flag.
- ``choices`` given as a mapping offers its keys on the command line and stores the
  value of the key chosen (``on``/``off`` for a bool).
- A field whose choices live in an application's registry (which the library declaring
  the field may not import) says ``choices=REGISTERED``; the command line binds each
  such field's choices by name, and a field left unbound, or a binding naming no such
  field, is an error.
- A field with a ``default_factory`` has no flag default: a flag not given leaves it to
  the factory.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")
_KEY = "memserve.option"


class _Registered:
    """The choices of a field bound by the command line (``REGISTERED``)."""

    def __repr__(self) -> str:
        return "REGISTERED"


REGISTERED = _Registered()

Choices = Sequence[str] | Mapping[str, Any] | _Registered


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line."""

    help: str | None
    flags: tuple[str, ...]  # empty: --<field-name>
    choices: Choices | None
    type: Callable[[str], Any] | None
    metavar: str | None
    group: str | None  # an argument group's title; None: the parser's own options
    exclusive: str | None  # fields naming the same one are mutually exclusive
    env: str | None
    nargs: str | None
    const: Any
    append: bool  # repeatable: the values given, in a list


def option(default: Any = MISSING, *, help: str | None = None, flags: Sequence[str] = (),
           choices: Choices | None = None, type: Callable[[str], Any] | None = None,
           metavar: str | None = None, group: str | None = None, exclusive: str | None = None,
           env: str | None = None, nargs: str | None = None, const: Any = None, append: bool = False,
           default_factory: Callable[[], Any] | None = None, repr: bool = True) -> Any:
    """A dataclass field that is also a command-line flag."""
    meta = {_KEY: Flag(help, tuple(flags), choices, type, metavar, group, exclusive, env, nargs, const, append)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta, repr=repr)
    return field(default=default, metadata=meta, repr=repr)


def flag_of(f: Field) -> Flag | None:
    """The field's flag, or None when it is not on the command line."""
    return f.metadata.get(_KEY)


def _names(f: Field, flag: Flag) -> tuple[str, ...]:
    return flag.flags or ("--" + f.name.replace("_", "-"),)


def _switch(f: Field, flag: Flag) -> bool:
    return isinstance(f.default, bool) and flag.choices is None


def _dest(f: Field, flag: Flag) -> str:
    if _switch(f, flag):
        return f.name
    return next(n for n in _names(f, flag) if n.startswith("--"))[2:].replace("-", "_")


def _arguments(f: Field, flag: Flag, choices: Sequence[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``add_argument``'s keywords for field ``f``."""
    if _switch(f, flag):
        return {"dest": f.name, "action": "store_false" if f.default else "store_true", "help": flag.help}
    default = None if f.default is MISSING else f.default
    if isinstance(choices, Mapping):
        default = next(word for word, value in choices.items() if value == default)
    if flag.env:
        default = os.environ.get(flag.env, default)
    kwargs = {"default": default, "help": flag.help, "metavar": flag.metavar,
              "choices": list(choices) if choices is not None else None}
    if flag.append:
        kwargs["action"] = "append"
    for key in ("type", "nargs", "const"):
        if getattr(flag, key) is not None:
            kwargs[key] = getattr(flag, key)
    return kwargs


def add_options(parser: argparse.ArgumentParser, *classes: type, only: Sequence[str] | None = None,
                registries: Mapping[str, Sequence[str]] | None = None) -> None:
    """Add the flags of ``classes``' fields to ``parser``, in field order (``only``: just
    the fields so named), each in its argument group. ``registries`` binds the choices
    of the ``REGISTERED`` fields by field name."""
    registries = dict(registries or {})
    groups: dict[str | None, Any] = {None: parser}
    exclusive: dict[tuple[str | None, str], Any] = {}
    for cls in classes:
        for f in fields(cls):
            flag = flag_of(f)
            if flag is None or (only is not None and f.name not in only):
                continue
            choices = flag.choices
            if isinstance(choices, _Registered):
                if f.name not in registries:
                    raise ValueError(f"{cls.__name__}.{f.name}: its choices are not bound")
                choices = registries.pop(f.name)
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            target = groups[flag.group]
            if flag.exclusive:
                key = (flag.group, flag.exclusive)
                if key not in exclusive:
                    exclusive[key] = target.add_mutually_exclusive_group()
                target = exclusive[key]
            target.add_argument(*_names(f, flag), **_arguments(f, flag, choices))
    if registries:
        raise ValueError(f"choices bound to fields without REGISTERED choices: {sorted(registries)}")


def from_namespace(cls: type[T], namespace: argparse.Namespace, **given: Any) -> T:
    """``cls`` made from the parsed flags of its fields, plus the fields ``given``."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        flag = flag_of(f)
        if flag is None or f.name in given:
            continue
        value = getattr(namespace, _dest(f, flag))
        if isinstance(flag.choices, Mapping):
            value = flag.choices[value]
        if value is None and f.default_factory is not MISSING:
            continue
        values[f.name] = value
    return cls(**values, **given)


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError("must be in [0, 1]")
    return value


def json_object(text: str) -> dict:
    """A flag's JSON object; what its keys mean is checked by whoever reads it."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
