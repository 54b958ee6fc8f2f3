"""The `nanoserve` command line, run as a user would."""
import subprocess
import sys

import pytest

from nanoserve.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "nanoserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_greedy_is_deterministic_and_respects_max_tokens(capsys):
    assert main(["generate", "Hello", "--model", "tiny-qwen3", "--max-tokens", "6"]) == 0
    first = capsys.readouterr()
    assert "[6 tokens in" in first.err
    assert main(["generate", "Hello", "--model", "tiny-qwen3", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out == first.out
    assert first.out.strip()


def test_seeded_sampling_reproduces(capsys):
    outs = []
    for seed in ["1", "1", "2"]:
        assert main(["generate", "Hi", "--model", "tiny-qwen3", "--max-tokens", "8",
                     "--temperature", "5.0", "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]  # T=5 flattens the tiny model's peaked logits


@pytest.mark.parametrize("bad", [["--max-tokens", "0"], ["--temperature", "-1"], ["--temperature", "nan"]])
def test_bad_flags_are_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["generate", "Hi", "--model", "tiny-qwen3", *bad])
    assert exit.value.code == 2
    assert "nanoserve generate: error" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error():
    result = run("generate", "Hi", "--model", "no-such-model")
    assert result.returncode == 1
    assert "no-such-model" in result.stderr and "tiny-qwen3" in result.stderr
    assert "Traceback" not in result.stderr


def test_chat_with_the_default_model_answers():
    """The README's main job: offline, on CPU, real text from the default model (SmolLM2 here)."""
    result = run("generate", "What is the capital of France?", "--chat", "--max-tokens", "12",
                 "--model", "smollm2-135m-instruct")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_top_p_out_of_range_is_reported(capsys):
    assert main(["generate", "Hi", "--model", "tiny-qwen3", "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


def test_unseeded_sampling_varies_between_runs(capsys):
    outs = set()
    for _ in range(3):
        assert main(["generate", "Hi", "--model", "tiny-qwen3", "--max-tokens", "8", "--temperature", "5.0"]) == 0
        outs.add(capsys.readouterr().out)
    assert len(outs) > 1
