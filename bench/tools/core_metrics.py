"""Measures of the optimizer core, for issue #33's before/after.

    python -m bench.tools.core_metrics [--root DIR] [--json]

``--root`` is a checkout to measure (default: this one; another commit through
``git worktree add --detach DIR COMMIT``); its sources are read, and its ``dobb`` imported
in a child process, so any commit can be measured by this tool.

- **options**: for each matrix optimizer of the registry (``OPTIMIZERS``: the classes with a
  dataclass ``Config``), the fields of its ``Config``, and for each option the
  places its name is written in ``dobb/optim/``: name tokens (a variable, an attribute, a
  keyword) and string literals equal to it, from ``tokenize``, docstrings and comments not
  counted. Per optimizer, the mean over its options and over its own (options no other
  optimizer has); overall, the mean over every distinct option.
- **hooks**: the methods of the matrix optimizers' nearest common base class
  (``MatrixOptimizer``; none if it is not dobb's) that a subclass overrides, or that raise
  ``NotImplementedError`` or do nothing (a body of ``pass``, ``...``, or a return of an
  empty constant), with the subclasses overriding each. Dunder methods are torch.optim's
  protocol, not hooks, and are left out. With them, the driver's parts where the base's
  module defines them (``Core``, ``Local``): each of their methods and the subclasses
  (cores, placements) that override it.
- **longest**: the longest class and function in ``dobb/``, in lines of the ``def`` or
  ``class`` (decorators not counted).
- **code_lines**: the wheel's code lines, in total and per module, as ``.ci/code_lines.py``
  counts them (not docstrings, comments or blank lines).
- **imports**: dobb's import graph as ``bench.tools.import_graph`` reads and layers it:
  modules, edges, cycles among import-time imports, imports from a lower layer up.
"""

import argparse
import ast
import importlib.util
import inspect
import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

from bench.tools import import_graph

HERE = Path(__file__).resolve().parents[2]
DOBB_LAYERS = import_graph.LAYERS["dobb"]


def _load(path: Path):
    """The module at ``path``, loaded by path (``.ci`` is not a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


code_lines = _load(HERE / ".ci" / "code_lines.py")


def _introspect() -> dict:
    """In the child process, with the measured checkout first on ``sys.path``: the matrix
    optimizers' options, and the base class's hooks with the subclasses overriding each."""
    import dataclasses
    import importlib
    import pkgutil
    import textwrap

    import dobb.optim

    for info in pkgutil.walk_packages(dobb.optim.__path__, "dobb.optim."):
        importlib.import_module(info.name)
    from dobb.registry import OPTIMIZERS

    classes = {e.cls for e in OPTIMIZERS.values()}
    classes = {c for c in classes if dataclasses.is_dataclass(getattr(c, "Config", None))}
    classes = sorted(classes, key=lambda c: c.__name__)
    # the matrix optimizers' nearest common base (hooks only if it is dobb's)
    base = next(b for b in classes[0].__mro__ if all(issubclass(c, b) for c in classes))

    def subclasses(cls: type) -> list[type]:
        found = []
        for sub in cls.__subclasses__():
            found += [sub, *subclasses(sub)]
        return list(dict.fromkeys(c for c in found if c.__module__.startswith("dobb.")))

    def does_nothing(function) -> bool:
        body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
        body = [
            s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
        ]
        raises = any(
            isinstance(s, ast.Raise) and "NotImplementedError" in ast.unparse(s) for s in body
        )
        empty_return = (
            len(body) == 1
            and isinstance(body[0], ast.Return)
            and (body[0].value is None or ast.unparse(body[0].value) in ("None", "[]", "()", "{}"))
        )
        return raises or not body or all(isinstance(s, ast.Pass) for s in body) or empty_return

    own = base.__module__.startswith("dobb.")
    subs = subclasses(base) if own else []
    hooks = {}
    for name, member in vars(base).items() if own else ():
        if not inspect.isfunction(member) or name.startswith("__"):
            continue
        overriders = [c.__name__ for c in subs if name in vars(c)]
        if overriders or does_nothing(member):
            hooks[name] = overriders
    # the driver's parts, where the base's module has them: every method of each, with the
    # subclasses that override it
    module = sys.modules[base.__module__] if own else None
    parts = {}
    for part in [getattr(module, n, None) for n in ("Core", "Local")]:
        if not inspect.isclass(part):
            continue
        methods = [n for n, f in vars(part).items() if inspect.isfunction(f) and n[:2] != "__"]
        parts[f"{part.__module__}.{part.__qualname__}"] = {
            n: [c.__name__ for c in subclasses(part) if n in vars(c)] for n in methods
        }
    return {
        "dobb": dobb.__file__,
        "base": f"{base.__module__}.{base.__qualname__}",
        "subclasses": [c.__name__ for c in subs],
        "hooks": hooks,
        "parts": parts,
        "options": {c.__name__: [f.name for f in dataclasses.fields(c.Config)] for c in classes},
    }


def introspect(root: Path) -> dict:
    """``_introspect()`` run by a child Python on ``root``'s ``dobb``."""
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r})\n"
        "import ast, inspect, json\n"
        f"{inspect.getsource(_introspect)}\n"
        "print(json.dumps(_introspect()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout.splitlines()[-1])
    if not Path(found.pop("dobb")).is_relative_to(root):  # an installed dobb came first
        raise RuntimeError(f"the child process did not import {root}'s dobb")
    return found


