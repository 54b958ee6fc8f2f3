"""The package's shape: layers point one way, no import cycles, and a long-lived engine holds bounded state."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nanoserve"
# Lower layers never import higher ones: kernels know nothing of nanoserve; the model knows its config and
# the backend protocol; caches use kernels and the model's config; the engine uses them all; the tools on top.
LAYERS = {"kernels": 0, "model": 1, "cache": 2, "engine": 3}
TOP = 4  # cli, bench, checks, __init__


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def nanoserve_imports(path: Path) -> set[str]:
    """Every nanoserve module a file imports, anywhere in it (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("nanoserve")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanoserve"):
            for a in node.names:  # `from nanoserve.kernels import paged` imports the module nanoserve.kernels.paged
                sub = f"{node.module}.{a.name}"
                found.add(sub if (PKG.parent / Path(*sub.split("."))).with_suffix(".py").exists() else node.module)
    return found


MODULES = {module_name(p): nanoserve_imports(p) for p in sorted(PKG.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    upward = sorted(m for m in MODULES[module] if layer(m) > layer(module))
    assert not upward, f"{module} (layer {layer(module)}) imports higher layers: {upward}"


def test_no_import_cycles():
    graph = {m: {i for i in deps if i in MODULES and i != m} for m, deps in MODULES.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m not in done:
            path.append(m)
            for dep in graph[m]:
                visit(dep)
            path.pop()
            done.add(m)

    for m in graph:
        visit(m)


def test_a_long_lived_engine_holds_bounded_state():
    """3 rounds x 1,000 small requests: counters grow, stored per-step state does not."""
    from nanoserve.cache.prefix import PrefixCachingKVCache
    from nanoserve.checks.lesson01 import TINY_CONFIGS, hf_tiny_model, ours_from_hf
    from nanoserve.course.step_records import record_steps
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.model.qwen3 import Qwen3ForCausalLM

    model = ours_from_hf(Qwen3ForCausalLM, hf_tiny_model(**TINY_CONFIGS["qwen3 group=4 head_dim=64"], layers=1))

    def serve(engine, rounds, per_round):
        sizes = []
        for r in range(rounds):
            for i in range(per_round):
                engine.add_request([r, i % 300, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            sizes.append((len(engine.scheduler.running), len(engine.scheduler.waiting),
                          len(engine.cache.block_manager.block_tables)))
        return sizes

    cache = PrefixCachingKVCache(model.config, num_blocks=512, block_size=4)
    engine = LLMEngine(model, cache, max_num_seqs=256, max_model_len=64)
    sizes = serve(engine, 3, 1000)
    assert engine.stats.generated_tokens == 3 * 1000 * 2 and engine.stats.steps > 20
    assert sizes == [(0, 0, 0)] * 3, sizes  # nothing left behind
    # no record of past steps: what the engine holds is at most one step's (step_seqs: the last step's batch)
    held = {k: len(v) for k, v in vars(engine).items() if hasattr(v, "__len__") and not isinstance(v, str)}
    assert max(held.values()) <= 256, held
    recording = LLMEngine(model, PrefixCachingKVCache(model.config, num_blocks=512, block_size=4))
    records = record_steps(recording, maxlen=5)  # the course's record (lesson 05's pictures) stays bounded too
    serve(recording, 1, 20)
    assert recording.stats.steps >= 2 and len(records) == min(5, recording.stats.steps)
