"""The option tables of the docs, rendered from the optimizers' configs.

    python -m bench.tools.config_docs           # rewrite the tables in DOCS
    python -m bench.tools.config_docs --check   # exit 1 if a committed table differs

A table sits between ``<!-- options NAME -->`` (or ``<!-- options NAME: a b c -->``, just
those options) and ``<!-- /options -->``; ``NAME`` is a class of ``dobb``. A marker without
a list takes the options no other marker of that class in the same file lists. Rows follow
the constructor's order; each cell comes from the config (``dobb.optim.config``): the
default, the rule's allowed values, the two marks, and the field's docstring.

The registry's learning rates (``dobb.registry.TUNED_LR``, by width, and each entry's
default) sit between ``<!-- lrs -->`` and ``<!-- /lrs -->``.
"""

import argparse
import ast
import inspect
import re
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import dobb
from bench.tools.markdown import markdown_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/algorithm.md", "docs/baselines.md")
MARKER = re.compile(r"<!-- options (\w+)(?::([\w ]+))? -->\n(.*?)<!-- /options -->", re.S)
LRS = re.compile(r"<!-- lrs -->\n.*?<!-- /lrs -->", re.S)
HEADERS = ("option", "default", "allowed", "changes the update", "per group", "meaning")


def field_docstrings(config: type) -> dict[str, str]:
    """``{field: docstring}`` of ``config`` and its bases (the string under each field;
    a subclass's own docstring wins), each on one line."""
    docs: dict[str, str] = {}
    for klass in reversed(config.__mro__):
        if "__dataclass_fields__" not in vars(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, after in zip(body, body[1:]):
            text = getattr(getattr(after, "value", None), "value", None)
            if isinstance(stmt, ast.AnnAssign) and isinstance(text, str):
                docs[stmt.target.id] = " ".join(inspect.cleandoc(text).split())
    return docs


def cell(value) -> str:
    """A default as the docs write it: code, strings in double quotes."""
    text = f'"{value}"' if isinstance(value, str) else repr(value)
    return f"`{text}`"


def option_rows(cls: type, names: list[str]) -> list[tuple[str, ...]]:
    """One row per option of ``cls`` in ``names``, in the constructor's order."""
    config, docs = cls.Config, field_docstrings(cls.Config)
    by_name = {f.name: f for f in fields(config)}
    order = [n for n in inspect.signature(cls).parameters if n in by_name and n in names]
    rows = []
    for name in order:
        f = by_name[name]
        rule = f.metadata.get("rule")
        rows.append(
            (
                f"`{name}`",
                cell(f.default),
                (rule.want if rule else "any").replace("|", "\\|"),
                "yes" if f.metadata.get("math") else "",
                "yes" if name in config.group_options() else "",
                docs.get(name, "").replace("``", "`").replace("|", "\\|"),
            )
        )
    return rows


def render(text: str) -> str:
    """``text`` with every options table rendered afresh."""
    listed: dict[str, set[str]] = {}
    for match in MARKER.finditer(text):
        if match.group(2):
            listed.setdefault(match.group(1), set()).update(match.group(2).split())

    def table(match: re.Match) -> str:
        name, only = match.group(1), match.group(2)
        cls = getattr(dobb, name)
        every = [f.name for f in fields(cls.Config)]
        names = only.split() if only else [n for n in every if n not in listed.get(name, ())]
        unknown = sorted(set(names) - set(every))
        if unknown:
            raise ValueError(f"{name} has no option(s) {unknown}; it has {every}")
        body = markdown_table(HEADERS, option_rows(cls, names), pad=False)
        head = match.group(0)[: match.start(3) - match.start(0)]
        return f"{head}{body}\n<!-- /options -->"

    return LRS.sub(lambda _: f"<!-- lrs -->\n{lr_table()}\n<!-- /lrs -->", MARKER.sub(table, text))


def lr_table() -> str:
    """Every registry entry's recommended lr by width (``TUNED_LR``), its default (a model
    of no known width, and the class's), and its AdamW group's."""
    from dobb.registry import OPTIMIZERS, TUNED_LR

    widths = sorted({w for lrs in TUNED_LR.values() for w in lrs})
    rows = []
    for name, entry in OPTIMIZERS.items():
        tuned = TUNED_LR.get(name, {})
        options = ", ".join(f"{k}={v}" for k, v in entry.hyperparameters.items() if k != "lr")
        rows.append(
            (
                f"`{name}`",
                options or "the class's defaults",
                *(f"{tuned[w]:g}" if w in tuned else "" for w in widths),
                f"{entry.lr:g}",
                "-" if entry.scalar_lr is None else f"{entry.scalar_lr:g}",
            )
        )
    headers = ("entry", "settings", *(f"lr, width {w}" for w in widths), "default lr")
    return markdown_table((*headers, "AdamW group's lr"), rows, pad=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale tables")
    args = parser.parse_args()
    stale = []
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        rendered = render(text)
        if rendered != text:
            stale.append(doc)
            if not args.check:
                path.write_text(rendered)
    if stale:
        print(("stale: " if args.check else "rewrote: ") + ", ".join(stale))
        sys.exit(1 if args.check else 0)


if __name__ == "__main__":
    main()
