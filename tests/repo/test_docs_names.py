"""Every name the documentation gives resolves (issue #33, item 6): in the docstrings of
``dobb/``, ``bench/``, ``tests/`` and ``examples/`` and in README.md and docs/*.md,

- a dotted name that starts with ``dobb.`` or ``bench.`` (in backticks or not, in prose or
  in a code block: ``dobb.optim.muon.newton_schulz``, ``bench.compare``) names a module, or
  an attribute of one: the longest prefix that is a module is imported and the rest looked
  up with ``getattr`` (a class's annotated field counts: a dataclass field without a
  default). A module that needs an extra not installed here (torchtitan) is read instead:
  the rest must be defined at its top level or in a class there;
- a path that starts with ``dobb/``, ``bench/``, ``tests/`` or ``docs/``
  (``dobb/optim/config.py``, ``tests/distributed``, ``bench/model/costs/*.py``) exists in
  the repository (a glob matches at least one file);
- a page followed by quoted section titles (``docs/baselines.md, "Options"``,
  ``... "A" and "B"``) has a heading of each title (line breaks in a title read as spaces).

A name ending in a file suffix (``dobb.py``, ``bench.json``) is a file name, not a dotted
name, and is not looked up.
"""

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULES = sorted(
    p for d in ("dobb", "bench", "tests", "examples") for p in (ROOT / d).rglob("*.py")
)

NAME = re.compile(r"(?<![\w./-])(?:dobb|bench)(?:\.[A-Za-z_]\w*)+(?![\w/-])")
PATH = re.compile(r"(?<![\w./-])(?:dobb|bench|tests|docs)/[\w./*-]*")
SECTIONS = re.compile(r'(docs/\w+\.md)`{0,2},\s+"([^"]+)"((?:\s*(?:,|and)\s*"[^"]+")*)')
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "sh", "txt", "pt", "toml", "whl"}


def docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of the docstrings of a module, its classes and functions, and of the
    string statements after an assignment (attribute docstrings)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            value = getattr(stmt, "value", None)
            if isinstance(stmt, ast.Expr) and isinstance(value, ast.Constant):
                if isinstance(value.value, str):
                    found.append((stmt.lineno, value.value))
    return found


def _defined_in_source(path: str, attrs: list[str]) -> bool:
    """Whether ``attrs`` (a name, then names inside it) is defined at the top level of the
    module at ``path``, and inside the classes it walks through."""
    body = ast.parse(Path(path).read_text()).body
    for attr in attrs:
        found = None
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names = [(a.asname or a.name).split(".")[0] for a in node.names]
            else:
                names = []
            if attr in names:
                found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def _has(obj, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    return isinstance(obj, type) and any(
        attr in vars(c).get("__annotations__", {}) for c in obj.__mro__
    )


def resolve(name: str) -> str | None:
    """None if the dotted ``name`` resolves, else why not."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:  # an extra that is not installed here
            if e.name and e.name.split(".")[0] in ("dobb", "bench"):
                raise
            ok = _defined_in_source(spec.origin, parts[i:])
            return None if ok else f"{module} (read, not imported) defines no {parts[i:]}"
        for j, attr in enumerate(parts[i:], start=i):
            if not _has(obj, attr):
                return f"{'.'.join(parts[:j])} has no attribute {attr!r}"
            obj = getattr(obj, attr, None)
        return None
    return f"no module {parts[0]!r}"


def dangling(text: str) -> list[str]:
    """The dotted names and repository paths in ``text`` that do not resolve, with why."""
    bad = []
    for name in NAME.findall(text):
        if name.rsplit(".", 1)[1] in FILE_SUFFIXES:
            continue
        why = resolve(name)
        if why is not None:
            bad.append(f"{name}: {why}")
    for path in PATH.findall(text):
        path = path.rstrip(".,")
        exists = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
        if not exists:
            bad.append(f"{path}: not in the repository")
    for page, first, more in SECTIONS.findall(text):
        if not (ROOT / page).is_file():
            continue  # reported above
        headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), flags=re.M)
        for title in [first, *re.findall(r'"([^"]+)"', more)]:
            if " ".join(title.split()) not in headings:
                bad.append(f'{page}, "{title}": no such section')
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_names_in_the_docs_resolve(page):
    bad = dangling(page.read_text())
    assert not bad, f"{page.name} names what does not exist: {bad}"


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_names_in_docstrings_resolve(module):
    bad = [
        f"line {line}: {why}"
        for line, text in docstrings(module.read_text())
        for why in dangling(text)
    ]
    assert not bad, f"{module.relative_to(ROOT)} names what does not exist: {bad}"


def test_the_check_sees_names_and_paths():
    """The patterns find what the docs write, and a name or path that is gone fails."""
    text = (
        "``dobb.optim.muon.newton_schulz`` and `dobb.Dobb.Config`, bench.compare in prose, "
        "``bench.optimizers.LabEntry.cost_model`` (a field), `dobb/optim/config.py`, "
        "docs/algorithm.md, and dobb.py or bench.json (file names)"
    )
    assert NAME.findall(text)[:4] == [
        "dobb.optim.muon.newton_schulz",
        "dobb.Dobb.Config",
        "bench.compare",
        "bench.optimizers.LabEntry.cost_model",
    ]
    assert dangling(text) == []
    gone = (
        "``dobb.optim.muon.no_such_function``, `bench.no_such_module`, dobb.Dobb.no_such, "
        "`dobb/optim/no_such.py`, tests/no_such_dir/, bench/model/costs/no_such_*.py; "
        'docs/baselines.md, "The registry\'s\n    learning rates" and "No such section"'
    )
    assert [b.split(":")[0] for b in dangling(gone)] == [
        "dobb.optim.muon.no_such_function",
        "bench.no_such_module",
        "dobb.Dobb.no_such",
        "dobb/optim/no_such.py",
        "tests/no_such_dir/",
        "bench/model/costs/no_such_*.py",
        'docs/baselines.md, "No such section"',
    ]


def test_a_module_of_a_missing_extra_is_read_instead(tmp_path):
    """torchtitan's integration is read, not imported, where torchtitan is not installed:
    a name it defines passes, one it does not fails."""
    source = tmp_path / "needs_extra.py"
    source.write_text("import no_such_extra\n\n\nclass Box:\n    size = 1\n\n\ndef f(): ...\n")
    assert _defined_in_source(str(source), ["Box", "size"])
    assert _defined_in_source(str(source), ["f"])
    assert not _defined_in_source(str(source), ["Box", "width"])
    assert resolve("dobb.integrations.torchtitan.no_such_name") is not None
