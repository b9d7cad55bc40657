"""Code lines of the wheel's Python modules: lines holding code, not docstrings, comments or
blank lines (the wheel's measure; issue #33 retired the cap on lines of any kind).

    python .ci/code_lines.py WHEEL [--max-total N] [--max-module N]

Prints the total and the largest modules; exits non-zero if the wheel holds a module outside
``dobb/`` or a budget is exceeded.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel")
    parser.add_argument("--max-total", type=int, default=6000)
    parser.add_argument("--max-module", type=int, default=400)
    args = parser.parse_args()
    wheel = zipfile.ZipFile(args.wheel)
    names = [n for n in wheel.namelist() if n.endswith(".py")]
    counts = {n: code_lines(wheel.read(n).decode()) for n in names}
    total = sum(counts.values())
    largest = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    print(
        f"install check: the wheel holds {len(counts)} Python modules, {total} code lines "
        f"(largest: {', '.join(f'{n} {c}' for n, c in largest)})"
    )
    lab = [n for n in counts if not n.startswith("dobb/")]
    big = {n: c for n, c in counts.items() if c > args.max_module}
    if lab or big or total > args.max_total:
        sys.exit(
            f"install check: lab modules {lab}, modules over {args.max_module} code lines {big}, "
            f"{total} code lines (at most {args.max_total})"
        )


if __name__ == "__main__":
    main()
