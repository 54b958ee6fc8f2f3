"""tools/mutate.py's mutants, on a synthetic cell (no notebook, no make check: that is the tool's own run)."""
import importlib.util
from pathlib import Path

# tools/ is not a package: load the script by path.
_spec = importlib.util.spec_from_file_location(
    "nanoserve_mutate_tool", Path(__file__).resolve().parent.parent / "tools" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutate)

CELL = '''#| export
def total(items, n):
    """The last n items plus one each, as long as they are positive; at most 100."""
    out = 0
    ### BEGIN SOLUTION Exercise 9.1: add them up
    for x in reversed(items[-n:]):
        if x > 0 and x != n:
            out += x + 1
    ### END SOLUTION
    return min(out, 100)  # outside the region: never mutated'''


def test_mutants_are_distinct_compile_and_stay_inside_the_region():
    assert mutate.regions(CELL) == [("9.1", 6, 8)]
    found = mutate.mutants(CELL, 6, 8)
    sources = [m.source for m in found]
    assert len(set(sources)) == len(sources) and CELL not in sources
    lines = CELL.split("\n")
    for m in found:
        compile(m.source, "<mutant>", "exec")
        new = m.source.split("\n")
        after = len(lines) - 8  # lines after the region
        assert new[:5] == lines[:5] and new[len(new) - after:] == lines[8:], m.diff
        assert m.diff.startswith("@@ -"), m.diff
    kinds = {m.kind for m in found}
    assert {"compare", "off-by-one", "drop-call", "negate-if", "drop-statement", "and-or", "slice"} <= kinds
    assert "min-max" not in kinds  # the only min() is outside the region
    # A comparison flip keeps everything else as it was written.
    assert "+        if x >= 0 and x != n:" in [m.diff.split("\n")[2] for m in found if m.kind == "compare"]
    # The cap takes the kinds in turn, and the same seed picks the same ones.
    picked = mutate.choose(found, 4, mutate.random.Random("0"))
    assert len({m.kind for m in picked}) == 4
    assert [m.source for m in picked] == [m.source for m in mutate.choose(found, 4, mutate.random.Random("0"))]
