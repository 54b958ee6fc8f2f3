#!/usr/bin/env python3
"""The engine's size, as a learner meets it, in three numbers:

* core: the modules that a plain request imports and runs, `LLM(model).generate(prompts, SamplingParams(
  temperature, top_k, top_p, seed, stop, n))`: those a CPU run imports (found by running one, in a fresh
  process), and those a GPU adds (CUDA graphs, the fused sampler, tensor parallelism's workers and layers);
* features: nanoserve/features/, what a request must ask for;
* kernels: the Triton files.
And the lines of the files whose code a plain CPU step runs (traced), and the core's lines over 100 characters.

    python tools/size.py          the numbers
    python tools/size.py --json   the same, as JSON
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "nanoserve"
GPU_PATH = ["engine/cuda_graphs.py", "engine/fused_sampler.py", "engine/tp_workers.py", "model/tp_layers.py",
            "model/qwen3_fused.py"]
KERNELS = ("triton_paged.py", "triton_fused.py")

# A plain request in a fresh process: the nanoserve files it imports, and those whose code its steps run.
PLAIN = """
import json, sys
from nanoserve import LLM, SamplingParams
llm = LLM("tiny-qwen3", device="cpu", max_model_len=256, num_gpu_blocks_override=64)
params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, stop=["zz"], n=2, max_tokens=6,
                        **json.loads(sys.argv[1]))
llm.generate(["Hello there", "One two three"], params, use_tqdm=False)  # warm: imports and first calls
ran = set()
def tracer(frame, event, arg):
    if event == "call" and "nanoserve" in frame.f_code.co_filename:
        ran.add((frame.f_code.co_filename, frame.f_code.co_qualname))
sys.setprofile(tracer)
llm.generate(["Hello there", "One two three"], params, use_tqdm=False)
sys.setprofile(None)
imported = sorted({m.__file__ for name, m in sys.modules.items() if name.startswith("nanoserve") and
                   getattr(m, "__file__", None)})
print(json.dumps({"imported": imported, "ran": sorted(ran)}))
"""


def trace_plain_request(**extra) -> dict:
    """What a plain request (with `extra` SamplingParams fields: then not plain) imports and runs."""
    out = subprocess.run([sys.executable, "-c", PLAIN, json.dumps(extra)], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def lines(paths) -> int:
    return sum(len(Path(p).read_text().splitlines()) for p in paths)


def core_files(traced: dict) -> list[Path]:
    """The core: the files a plain request imported (traced), the Triton kernels left out, and the GPU's path."""
    imported = {Path(p).resolve() for p in traced["imported"]}
    return sorted({p for p in imported if p.name not in KERNELS} | {ROOT / p for p in GPU_PATH})


def measure() -> dict:
    traced = trace_plain_request()
    core = core_files(traced)
    features = sorted((ROOT / "features").glob("*.py"))
    kernels = sorted(ROOT / "kernels" / k for k in KERNELS)
    step_files = sorted({Path(f).resolve() for f, _ in traced["ran"]})
    return {
        "core": {"lines": lines(core), "files": [str(p.relative_to(ROOT)) for p in core]},
        "features": {"lines": lines(features), "files": [str(p.relative_to(ROOT)) for p in features]},
        "kernels": {"lines": lines(kernels)},
        "plain_step_files": {"lines": lines(step_files), "files": [str(p.relative_to(ROOT)) for p in step_files]},
        "core_lines_over_100": sum(len(line) > 100 for p in core for line in p.read_text().splitlines()),
        "feature_code_in_plain_step": [q for f, q in traced["ran"] if "/features/" in f],
    }


def main() -> int:
    found = measure()
    if "--json" in sys.argv:
        print(json.dumps(found, indent=1))
        return 0
    for name in ("core", "features", "kernels", "plain_step_files"):
        print(f"{name:18s} {found[name]['lines']:6,} lines")
    print(f"core lines over 100 characters: {found['core_lines_over_100']}")
    print(f"feature functions a plain step calls: {found['feature_code_in_plain_step'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
