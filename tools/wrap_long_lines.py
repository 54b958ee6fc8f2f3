#!/usr/bin/env python3
"""Fold the lines over 100 characters in the code that modules export, in this code's own style: comments
and docstrings are rewrapped (a trailing comment moves above its line), and a code line is broken after a
comma (else before an operator) inside brackets, the rest aligned with the innermost open bracket; a string
across the width is cut into two adjacent literals. The solution notebooks are edited (they are the source),
and hand-written files given by path. Each result must parse to the same syntax tree as before (docstrings
compared word by word); run `python tools/export.py` after.

    python tools/wrap_long_lines.py MODULE ... [--files PATH ...]     (MODULE: engine.llm, cache.paged, ...)
"""
import argparse
import ast
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import directives  # noqa: E402

WIDTH = 100
BULLET = re.compile(r"^(\s*)([*-] |\d+\. )")
OPEN, CLOSE = "([{", ")]}"
BREAK_BEFORE = {"and", "or", "if", "else", "for", "+", "-", "*", "/", "|", "==", "!=", "<=", ">=", "<", ">"}


def long_lines(lines):
    return [i for i, line in enumerate(lines) if len(line) > WIDTH]


def comment_lines(text):
    """{line index: column of its comment} for the comments tokenize finds."""
    return {tok.start[0] - 1: tok.start[1] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT}


def wrap(text, first, rest):
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False)


def fold_comments(text):
    """A long comment line is rewrapped with the comment lines that follow it at its column (its paragraph);
    a long line's trailing comment goes above it, at its indentation."""
    done = set()
    while True:
        lines = text.split("\n")
        where = comment_lines(text)
        todo = [i for i in long_lines(lines) if i in where and lines[i] not in done
                and not lines[i].lstrip().startswith("#|") and "SOLUTION" not in lines[i]]
        if not todo:
            return text
        i = todo[0]
        col, line = where[i], lines[i]
        if not line[:col].strip():
            j = i
            while j + 1 < len(lines) and where.get(j + 1) == col and not lines[j + 1][:col].strip() \
                    and lines[j + 1][col:].lstrip("#").strip() and not BULLET.match(lines[j + 1][col + 1:]):
                j += 1
            words = " ".join(part[col:].lstrip("#").strip() for part in lines[i:j + 1])
            new = wrap(words, line[:col] + "# ", line[:col] + "# ")
        else:
            code = line[:col].rstrip()
            indent = re.match(r"\s*", code).group(0)
            j, new = i, wrap(line[col:].lstrip("#").strip(), indent + "# ", indent + "# ") + [code]
        done.update(new)
        text = "\n".join(lines[:i] + new + lines[j + 1:])


def docstring_spans(text):
    """(first, last) line index of each docstring."""
    spans = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                spans.append((first.lineno - 1, first.end_lineno - 1))
    return spans


def fold_docstrings(text):
    """A long docstring line is rewrapped with the rest of its paragraph: the lines after it at its text's
    indentation, up to a blank line or a new item of a list."""
    lines = text.split("\n")
    for first, last in sorted(docstring_spans(text), reverse=True):
        i = first
        while i <= last:
            if len(lines[i]) <= WIDTH:
                i += 1
                continue
            line = lines[i]
            bullet = BULLET.match(line)
            indent = re.match(r"\s*", line).group(0)
            body = indent + " " * len(bullet.group(2)) if bullet else indent
            j = i
            while j + 1 <= last and lines[j + 1].strip() and not BULLET.match(lines[j + 1]) \
                    and re.match(r"\s*", lines[j + 1]).group(0) == body and lines[j + 1].strip() != '"""':
                j += 1
            new = wrap(" ".join(part.strip() for part in lines[i:j + 1]), indent, body)
            lines[i:j + 1] = new
            last += len(new) - (j + 1 - i)
            i += len(new)
    return "\n".join(lines)


def line_tokens(text):
    """Per line index: its tokens, each with the columns of the brackets open before it (innermost last)."""
    out, stack = {}, []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.OP and tok.string in CLOSE and stack:
            stack.pop()
        if tok.start[0] == tok.end[0] and tok.type not in (tokenize.NL, tokenize.NEWLINE):
            out.setdefault(tok.start[0] - 1, []).append((tok, list(stack)))
        if tok.type == tokenize.OP and tok.string in OPEN:
            stack.append(tok.start[1])
        if tok.type == tokenize.NEWLINE:
            stack = []
    return out