def written(source: str) -> dict[str, int]:
    """How many times each name is written in ``source`` as code: name tokens and plain
    string literals (their value), docstrings and comments excluded."""
    docs = code_lines.docstring_lines(ast.parse(source))
    counts: dict[str, int] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.start[0] in docs:
            continue
        if token.type == tokenize.NAME:
            name = token.string
        elif token.type == tokenize.STRING:
            try:
                name = ast.literal_eval(token.string)
            except (ValueError, SyntaxError):  # an f-string
                continue
            if not isinstance(name, str):
                continue
        else:
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts


def _mean(values) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), 2) if values else None


def option_counts(root: Path, options: dict[str, list[str]]) -> dict:
    """Places each option is written in ``root``'s ``dobb/optim/``, per optimizer and in
    all, with the means the issue quotes."""
    totals: dict[str, int] = {}
    for path in sorted((root / "dobb" / "optim").rglob("*.py")):
        for name, n in written(path.read_text()).items():
            totals[name] = totals.get(name, 0) + n
    every = sorted({o for names in options.values() for o in names})
    counts = {o: totals.get(o, 0) for o in every}
    per_optimizer = {}
    for cls, names in options.items():
        others = {o for c, ns in options.items() if c != cls for o in ns}
        own = [o for o in names if o not in others]
        per_optimizer[cls] = {
            "options": len(names),
            "mean": _mean(counts[o] for o in names),
            "own_options": own,
            "own_mean": _mean(counts[o] for o in own),
        }
    return {"counts": counts, "mean": _mean(counts.values()), "per_optimizer": per_optimizer}


def longest(root: Path) -> dict:
    """The longest class and function of ``root``'s ``dobb/`` (lines of its ``def`` or
    ``class`` statement, decorators excluded)."""
    classes, functions = {}, {}
    for path in sorted((root / "dobb").rglob("*.py")):
        name = str(path.relative_to(root))
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                classes[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
        for function, n in code_lines.function_lengths(source).items():
            functions[f"{name}:{function}"] = n
    top = {}
    for kind, lengths in (("class", classes), ("function", functions)):
        where = max(lengths, key=lengths.get)
        top[kind] = {"name": where, "lines": lengths[where]}
    return top


def wheel_lines(root: Path) -> dict:
    """Code lines of every module of ``root``'s ``dobb/``, and their total."""
    modules = {
        str(p.relative_to(root)): code_lines.code_lines(p.read_text())
        for p in sorted((root / "dobb").rglob("*.py"))
    }
    return {"total": sum(modules.values()), "modules": modules}


def imports(root: Path) -> dict:
    """Modules, edges among them, cycles and upward imports of ``root``'s dobb."""
    edges = import_graph.import_edges(root)
    mods = import_graph.modules(root)
    inner = {edge: runs for edge, runs in edges.items() if edge[1] in mods}
    return {
        "modules": len(mods),
        "edges": len(inner),
        "deferred_edges": sum(not runs for runs in inner.values()),
        "cycles": import_graph.cycles([edge for edge, runs in inner.items() if runs]),
        "upward": [list(edge) for edge in import_graph.upward(inner, DOBB_LAYERS)],
        "unlayered": sorted(m for m in mods if import_graph.layer(m, DOBB_LAYERS) is None),
    }


def metrics(root: Path) -> dict:
    """Every measure of ``root`` (a checkout)."""
    root = root.resolve()
    found = introspect(root)
    return {
        "root": str(root),
        "options": option_counts(root, found["options"]),
        "hooks": {k: found[k] for k in ("base", "subclasses", "hooks", "parts")},
        "longest": longest(root),
        "code_lines": wheel_lines(root),
        "imports": imports(root),
    }


def summary(m: dict) -> str:
    """The measures in a few lines."""
    options, hooks, top = m["options"], m["hooks"], m["longest"]
    lines = [f"options: {len(options['counts'])}, written {options['mean']} times on average"]
    for cls, o in options["per_optimizer"].items():
        lines.append(
            f"  {cls}: {o['options']} options, mean {o['mean']}; "
            f"{len(o['own_options'])} its own, mean {o['own_mean']}"
        )
    lines.append(f"hooks of {hooks['base']}: {len(hooks['hooks'])}")
    for name, overriders in hooks["hooks"].items():
        lines.append(f"  {name}: {', '.join(overriders) or '(no override)'}")
    for part, methods in hooks["parts"].items():
        lines.append(f"methods of {part}: {len(methods)}")
        for name, overriders in methods.items():
            lines.append(f"  {name}: {', '.join(overriders) or '(no override)'}")
    for kind in ("class", "function"):
        lines.append(f"longest {kind}: {top[kind]['name']} ({top[kind]['lines']} lines)")
    modules = m["code_lines"]["modules"]
    largest = sorted(modules, key=modules.get, reverse=True)[:3]
    lines.append(
        f"code lines: {m['code_lines']['total']} in {len(modules)} modules "
        f"(largest: {', '.join(f'{n} {modules[n]}' for n in largest)})"
    )
    g = m["imports"]
    lines.append(
        f"imports: {g['modules']} modules, {g['edges']} edges ({g['deferred_edges']} deferred), "
        f"cycles {g['cycles']}, upward {g['upward']}, unlayered {g['unlayered']}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=HERE)
    parser.add_argument("--json", action="store_true", help="print every measure as JSON")
    args = parser.parse_args()
    m = metrics(args.root)
    print(json.dumps(m, indent=1) if args.json else summary(m))


if __name__ == "__main__":
    main()
