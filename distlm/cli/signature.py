"""A verb's command line, read from its Python signature.

A verb is a plain function with typed parameters; this module turns the signature into
an argparse sub-command and calls the function with what was parsed:

    parameter before ``/`` (positional-only)  ->  a positional argument
    keyword parameter ``max_new_tokens``      ->  ``--max-new-tokens``
    no default                                ->  required
    ``bool = False``                          ->  a switch (``--json``)
    ``Literal["cpu", "cuda"]``                ->  choices
    ``Optional[int]``                         ->  an int, default None
    ``Sequence[str]``                         ->  several values (one or more; any number with a default)
    ``Annotated[T, "text"]``                  ->  the help line
    ``int`` / ``float``                       ->  shown as N / X (``--max-new-tokens N``)

The docstring's first line is the verb's line in ``distlm --help``; the whole docstring is
the description of ``distlm VERB --help``. A parameter name that means the same thing in
every verb (``checkpoint``, ``config``) gets its metavar and help from ``shared``, so they
are written once.
"""
from __future__ import annotations

import argparse
import collections.abc
import inspect
import types
import typing
from typing import Any, Callable, Literal, Union


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Docstrings keep their line breaks; every flag's help ends with its default, except
    where the default says nothing (None, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default is not None and default is not False
                and default is not argparse.SUPPRESS and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


class _Once(argparse.Action):
    """Store a flag's value; the same flag twice is a usage error naming both values, since
    letting the last one win silently hides a slip in a long command line."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).setdefault("_given", {})
        if self.dest in given:
            parser.error(f"{option_string} given twice ({given[self.dest]} and {values}); give it once")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


def _unwrap(hint: Any) -> tuple[Any, str]:
    """(the type without Annotated/Optional, the help text from Annotated)."""
    text = ""
    if typing.get_origin(hint) is typing.Annotated:
        hint, *meta = typing.get_args(hint)
        text = next((m for m in meta if isinstance(m, str)), "")
    if typing.get_origin(hint) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported union {hint}")
        hint = rest[0]
    return hint, text


def _argument(param: inspect.Parameter, hint: Any, text: str, shared: dict) -> tuple[list[str], dict]:
    """The names and keywords of one ``add_argument`` call."""
    kw: dict[str, Any] = {"help": (text or shared.get("help", "")).replace("%", "%%")}
    if "metavar" in shared:
        kw["metavar"] = shared["metavar"]
    required = param.default is inspect.Parameter.empty
    origin = typing.get_origin(hint)
    if origin in (list, collections.abc.Sequence):
        kw.update(nargs="+" if required else "*", type=typing.get_args(hint)[0])
    elif origin is Literal:
        choices = typing.get_args(hint)
        kw.update(choices=list(choices), type=type(choices[0]))
    elif hint is bool:
        if param.default is not False:
            raise TypeError(f"{param.name}: a switch must default to False")
        kw["action"] = "store_true"
    else:
        kw["type"] = hint
        if hint in (int, float) and "metavar" not in kw:
            kw["metavar"] = "N" if hint is int else "X"
    if not required:
        kw["default"] = list(param.default) if origin in (list, collections.abc.Sequence) else param.default
    if param.kind is inspect.Parameter.POSITIONAL_ONLY:
        kw.setdefault("metavar", param.name.upper())
        return [param.name], kw
    if "nargs" not in kw and "action" not in kw:
        kw["action"] = _Once
    kw.update(dest=param.name, required=required)
    return ["--" + param.name.replace("_", "-")], kw


def add_verb(subparsers, name: str, fn: Callable[..., int], shared: dict[str, dict]) -> argparse.ArgumentParser:
    """Add ``distlm NAME`` for ``fn``; ``shared`` maps parameter names to their common
    metavar/help."""
    doc = inspect.getdoc(fn) or ""
    p = subparsers.add_parser(name, help=doc.split("\n")[0], description=doc, formatter_class=HelpFormatter,
                              allow_abbrev=False)  # an abbreviation would change meaning when a flag is added
    hints = typing.get_type_hints(fn, include_extras=True)
    for param in inspect.signature(fn).parameters.values():
        names, kw = _argument(param, *_unwrap(hints[param.name]), shared.get(param.name, {}))
        p.add_argument(*names, **kw)
    p.set_defaults(_fn=fn)
    return p


def takes(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def call(fn: Callable[..., int], namespace: argparse.Namespace) -> int:
    """``fn`` with the parsed values: positional-only parameters by position, the rest by name."""
    args, kwargs = [], {}
    for param in inspect.signature(fn).parameters.values():
        value = getattr(namespace, param.name)
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[param.name] = value
    return fn(*args, **kwargs)
