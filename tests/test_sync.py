"""The generated files (nanoserve/ modules, lessons/) must be exactly what solutions/ generates."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("export", ROOT / "tools" / "export.py")
export = importlib.util.module_from_spec(spec)
spec.loader.exec_module(export)


def test_generated_files_match_solutions():
    problems = export.check(ROOT)
    assert not problems, "run `make export`:\n" + "\n".join(problems)


def test_solutions_are_committed_executed_and_lessons_without_outputs():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        assert all(c["execution_count"] for c in cells), f"{path.name}: not executed top to bottom"
        lesson = json.loads((ROOT / "lessons" / path.name).read_text())
        assert not any(c.get("outputs") for c in lesson["cells"] if c["cell_type"] == "code"), path.name
