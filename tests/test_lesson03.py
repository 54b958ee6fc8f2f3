"""Lesson 03: paging. The Triton stub, and randomized invariants of the pool."""
import json
import os
from pathlib import Path

import pytest
from lesson_source import generated_lesson
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.cache import paged as paged_cache
from nanoserve.kernels import paged as paged_attention
from nanoserve.cache.block_manager import BlockManager, OutOfBlocks
from nanoserve.checks import lesson03 as checks
from nanoserve.checks.lesson03 import pool_problems
from nanoserve.cache.paged import PagedKVCache

ROOT = Path(__file__).resolve().parents[1]


def test_paged_generate_equals_contiguous():
    checks.check_paged_generate(paged_cache.PagedKVCache)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/append/free sequences, errors included, against a plain model of the pool."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4)
        self.model: dict[int, int] = {}  # sequence -> tokens
        self.next_id = 0

    @rule(n=st.integers(1, 120))
    def allocate(self, n):
        seq, self.next_id = self.next_id, self.next_id + 1
        need = -(-n // 4)
        free = 24 - sum(-(-t // 4) for t in self.model.values())
        if need > 24:
            with pytest.raises(ValueError, match="can never fit"):
                self.bm.allocate(seq, n)
        elif need > free:
            assert not self.bm.can_allocate(n)
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(seq, n)
        else:
            assert self.bm.can_allocate(n)
            table = self.bm.allocate(seq, n)
            assert len(table) == need
            self.model[seq] = n

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 20))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        can = self.bm.can_append(seq, n)
        try:
            self.bm.append(seq, n)
        except OutOfBlocks:
            assert not can
        else:
            assert can
            self.model[seq] += n

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.bm.free(seq)
        del self.model[seq]
        with pytest.raises(KeyError):
            self.bm.free(seq)  # twice

    @rule(data=st.data())
    def slot_lookup(self, data):
        for seq, n in self.model.items():
            slots = self.bm.slots(seq, 0, n)
            assert len(set(slots)) == n
            assert all(s // 4 in self.bm.block_tables[seq] for s in slots)
        with pytest.raises(IndexError):
            self.bm.slot(-1, 0)

    @invariant()
    def pool_is_consistent(self):
        assert pool_problems(self.bm) == []
        assert self.bm.num_tokens == self.model
        slots = [s for seq, n in self.model.items() for s in self.bm.slots(seq, 0, n)]
        assert len(slots) == len(set(slots))  # no two tokens share a slot

    def teardown(self):
        for seq in list(self.model):
            self.bm.free(seq)
        assert self.bm.num_free == 24  # everything comes back


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_paged_cache_rejects_a_sequence_that_can_never_fit():
    from nanoserve.model.config import ModelConfig
    from nanoserve.checks.lesson01 import TINY_CONFIGS, hf_tiny_model

    config = ModelConfig.from_hf(hf_tiny_model(**TINY_CONFIGS["qwen3 group=1 head_dim=64"]).config.to_dict())
    cache = PagedKVCache(config, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="can never fit"):
        cache.reserve(0, [1] * 17)
    assert cache.block_manager.num_free == 4


def test_torch_paged_attention_skips_negative_slots():
    k_cache, v_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    paged_attention.store_kv(k_cache, v_cache, torch.tensor([5, -1, 0]), k, 2 * k)
    assert k_cache.flatten().nonzero().numel() == 4 and v_cache.view(-1, 1, 2)[5].eq(2).all()


STUB_34 = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
from nanoserve.checks import lesson03 as checks
nb = json.loads(sys.stdin.read())
ns = {"__name__": "lesson03"}
for cell in nb["cells"]:
    source = "".join(cell["source"])
    if cell["cell_type"] == "code" and source.split("\\n")[0] == "#| export kernels.triton_paged":
        exec(compile(source, "lesson03", "exec"), ns)
checks.check_triton_decode(ns["paged_decode_attention"])
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the stub does not compile; the interpreter runs it")
def test_untouched_triton_stub_fails_its_check():
    # In a fresh process: Triton's interpreter must be switched on before triton is first imported.
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", STUB_34], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            input=json.dumps(generated_lesson("03_paged_attention")))
    assert result.returncode != 0
    assert "NotImplementedError('Exercise 3.4" in result.stderr, result.stderr[-2000:]


# The lesson's Triton kernels, stubs and all, run in an IPython shell as in Jupyter (the setup cell's
# report_unfinished_exercises), then a cell that reaches the 3.4 stub: on a CPU the lesson's own check cell, in
# Triton's interpreter; else, as on a GPU, Triton's compiler, which compiles for an H100 without one.
STUB_IN_A_SHELL = r'''
import json, os, sys
interpret = sys.argv[1] == "interpreter"
os.environ.pop("TRITON_INTERPRET", None)
if interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance(colors="nocolor")
shell.run_cell("from nanoserve.checks import report_unfinished_exercises\nreport_unfinished_exercises(globals())")
for cell in json.loads(sys.stdin.read())["cells"]:
    source = "".join(cell["source"])
    if cell["cell_type"] == "code" and source.startswith("#| export kernels.triton_paged"):
        assert shell.run_cell(source).success, source[:300]
print("=== the cell")
if interpret:
    result = shell.run_cell("from nanoserve.checks import lesson03 as checks\n"
                            "checks.check_triton_decode(paged_decode_attention)")
else:
    result = shell.run_cell("""
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def one_tile(x):
    rows = tl.arange(0, 16)
    s = tl.load(x + rows[:, None] * 16 + rows[None, :])
    m, l, alpha, p = _online_softmax_step(tl.max(s, 1), tl.zeros([16], tl.float32), s)
    tl.store(x + rows, l)

triton.compile(ASTSource(one_tile, {"x": "*fp32"}, {}), target=GPUTarget("cuda", 90, 32))
""")
print("=== raised", type(result.error_in_exec).__name__)
'''


@pytest.mark.parametrize("triton_mode", ["interpreter", "compiler"])
def test_a_stub_inside_a_triton_kernel_names_the_exercises_left(triton_mode):
    """Triton wraps the 3.4 stub's NotImplementedError (an InterpreterError raised from it; a CompilationError
    quoting its line): the cell still shows the stub, not Triton's wrappers, and lists the exercises left."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", STUB_IN_A_SHELL, triton_mode], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, input=json.dumps(generated_lesson("03_paged_attention")))
    assert result.returncode == 0, result.stderr[-3000:]
    shown, raised = result.stdout.split("=== the cell\n")[1].split("=== raised ")
    assert raised.strip() == {"interpreter": "InterpreterError", "compiler": "CompilationError"}[triton_mode]
    assert shown.strip().endswith("Exercises still to write: 3.4 (_online_softmax_step). Write them, run their "
                                  "cells, then run this cell again."), shown[-3000:]
    if triton_mode == "interpreter":  # the stub's own error, not the chain of InterpreterErrors around it
        assert "NotImplementedError: Exercise 3.4: write the online-softmax update" in shown
        assert "InterpreterError:" not in shown and "direct cause" not in shown, shown[-3000:]
    else:  # only the compiler's error at the stub's line
        assert 'raise NotImplementedError("Exercise 3.4: write the online-softmax update' in shown
        assert "unsupported AST node type: Raise" in shown and "one_tile" not in shown, shown[-3000:]


def test_stub_error_walks_the_chain():
    from nanoserve.checks import stub_error

    stub = NotImplementedError("Exercise 3.4: write it (hint below the cell)")
    assert stub_error(stub) is stub
    try:
        try:
            raise stub
        except NotImplementedError as e:
            raise RuntimeError(repr(e)) from e
    except RuntimeError as wrapped:
        assert stub_error(wrapped) is stub
    assert stub_error(ValueError("no stub")) is None
    assert stub_error(ValueError(repr(stub))) is None  # only Triton's errors are read for a quoted stub


def test_notebook_runs_without_triton(tmp_path):
    """Where triton is not installed (macOS, Windows), the lesson runs top to bottom: section 7's cells that
    define or run the kernels are skipped with one message, and everything else runs."""
    import nbformat
    from nbclient import NotebookClient

    hide = tmp_path / "hide"  # a sitecustomize that makes triton unimportable, as where it is not installed
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None\n")
    nb = nbformat.read(ROOT / "solutions" / "03_paged_attention.ipynb", as_version=4)
    env_path = os.pathsep.join([str(hide), str(ROOT), os.environ.get("PYTHONPATH", "")])
    with pytest.MonkeyPatch.context() as mp:  # the kernel is a child process: it inherits this environment
        mp.setenv("PYTHONPATH", env_path)
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # as on a Mac: no GPU either
        mp.delenv("TRITON_INTERPRET", raising=False)
        NotebookClient(nb, timeout=120, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT / "solutions")}}).execute()

    def text(cell):
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    code = [c for c in nb.cells if c.cell_type == "code"]
    guard = [c for c in code if "checks.have_triton()" in c.source]
    assert len(guard) == 1 and "Triton is not installed here" in text(guard[0])
    skipped = [c for c in code if checks.needs_triton(c.source.splitlines(keepends=True))]
    assert len(skipped) >= 6  # the kernel cells and their checks
    for cell in skipped:
        assert text(cell).strip() == "skipped: this cell needs Triton (see above)", cell.source[:200]
    assert not any("Triton is not installed" in text(c) for c in code if c not in guard)  # one message, once
    stored = next(c for c in code if "h200_attention.json" in c.source)
    assert "measured on" in text(stored)  # section 8, after the skipped cells, still ran
    assert text(code[-1]).startswith("skipped: no GPU")  # the measurement on your own GPU says why not
