"""The pristine lesson notebooks (every exercise a stub) executed top to bottom: each lesson's checks and its
payoff cells must stop, because they run the learner's code from the notebook, not the engine's; and the
error names the exercises still to write."""
import functools
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lesson_source import ROOT, export

# Per lesson, a distinctive piece of each payoff cell: the cells that show the lesson's idea at work.
PAYOFFS = {
    "01_naive_forward": ["naive_generate(model, prompt_ids", "recorder = RecordingNoCache()",
                         "reply = naive_generate(real_model"],
    "02_kv_cache": ["generate(model"],
    "03_paged_attention": ["STATES = scripted_workload()", "pool = BlockManager(budget_blocks, block)",
                           "paged = PagedKVCache(model.config, num_blocks=64"],
    "04_prefix_caching": ["cache = RecordingCache(", "LessonLLM(\"smollm2", "rate, preempted = hit_rate(pool)"],
    "05_scheduler": ["engine = LLMEngine(tiny", "outs = llm.generate(prompts, skewed", "answer = llm.chat(",
                     "side_by_side[name] ="],
    "06_cuda_graphs": ["with LessonLLM(\"tiny-qwen3\"", '"yours (this notebook)": LessonLLM('],
    # lesson 07's engine payoff runs the package's engine: its workers are spawned, and import their parts by
    # path, which a notebook's classes have not; its picture of the slices runs the learner's shard
    "07_tensor_parallel": [],
    "08_serving": ["reply = client.completions.create(", "with httpx.stream(\"POST\"", "await load_with_view()",
                   "leaving = client.completions.create(", "summary = await run_at_rate("],
}


@functools.cache
def generated_lessons() -> dict:
    """Every lesson notebook as the exporter generates it now (one generation for every lesson's test)."""
    return export.generate(ROOT)


def lesson_names():
    return sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def test_every_lesson_has_payoffs_listed():
    assert set(PAYOFFS) == set(lesson_names())


@pytest.mark.parametrize("name", lesson_names())
def test_pristine_lesson_checks_and_payoffs_fail(name, tmp_path):
    nb = nbformat.reads(generated_lessons()[Path("lessons") / f"{name}.ipynb"], as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(ROOT / "solutions")}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = {id(c): [o for o in c.outputs if o.output_type == "error"] for c in code}
    checks = [c for c in code if "checks.check_" in c.source]
    assert checks, "a lesson without checks"
    for cell in checks:
        assert errors[id(cell)], f"a check passed on the untouched stubs:\n{cell.source[:300]}"
    pictures = [c for c in code if c.get("id", "").startswith("pic-")]  # the pictures drawn by the lesson's code
    for cell in pictures:
        assert errors[id(cell)], f"a picture was drawn with the untouched stubs:\n{cell.source[:300]}"
    for piece in PAYOFFS[name]:
        found = [c for c in code if piece in c.source and not c.source.startswith("#| export")]
        assert found, f"no cell holds {piece!r}: update PAYOFFS"
        for cell in found:
            assert errors[id(cell)], f"a payoff ran on the untouched stubs:\n{cell.source[:300]}"
    # The last cell stopped by a stub lists every exercise defined up to it.
    stopped = [i for i, c in enumerate(code) if any(o.ename == "NotImplementedError" for o in errors[id(c)])]
    defined = "\n".join(c.source for c in code[:stopped[-1] + 1])
    stubs = sorted(set(re.findall(r'NotImplementedError\("Exercise (\d+\.\d+\w*)', defined)))
    text = "".join(o.get("text", "") for o in code[stopped[-1]].outputs if o.output_type == "stream")
    listed = re.search(r"Exercises still to write: (.*)", text)
    assert listed, text
    assert sorted(re.findall(r"(\d+\.\d+\w*) \(", listed.group(1))) == stubs
