"""The command line every stage parses: tyro over the stage's Args, `none` for None, the flags given recorded for
--resume, and --help listing the flags by importance under headings (tyro's own prints one flat box)."""

import ast
import inspect
import os
import shutil
import sys
import textwrap
import typing
from dataclasses import MISSING, fields
from typing import Literal, Optional


def given_flags(argv: list[str], cls) -> frozenset[str]:
    """The fields of the dataclass cls that the command line argv gives a value: --name, --name=value, and a bool's
    --no-name."""
    names = {f.name for f in fields(cls)}
    given = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=")[0].replace("-", "_")
        if name not in names and name.startswith("no_"):
            name = name[3:]
        if name in names:
            given.add(name)
    return frozenset(given)


def none_spelled_lower(argv: list[str], cls) -> list[str]:
    """argv with `none` as the value of an Optional flag spelled as tyro reads it, `None` (--cliprange none reads like
    --rm-ckpt none); not where `none` is one of the flag's own choices (--reward-norm none is the choice)."""
    hints = typing.get_type_hints(cls)
    optional = set()
    for f in fields(cls):
        choices = [value for arg in typing.get_args(hints[f.name]) for value in typing.get_args(arg)]
        if type(None) in typing.get_args(hints[f.name]) and "none" not in choices:
            optional.add(f.name)
    spelled = list(argv)
    for i, token in enumerate(argv):
        name, is_pair, value = token[2:].partition("=")
        if not token.startswith("--") or name.replace("-", "_") not in optional:
            continue
        if is_pair and value == "none":
            spelled[i] = f"--{name}=None"
        elif not is_pair and i + 1 < len(argv) and argv[i + 1] == "none":
            spelled[i + 1] = "None"
    return spelled


def parse(cls, defaults_help: Optional[dict] = None):
    """tyro.cli(cls) (`none` for None too), with the flags the command line gave as args.given (not a field):
    --resume counts a given flag as given whatever its value (checkpoints.resume_args). -h, --help: print_help."""
    import tyro

    argv = none_spelled_lower(sys.argv[1:], cls)
    if "-h" in argv or "--help" in argv:
        try:
            print_help(cls, defaults_help or {})
        except BrokenPipeError:  # `--help | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    args = tyro.cli(cls, args=argv)
    args.given = given_flags(argv, cls)
    return args


def field_docs(klass) -> dict[str, tuple[str, str]]:
    """{field: (its docstring, the `# --- group` comment above it)} of the fields a class itself declares."""
    source = textwrap.dedent(inspect.getsource(klass))
    lines = source.splitlines()
    body = ast.parse(source).body[0].body
    docs, group, last_line = {}, "", 0
    for node, following in zip(body, body[1:] + [None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        for line in lines[last_line : node.lineno - 1]:  # the comments between the previous field and this one
            if line.strip().startswith("# ---"):
                group = line.strip().removeprefix("# ---").strip()
        last_line = node.lineno
        doc = ""
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            doc = " ".join(str(following.value.value).split())
        docs[node.target.id] = (doc, group)
    return docs


def flag_type(hint) -> str:
    """A type as --help shows it: INT, {a,b}, STR|None, FLOAT [FLOAT ...]."""
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "{" + ",".join(str(member) for member in members) + "}"
    if origin is list:
        name = flag_type(members[0])
        return f"{name} [{name} ...]"
    if origin is typing.Union:  # Optional[X]
        inner = [member for member in members if member is not type(None)]
        return flag_type(inner[0]) + "|None"
    return getattr(hint, "__name__", str(hint)).upper()


def print_help(cls, defaults_help: dict) -> None:
    """The flags of a stage's Args by importance: its own first, then each base class's under the first line of its
    docstring; an entry a flag with its type and default, the description wrapped at whole words. defaults_help:
    what a default means where the value alone does not say (a recipe's None)."""
    hints = typing.get_type_hints(cls)
    script = os.path.basename(sys.argv[0])
    print(f"usage: python {script} [--flag VALUE ...]   (`none` gives an Optional flag None)")
    shown = set()
    for klass in cls.__mro__:
        if "__dataclass_fields__" not in klass.__dict__ or klass is object:
            continue
        docs = {name: doc for name, doc in field_docs(klass).items() if name not in shown}
        if not docs:
            continue
        heading = f"{script}'s own flags" if klass is cls else inspect.getdoc(klass).splitlines()[0]
        print(f"\n{heading}")
        group = None
        for name, (doc, field_group) in docs.items():
            shown.add(name)
            if field_group != group and field_group:
                print(f"  {field_group}:")
            group = field_group
            print(textwrap.indent(flag_entry(cls, name, hints[name], doc, defaults_help), "    "), end="")
    print()


def flag_entry(cls, name: str, hint, doc: str, defaults_help: dict) -> str:
    """One flag of --help: `--name TYPE (default: X)` and its description wrapped to the terminal."""
    field = cls.__dataclass_fields__[name]
    default = field.default if field.default is not MISSING else field.default_factory()
    flag = f"--{name.replace('_', '-')}"
    usage = f"{flag}, --no-{flag[2:]}" if hint is bool else f"{flag} {flag_type(hint)}"
    shown_default = defaults_help.get(name, " ".join(map(str, default)) if isinstance(default, list) else default)
    width = min(shutil.get_terminal_size((100, 20)).columns, 120) - 8
    text = textwrap.fill(doc, width, initial_indent="    ", subsequent_indent="    ") if doc else ""
    return f"{usage}  (default: {shown_default})\n" + (text + "\n" if text else "")
