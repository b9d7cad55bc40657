"""Code lines of the wheel's Python modules: lines holding code, not docstrings, comments or
blank lines (the wheel's measure; issue #33 retired the cap on lines of any kind).

    python .ci/code_lines.py WHEEL [--max-total N] [--max-module N] [--max-function N]

Prints the total and the largest modules; exits non-zero if the wheel holds a module outside
``dobb/`` or a budget is exceeded. A function's length is the lines of its ``def``, from the
``def`` line to its last line (decorators not counted, everything inside counted: docstring,
comments, blank lines and nested functions).
"""

import argparse
import ast
import io
import sys
import tokenize
import zipfile


def docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the docstrings of a module, its classes and functions, and of string
    statements after an assignment (attribute docstrings)."""
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            value = getattr(stmt, "value", None)
            if isinstance(stmt, ast.Expr) and isinstance(value, ast.Constant):
                if isinstance(value.value, str):
                    lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """How many lines of ``source`` hold a token that is code (docstrings excluded)."""
    docs = docstring_lines(ast.parse(source))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in skip or token.type == tokenize.ENDMARKER:
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docs)


def function_lengths(source: str) -> dict[str, int]:
    """Lines of each function and method of ``source`` (nested ones too), by qualified name:
    ``end_lineno - lineno + 1`` of its ``def`` (decorators excluded)."""
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel")
    parser.add_argument("--max-total", type=int, default=6500)
    parser.add_argument("--max-module", type=int, default=400)
    parser.add_argument("--max-function", type=int, default=80)
    args = parser.parse_args()
    wheel = zipfile.ZipFile(args.wheel)
    sources = {n: wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".py")}
    counts = {n: code_lines(source) for n, source in sources.items()}
    long = {
        f"{n}:{f}": length
        for n, source in sources.items()
        for f, length in function_lengths(source).items()
        if length > args.max_function
    }
    total = sum(counts.values())
    largest = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    print(
        f"install check: the wheel holds {len(counts)} Python modules, {total} code lines "
        f"(largest: {', '.join(f'{n} {c}' for n, c in largest)})"
    )
    lab = [n for n in counts if not n.startswith("dobb/")]
    big = {n: c for n, c in counts.items() if c > args.max_module}
    if lab or big or long or total > args.max_total:
        sys.exit(
            f"install check: lab modules {lab}, modules over {args.max_module} code lines {big}, "
            f"functions over {args.max_function} lines {long}, "
            f"{total} code lines (at most {args.max_total})"
        )


if __name__ == "__main__":
    main()
