#!/usr/bin/env python3
"""Generate docs/configuration.md from the command line's own definitions.

    python scripts/configuration_docs.py           # (re)write docs/configuration.md
    python scripts/configuration_docs.py --check   # exit 1 if docs/configuration.md is out of date

The page lists every flag of `memserve up | profile | bench | simulate` (and `bench
compare`) as ``memserve.cli.build_parser`` defines it: one table per subcommand and
argument group, with each flag's default and help text. Defaults are taken with no
environment variable set; a default that an environment variable supplies is named.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "configuration.md"
REGENERATE = "python scripts/configuration_docs.py"
NONE = "—"

INTRO = f"""\
# Configuration reference

Every flag of `memserve up`, `memserve profile`, `memserve bench` (with `memserve bench
compare`) and `memserve simulate`, with its default and what it does. The guides in this
folder explain how the flags work together; this page is the complete list.

This page is generated from the command line's own definitions
(`memserve.cli.build_parser`) by `scripts/configuration_docs.py`; do not edit it by hand.
After adding or changing a flag, regenerate it with `{REGENERATE}`;
`{REGENERATE} --check` and `tests/project/test_configuration_docs.py` fail while it is out of
date. Defaults are shown as they are when no environment variable is set.
"""


class _RecordingEnviron(dict):
    """An empty environment that remembers which variables were read."""

    def __init__(self, values: dict[str, str] | None = None) -> None:
        super().__init__(values or {})
        self.read: list[str] = []

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.append(key)
        return super().__contains__(key)


def _build(environ: _RecordingEnviron) -> argparse.ArgumentParser:
    from memserve.cli import build_parser

    with mock.patch.object(os, "environ", environ):
        return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(full command, parser, its one-line help) of every subcommand, depth first, in
    definition order."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((sub.prog, sub, helps.get(name, "")))
                found.extend(_subparsers(sub))
    return found


def _documented(action: argparse.Action) -> bool:
    return not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) \
        and action.help is not argparse.SUPPRESS


def _env_defaults(parser: argparse.ArgumentParser, read: list[str]) -> dict[tuple[str, str], str]:
    """(command, dest) -> the environment variable that sets that flag's default."""
    result = {}
    base = {(prog, a.dest): a.default for prog, sub, _ in _subparsers(parser) for a in sub._actions}
    for name in dict.fromkeys(read):
        sentinel = f"<{name}>"
        changed = _build(_RecordingEnviron({name: sentinel}))
        for prog, sub, _ in _subparsers(changed):
            for action in sub._actions:
                if action.default == sentinel and base.get((prog, action.dest)) != sentinel:
                    result[(prog, action.dest)] = name
    return result


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_escape(text)}`"


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return _code(action.metavar or action.dest)
    names = ", ".join(_code(o) for o in action.option_strings)
    if isinstance(action.metavar, str):
        names += f" {_code(action.metavar)}"
    return names


def _length_spec(value) -> str | None:
    """A workload length distribution written as its command-line form."""
    kind, a, b = (getattr(value, name, None) for name in ("kind", "a", "b"))
    if not isinstance(kind, str) or not isinstance(a, (int, float)):
        return None
    a, b = f"{a:g}", f"{b:g}" if isinstance(b, (int, float)) else ""
    forms = {"fixed": a, "uniform": f"uniform:{a}:{b}", "normal": f"normal:{a}:{b}", "exp": f"exp:{a}"}
    return forms.get(kind)


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS:
        return NONE
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if value is (not action.const) else "on"
    # A flag written as a word (`N|auto`) whose parsed value is the default: show the word.
    if isinstance(action.metavar, str) and callable(action.type):
        for word in re.findall(r"[a-z][a-z-]*", action.metavar):
            try:
                if action.type(word) == value:
                    return _code(word)
            except (argparse.ArgumentTypeError, TypeError, ValueError):
                pass
    if isinstance(value, bool):
        return _code(str(value).lower())
    if isinstance(value, str):
        return _code(value) if value else '`""`'
    if isinstance(value, (int, float)):
        return _code(repr(value))
    if isinstance(value, dict) and not value:
        return "`{}`"
    if isinstance(value, (list, tuple)):
        return _code(",".join(str(v) for v in value))
    spec = _length_spec(value)
    return _code(spec if spec is not None else str(value))


def _sentence(text: str) -> str:
    return text if not text or text[-1] in ".!?" else text + "."


def _help(action: argparse.Action, prog: str, env: str | None, exclusive: list[str]) -> str:
    text = action.help or ""
    if "%" in text:
        params = dict(vars(action), prog=prog)
        for key in list(params):
            if params[key] is argparse.SUPPRESS:
                del params[key]
        if params.get("choices") is not None:
            params["choices"] = ", ".join(str(c) for c in params["choices"])
        text = text % params
    text = " ".join(text.split())
    parts = [_escape(_sentence(text))] if text else []
    if action.choices is not None:
        parts.append("One of " + ", ".join(_code(str(c)) for c in action.choices) + ".")
    if exclusive:
        parts.append("Not together with " + ", ".join(_code(o) for o in exclusive) + ".")
    if env:
        parts.append(f"Default from `{env}` when set.")
    if action.required and action.option_strings:
        parts.append("Required.")
    return " ".join(parts)


def _exclusive(parser: argparse.ArgumentParser, action: argparse.Action) -> list[str]:
    """The first option string of each flag that may not be given with ``action``."""
    others = []
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            others += [a.option_strings[0] for a in group._group_actions if a is not action and a.option_strings]
    return others


def render() -> str:
    """The Markdown of docs/configuration.md."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from memserve.cli import build_parser

    build_parser()  # imports every module under the real environment before it is swapped out
    environ = _RecordingEnviron()
    parser = _build(environ)
    env_defaults = _env_defaults(parser, environ.read)
    out = [INTRO]
    for prog, sub, summary in _subparsers(parser):
        out.append(f"## `{prog}`\n")
        summary = " ".join((sub.description or summary).split())
        if summary:
            out.append(_sentence(summary[0].upper() + summary[1:]) + "\n")
        groups = [(g.title, [a for a in g._group_actions if _documented(a)]) for g in sub._action_groups]
        groups = [(title, actions) for title, actions in groups if actions]
        for title, actions in groups:
            if len(groups) > 1:
                out.append(f"### {title}\n")
            out.append("| flag | default | description |")
            out.append("| --- | --- | --- |")
            for action in actions:
                env = env_defaults.get((prog, action.dest))
                help_text = _help(action, prog, env, _exclusive(sub, action))
                out.append(f"| {_flag(action)} | {_default(action)} | {help_text} |")
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with docs/configuration.md instead of writing it; exit 1 if they differ")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/configuration.md",
                                    "generated", lineterm="", n=0)
        lines = list(diff)
        print("\n".join(lines[:40] + (["..."] if len(lines) > 40 else [])), file=sys.stderr)
        print(f"docs/configuration.md is out of date with memserve's flags; regenerate it with: {REGENERATE}",
              file=sys.stderr)
        return 1
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