def split_string(literal, room):
    """A one-line string literal cut after a space into two adjacent literals (Python joins them), the first
    within `room` characters; an f-string only outside its braces. None where it cannot be."""
    m = re.match(r"([rRbBfFuU]*)(['\"])", literal)
    if m is None or literal[len(m.group(0)):].startswith(m.group(2) * 2):
        return None  # (a triple-quoted one)
    prefix, quote = m.groups()
    body = literal[len(prefix) + 1:-1]
    depth, cut = 0, None
    for k, ch in enumerate(body):
        depth += (ch == "{") - (ch == "}")
        if ch == " " and depth == 0 and 8 <= k and len(prefix) + k + 3 <= room and body[k - 1] != "\\":
            cut = k + 1
    if cut is None:
        return None

    def literal_of(part):
        plain = prefix.replace("f", "").replace("F", "") if "{" not in part else prefix
        return plain + quote + part + quote
    return literal_of(body[:cut]), literal_of(body[cut:])


def fold_line(line, tokens):
    """One long code line as two, or None. The break nearest the outside wins (a backslash before a
    conditional's `if`/`else` or a boolean operator, else a bracket's comma or operator), the latest that fits."""
    indent = len(line) - len(line.lstrip())
    best = None  # (depth, -column, column, the rest's column, backslash)
    targets = set()  # depths inside a comprehension's `for ... in` (its commas separate names, not items)
    for n, (tok, stack) in enumerate(tokens):
        if tok.string == "for":
            targets.add(len(stack))
        elif tok.string == "in":
            targets.discard(len(stack))
        after = tok.type == tokenize.OP and tok.string == "," and len(stack) not in targets
        before = tok.string in BREAK_BEFORE and n > 0 and tok.type in (tokenize.OP, tokenize.NAME)
        col = tok.end[1] if after else tok.start[1]
        if not (after or before) or not indent < col <= WIDTH - 2 or col >= len(line.rstrip()):
            continue
        if stack:
            option = (len(stack), -col, col, stack[-1] + 1, False)
        elif before and tok.string in ("if", "else", "and", "or"):
            option = (0, -col, col, indent + 4, True)
        else:
            continue
        best = min(best or option, option)
    if best is not None:
        _, _, col, align, backslash = best
        rest = line[col:].lstrip()
        if align + len(rest) > WIDTH and align > indent + 40:
            align = indent + 8
        return [line[:col].rstrip() + " \\" * backslash, " " * align + rest]
    for tok, stack in tokens:  # a string across the width: cut it
        if tok.type == tokenize.STRING and tok.start[1] < WIDTH < tok.end[1]:
            parts = split_string(tok.string, WIDTH - tok.start[1])
            if parts is None:
                continue
            if stack:
                return [line[:tok.start[1]] + parts[0], " " * tok.start[1] + parts[1] + line[tok.end[1]:]]
            return [line[:tok.start[1]] + parts[0] + " \\", " " * (indent + 4) + parts[1] + line[tok.end[1]:]]
    return None


def string_groups(text):
    """Runs of adjacent one-line string literals (Python joins them), one per line at one column, each the
    last thing on its line but the last: [(first line index, column, tokens)]."""
    groups, run = [], []
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type not in (tokenize.NL, tokenize.COMMENT)]
    for k, tok in enumerate(tokens + [None]):
        if tok is not None and tok.type == tokenize.STRING and tok.start[0] == tok.end[0] and (
                not run or (tok.start[0] == run[-1].start[0] + 1 and tok.start[1] == run[0].start[1])):
            run.append(tok)
            continue
        if len(run) > 1 and all(tokens[tokens.index(t) + 1].start[0] > t.start[0] for t in run[:-1]):
            groups.append((run[0].start[0] - 1, run[0].start[1], run))
        run = [tok] if tok is not None and tok.type == tokenize.STRING and tok.start[0] == tok.end[0] else []
    return groups


