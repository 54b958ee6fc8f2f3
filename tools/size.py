#!/usr/bin/env python3
"""The core engine's size, as issue 21 measures it: nanoserve/ without checks/, serve/, cli.py, bench.py, the
model zoo and the Triton kernels (and without the course area, course/, which is off the engine's path).

    python tools/size.py            lines, code lines, classes, in-package subclass pairs, deepest inheritance
"""
import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "nanoserve"
LEFT_OUT = ("checks", "serve", "course")
LEFT_OUT_FILES = ("cli.py", "bench.py", "zoo.py", "triton_paged.py", "triton_fused.py")


def core_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not set(p.relative_to(ROOT).parts[:-1]) & set(LEFT_OUT) and p.name not in LEFT_OUT_FILES)


def code_lines(text: str) -> int:
    """Lines with code on them: not blank, not only a comment, not inside a docstring."""
    tree, doc_lines = ast.parse(text), set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - doc_lines)


def main() -> int:
    files, total, code, classes, bases = core_files(), 0, 0, {}, {}
    for path in files:
        text = path.read_text()
        total += len(text.splitlines())
        code += code_lines(text)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = path
                # a base named plainly (a name of the package); `nn.Linear` and the like are torch's
                bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
    pairs = [(c, b) for c, bs in bases.items() for b in bs if b in classes]

    def depth(name: str) -> int:
        return 1 + max((depth(b) for b in bases.get(name, []) if b in classes), default=0)

    deepest = max(classes, key=depth)
    long_lines = sum(len(line) > 100 for p in files if "engine" in p.parts for line in p.read_text().splitlines())
    print(f"{len(files)} files, {total} lines ({code} of them code), {len(classes)} classes, "
          f"{len(pairs)} in-package subclass pairs {pairs}, inheritance {depth(deepest)} deep ({deepest}); "
          f"engine/ lines over 100 characters: {long_lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
