"""Lesson 01's checks, run on the engine's code; and proof that the lesson's untouched stubs fail them."""
import functools

import pytest
from lesson_source import generated_lesson
import torch

from nanoserve.course import no_cache
from nanoserve.course import naive
from nanoserve.kernels import attention
from nanoserve.model import qwen3 as model
from nanoserve.checks import lesson01 as checks
from nanoserve.model.qwen3 import rope_cos_sin



def exercises(ns):
    """Name -> the check run on ns's implementation (the table: checks.EXERCISES, shared with `make check`)."""
    return {name: functools.partial(check, ns) for name, check in checks.EXERCISES.items()}


PACKAGE = {**vars(model), **vars(attention), **vars(no_cache)}


@pytest.mark.parametrize("name", list(exercises(PACKAGE)))
def test_engine_passes_check(name):
    exercises(PACKAGE)[name]()


def test_greedy_tokens_match_transformers():
    checks.check_greedy_tokens(naive.naive_generate, steps=32)


def lesson_namespace():
    """Run the model's exported cells of the learner's notebook (stubs untouched) in a fresh namespace.

    Stops at the loader cell, which imports the engine's Qwen3ForCausalLM over the learner's.
    """
    nb = generated_lesson("01_naive_forward")
    ns = {"__name__": "lesson01"}
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if source.startswith("#| export model.loader"):
            break
        if cell["cell_type"] == "code" and source.startswith("#| export"):
            exec(compile(source, "lesson01", "exec"), ns)
    return ns


@pytest.mark.parametrize("name", list(exercises(PACKAGE)))
def test_untouched_stub_fails_its_check(name):
    with pytest.raises(NotImplementedError, match=f"Exercise {name.split()[0]}"):
        exercises(lesson_namespace())[name]()


def test_rope_angles_match_transformers():
    import transformers

    config = transformers.Qwen3Config(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    positions = torch.tensor([0, 5, 4095, 17, 40000])
    want_cos, want_sin = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config)(
        torch.zeros(1), positions[None])
    cos, sin = rope_cos_sin(positions, 128, 1e6)
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)


def test_a_wrong_answer_fails_with_a_hint():
    def rms_norm_without_eps(x, weight, eps):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))

    with pytest.raises(AssertionError, match="add eps inside the square root"):
        checks.check_rms_norm(rms_norm_without_eps)
