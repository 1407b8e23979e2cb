"""Command-line options declared once, on the fields of the config dataclasses.

A config field made with :func:`option` carries its help (and, where the command line differs
from the field, its flag, choices, command-line default or converter); :func:`add_options` turns
such fields into argparse options (default and type from the field) and :func:`config_kwargs`
turns the parsed values back into the config's arguments. :class:`EnvParser` reads the
``SPLITSERVE_<OPTION>`` variables (through splitserve.settings, where every variable is read).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from splitserve.settings import option_value

ENV_PREFIX = "SPLITSERVE_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SAME = object()  # the command line's default is the field's
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """How a config field appears on the command line."""

    help: str
    flag: str | None = None  # default: --field-name
    choices: tuple[str, ...] | None = None
    cli_default: Any = _SAME  # for required fields, or where the command line's default differs
    convert: Callable[[str], Any] | None = None  # the option's string -> the field's value


def option(default: Any = dataclasses.MISSING, help: str = "", **kw: Any) -> Any:
    """A dataclass field that is also a command-line option (``kw``: see :class:`Option`)."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **kw)})


def _option_fields(cls: type, names: Iterable[str] | None) -> list[dataclasses.Field]:
    fields = {f.name: f for f in dataclasses.fields(cls) if "option" in f.metadata}
    if names is None:
        return list(fields.values())
    return [fields[name] for name in names]


def flag_of(cls: type, name: str) -> str:
    """The long option of config field ``name``: ``--kv-cache-mb`` for ``kv_cache_mb``."""
    opt: Option = next(f for f in dataclasses.fields(cls) if f.name == name).metadata["option"]
    return opt.flag or "--" + name.replace("_", "-")


def _field_type(f: dataclasses.Field) -> type:
    name = str(f.type).replace(" | None", "").replace("None | ", "").strip()
    return _TYPES.get(name, str)  # anything else arrives as a string (see Option.convert)


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    names: Iterable[str] | None = None,
    *,
    unset: bool = False,
) -> None:
    """Add the option fields of ``cls`` (all, or ``names`` in that order) to ``parser``; each
    option's dest is its field's name. ``unset``: every default is None (the value is forwarded
    only when given, and the receiving config's default applies otherwise)."""
    for f in _option_fields(cls, names):
        opt: Option = f.metadata["option"]
        flag = flag_of(cls, f.name)
        default = f.default if opt.cli_default is _SAME else opt.cli_default
        help = opt.help
        if unset:
            help += f" (default: {default})" if default not in (None, "") else ""
            default = None
        elif default not in (None, "") and not isinstance(default, bool):
            help += " (default: %(default)s)"
        if _field_type(f) is bool:  # a switch that stores the opposite of the field's default
            parser.add_argument(
                flag,
                dest=f.name,
                action="store_const",
                const=not f.default,
                default=default,
                help=help,
            )
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                type=_field_type(f),
                default=default,
                choices=opt.choices,
                metavar=None if opt.choices else flag[2:].upper().replace("-", "_"),
                help=help,
            )


def config_kwargs(cls: type, args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The arguments of ``cls`` from parsed options (those ``args`` has and that are not None;
    converted by their ``Option.convert``), updated by ``overrides``. Raises ``ValueError``
    naming the option of a value its converter rejects."""
    kwargs = {}
    for f in _option_fields(cls, None):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        convert = f.metadata["option"].convert
        if convert is not None:
            try:
                value = convert(value)
            except ValueError as exc:
                raise ValueError(f"{flag_of(cls, f.name)}: {exc}") from None
        kwargs[f.name] = value
    return kwargs | overrides


def env_name(action: argparse.Action) -> str:
    """SPLITSERVE_ and the long option in upper snake case: --redis-url -> SPLITSERVE_REDIS_URL."""
    flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class EnvParser(argparse.ArgumentParser):
    """An ArgumentParser whose options, after ``read_environment()``, take their defaults from
    SPLITSERVE_<OPTION> variables; an option given on the command line still wins. Empty
    variables count as unset. Read at parse time, so a bad value fails only the command that
    would use it."""

    _env_actions: dict[str, tuple[argparse.Action, object]] | None = None

    def read_environment(self) -> None:
        self._env_actions = {}
        for action in self._actions:
            if not action.option_strings or isinstance(
                action, argparse._HelpAction | argparse._VersionAction
            ):
                continue
            name = env_name(action)
            self._env_actions[name] = (action, action.default)
            action.help = f"{action.help} [env {name}]" if action.help else f"[env {name}]"

    @property
    def env_names(self) -> tuple[str, ...]:
        return tuple(self._env_actions or ())

    def _env_value(self, name: str, action: argparse.Action, raw: str, default: object) -> object:
        if action.nargs == 0:  # store_true / store_false / store_const: a switch
            if raw.lower() in _TRUE:
                return action.const
            if raw.lower() in _FALSE:
                return default
            self.error(f"{name}={raw!r}: give 1/true/yes/on or 0/false/no/off")
        convert = action.type or str
        try:
            # NOTE: argparse's types allow a registered type's name; these parsers give callables.
            value = convert(raw)  # pyright: ignore[reportCallIssue]
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            kind = getattr(convert, "__name__", repr(convert))
            self.error(f"{name}={raw!r}: invalid {kind} value (for {action.option_strings[0]})")
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(repr(c) for c in action.choices)
            self.error(f"{name}={raw!r}: invalid choice (choose from {choices})")
        return [value] if isinstance(action, argparse._AppendAction) else value

    def parse_known_args(self, args=None, namespace=None):
        for name, (action, default) in (self._env_actions or {}).items():
            raw = option_value(name)
            action.default = self._env_value(name, action, raw, default) if raw else default
        return super().parse_known_args(args, namespace)
