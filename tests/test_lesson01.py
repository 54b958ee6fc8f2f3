"""Lesson 01 beyond its exercise checks (those are in test_exercises.py): greedy tokens against transformers, RoPE."""

import pytest
import torch

from nanoserve.course import naive
from nanoserve.checks import lesson01 as checks
from nanoserve.model.qwen3 import rope_cos_sin


def test_greedy_tokens_match_transformers():
    checks.check_greedy_tokens(naive.naive_generate, steps=32)


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
