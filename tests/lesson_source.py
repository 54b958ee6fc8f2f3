"""The learner's lesson notebooks as the exporter generates them from solutions/ (not the files in
lessons/, which a learner may have edited: the stub tests must see the untouched stubs)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("export", ROOT / "tools" / "export.py")
export = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(export)


def generated_lesson(name: str) -> dict:
    """The notebook lessons/<name>.ipynb as export would write it now, parsed."""
    return json.loads(export.generate(ROOT)[Path("lessons") / f"{name}.ipynb"])
