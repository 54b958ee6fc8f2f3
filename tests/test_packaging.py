"""environment.yml must list the same pip requirements as pyproject.toml."""
import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_mirrors_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:") + 1
    listed = {line.strip()[2:] for line in lines[start:] if line.strip().startswith("- ")}
    assert listed - {"-e ."} == wanted
