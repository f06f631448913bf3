"""Settings written once: a frozen dataclass field carries its default and its help, and the CLI is built from it.

    @dataclass(frozen=True)
    class LinkConfig:
        refresh_s: float = setting(30.0, "how often links are re-measured")

    @dataclass(frozen=True)
    class PeerConfig:
        port: int = setting(0, "port to listen on (0: any free)")
        links: LinkConfig = component(LinkConfig, prefix="link")     # --link-refresh-s

    add_arguments(parser, PeerConfig)                 # one option per leaf field, one group per component
    config = from_arguments(PeerConfig, parser.parse_args())

A field's option is ``--<prefix>-<name>`` with underscores as dashes, or the ``flag`` it names: ``--initial-peers``
as written, ``no-plan`` (no dashes in front) after the prefix, ``--<prefix>-no-plan``. A bool that
defaults to False is a switch that turns it on; one that defaults to True needs a ``flag`` that turns it off
(``--no-plan``). Values are checked by the dataclass itself (``__post_init__`` raises ValueError), so the CLI,
tests and code that builds a config by hand all get the same checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field with its default and its one-line help (and, optionally, its option's name)."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


def component(cls: type[Any], prefix: str = "") -> Any:
    """A field holding a component's config; its fields become options named ``--<prefix>-<field>``."""
    return dataclasses.field(default_factory=cls, metadata={"component": True, "prefix": prefix})


def positive(config: object, *names: str) -> None:
    """For a config's ``__post_init__``: ValueError unless each named field is None or > 0."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}_{name}" if prefix else name


def _flag(prefix: str, name: str) -> str:
    return "--" + _dest(prefix, name).replace("_", "-")


def _named_flag(prefix: str, flag: str) -> str:
    """A setting's own flag: as written when it starts with --, else after the component's prefix."""
    return flag if flag.startswith("--") else "--" + (f"{prefix}-{flag}" if prefix else flag)


def _scalar_type(hint: Any) -> tuple[type, bool]:
    """(the type an option parses to, whether the field is a tuple of it)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _scalar_type(args[0])
    if typing.get_origin(hint) is tuple:
        return args[0], True
    return hint, False


def add_arguments(
    parser: argparse.ArgumentParser, cls: type[Any], prefix: str = "", group: Any = None
) -> None:
    """Add one option per leaf field of dataclass ``cls`` (recursing into components, one group each)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("component"):
            sub = hints[f.name]
            title = (sub.__doc__ or f.name).strip().splitlines()[0]
            add_arguments(parser, sub, f.metadata["prefix"] or prefix, parser.add_argument_group(title))
            continue
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} has no help: declare it with setting()")
        _add_option(group or parser, f, hints[f.name], prefix)


def _add_option(parser: Any, f: dataclasses.Field[Any], hint: Any, prefix: str) -> None:
    meta = f.metadata
    flag = _named_flag(prefix, meta["flag"]) if meta["flag"] else _flag(prefix, f.name)
    dest = _dest(prefix, f.name)
    kind, many = _scalar_type(hint)
    if kind is bool:
        if f.default is True and not meta["flag"]:
            raise TypeError(f"{f.name} defaults to True: give it a flag that turns it off (--no-...)")
        action = "store_false" if f.default is True else "store_true"
        parser.add_argument(flag, dest=dest, action=action, help=meta["help"])
        return
    shown = "" if f.default in (None, (), "") else f" (default: {f.default})"
    parser.add_argument(
        flag,
        dest=dest,
        type=kind,
        nargs="*" if many else None,
        default=f.default,
        choices=meta["choices"],
        metavar=meta["metavar"],
        help=meta["help"] + shown,
    )


def from_arguments(cls: type[T], args: argparse.Namespace, prefix: str = "") -> T:
    """Build ``cls`` from parsed options (ValueError from its checks propagates)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("component"):
            values[f.name] = from_arguments(hints[f.name], args, f.metadata["prefix"] or prefix)
            continue
        value = getattr(args, _dest(prefix, f.name))
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)