def reflow_strings(text):
    """A message cut over several adjacent literals, laid out again: as few lines as fit the width."""
    for first, col, run in sorted(string_groups(text), key=lambda g: g[0], reverse=True):
        parts = [re.fullmatch(r"([fF]?)(['\"])(.*)\2", t.string) for t in run]
        if None in parts or len({m.group(2) for m in parts}) > 1 or any(m.group(2) * 2 == m.group(3)[:2] for m in parts):
            continue
        if all(len(m.group(3)) > 25 for m in parts[:-1]):
            continue  # no fragment left by a cut: as its author laid it out
        quote, is_f = parts[0].group(2), any(m.group(1) for m in parts)
        body = "".join(m.group(3) if m.group(1) or not is_f else m.group(3).replace("{", "{{").replace("}", "}}")
                       for m in parts)
        lines = text.split("\n")
        last = run[-1].start[0] - 1
        head, tail = lines[first][:col], lines[last][run[-1].end[1]:]
        pieces, start, depth, cut = [], 0, 0, None
        for k, ch in enumerate(body):  # greedy: each piece the longest that fits, cut after a space
            depth += (ch == "{") - (ch == "}")
            if ch == " " and depth == 0 and body[k - 1] != "\\":
                if col + 3 + (k + 1 - start) > WIDTH and cut is not None:
                    pieces.append(body[start:cut])
                    start = cut
                cut = k + 1
        if col + 3 + len(body) - start + len(tail) > WIDTH and cut is not None and cut > start:
            pieces.append(body[start:cut])
            start = cut
        pieces.append(body[start:])
        if len(pieces) >= len(run):
            continue
        literal = [("f" if is_f and ("{" in piece or "}" in piece) else "") + quote + piece + quote for piece in pieces]
        new = [head + literal[0]] + [" " * col + x for x in literal[1:]]
        new[-1] += tail
        candidate = "\n".join(lines[:first] + new + lines[last + 1:])
        if same_tree(text, candidate):
            text = candidate
    return text


def fold_code(text):
    """Each long code line folded, bottom up, until none is left that can be."""
    left = set()
    for _ in range(5000):
        lines = text.split("\n")
        skip = set(comment_lines(text)) | {i for a, b in docstring_spans(text) for i in range(a, b + 1)}
        todo = [i for i in long_lines(lines) if i not in skip and lines[i] not in left]
        if not todo:
            return text
        i = todo[-1]
        new = fold_line(lines[i], line_tokens(text).get(i, []))
        candidate = "\n".join(lines[:i] + new + lines[i + 1:]) if new else None
        try:
            if candidate is None or same_tree(text, candidate) is False:
                raise SyntaxError
        except SyntaxError:
            left.add(lines[i])
            continue
        text = candidate
    return text


def normalized_tree(text):
    tree = ast.parse(text)
    for node in ast.walk(tree):  # docstrings compared word by word
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            node.body[0].value.value = " ".join(node.body[0].value.value.split())
    return ast.dump(tree)


def same_tree(a, b):
    return normalized_tree(a) == normalized_tree(b)


def fold(text):
    new = reflow_strings(fold_code(fold_docstrings(fold_comments(text))))
    assert same_tree(text, new), "the folded code means something else"
    return new


def fold_notebooks(modules):
    import nbformat

    for path in sorted(Path("solutions").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        default = next((w[1] for c in nb.cells if c.cell_type == "code" for w in directives(c.source)
                        if w and w[0] == "default_exp"), None)
        changed = 0
        for cell in nb.cells:
            targets = [(w[1] if len(w) > 1 else default) for w in directives(cell.source) if w and w[0] == "export"] \
                if cell.cell_type == "code" else []
            if targets and targets[0] in modules:
                new = fold(cell.source)
                changed += new != cell.source
                cell.source = new
        if changed:
            nbformat.write(nb, path)
            print(f"{path}: {changed} cells")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("modules", nargs="*")
    ap.add_argument("--files", nargs="*", default=[])
    args = ap.parse_args()
    fold_notebooks(set(args.modules))
    for f in args.files:
        Path(f).write_text(fold(Path(f).read_text()))


if __name__ == "__main__":
    main()
