"""The `nanoserve` command line, run as a user would."""
import signal
import subprocess
import sys

import pytest
import torch

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
    assert "top_p must be a number in (0, 1]" in capsys.readouterr().err


def test_unseeded_sampling_varies_between_runs(capsys):
    outs = set()
    for _ in range(3):
        assert main(["generate", "Hi", "--model", "tiny-qwen3", "--max-tokens", "8", "--temperature", "5.0"]) == 0
        outs.add(capsys.readouterr().out)
    assert len(outs) > 1


# ---------------------------------------------------------------------------
# Errors: `nanoserve: <message>` and exit 1; usage errors exit 2; Ctrl-C exits 130; --debug shows the traceback.


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the CLI gets as far as loading a model."""
    from nanoserve.engine import llm

    def refuse(*args, **kwargs):
        raise AssertionError("the CLI loaded a model before rejecting its arguments")

    monkeypatch.setattr(llm.LLM, "__init__", refuse)


@pytest.mark.parametrize("device", ["bogus", "cuda:x", "mps", ""])
def test_bad_device_names_it_and_the_accepted_values(device, no_model_load, capsys):
    assert main(["generate", "Hi", "--model", "tiny-qwen3", "--device", device]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nanoserve: ") and err.count("\n") == 1
    assert repr(device) in err and "cpu" in err and "cuda" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_clear_error(device, no_model_load, capsys):
    assert main(["generate", "Hi", "--model", "tiny-qwen3", "--device", device]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"nanoserve: --device {device}: CUDA is not available") and "--device cpu" in err


def test_missing_model_path_is_exit_1_without_traceback(tmp_path):
    missing = tmp_path / "no" / "such-model"
    result = run("generate", "Hi", "--model", str(missing), "--max-tokens", "2")
    assert result.returncode == 1
    assert result.stderr.startswith("nanoserve: ") and str(missing) in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_directory_without_a_model_is_exit_1(tmp_path, capsys):
    assert main(["generate", "Hi", "--model", str(tmp_path), "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nanoserve: ") and "config.json" in err


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["--debug", "generate", "Hi", "--model", str(tmp_path / "missing"), "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "ModelNotFoundError" in err and str(tmp_path / "missing") in err


def test_ctrl_c_exits_130_with_one_line(monkeypatch, capsys):
    from nanoserve.model import zoo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(zoo, "resolve_model", interrupted)  # Ctrl-C while the model loads
    assert main(["generate", "Hi", "--model", "tiny-qwen3", "--max-tokens", "2"]) == 130
    assert capsys.readouterr().err == "nanoserve: interrupted\n"


def test_sigint_while_generating_exits_130():
    """A real Ctrl-C in the middle of a stream: one line on stderr, no traceback. The child gets SIGINT's
    default action, as a terminal's foreground job has it: a test run started in the background of a
    non-interactive shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "generate", "Hello", "--model", "tiny-qwen3",
                             "--max-tokens", "4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.read(1), "no output before the interrupt"  # generation has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.decode() == "nanoserve: interrupted\n"


def test_non_utf8_prompt_is_rejected_without_traceback():
    result = subprocess.run([sys.executable, "-m", "nanoserve.cli", "generate", b"\xff\xfe", "--model", "tiny-qwen3",
                             "--max-tokens", "2"], capture_output=True, timeout=300)
    err = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 1, err
    assert err.startswith("nanoserve: ") and "UTF-8" in err and r"b'\xff\xfe'" in err
    assert "Traceback" not in err and result.stdout == b""


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["generate"], ["generate", "Hi", "--no-such-flag"],
                                  ["generate", "Hi", "--debug"]])  # --debug goes before the subcommand
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert "usage: nanoserve" in capsys.readouterr().err


def test_failed_request_is_exit_1(capsys):
    assert main(["generate", "", "--model", "tiny-qwen3", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nanoserve: ") and "empty" in err


def test_chat_goes_through_llm_chat(monkeypatch, capsys):
    from nanoserve.engine.llm import LLM

    calls = []
    real_chat = LLM.chat

    def chat(self, messages, sampling_params=None, use_tqdm=True, **kwargs):
        calls.append((messages, sampling_params.max_tokens, use_tqdm))
        return real_chat(self, messages, sampling_params, use_tqdm=use_tqdm, **kwargs)

    monkeypatch.setattr(LLM, "chat", chat)
    assert main(["generate", "Hi there", "--chat", "--model", "tiny-qwen3", "--max-tokens", "2"]) == 0
    assert calls == [([{"role": "user", "content": "Hi there"}], 2, False)]
    assert "[2 tokens in" in capsys.readouterr().err


def test_vllm_serve_flags(monkeypatch, tmp_path, capsys):
    """vLLM's deployment flags: taken with their effect, or refused by name (exit 2), never ignored."""
    from nanoserve import cli
    from nanoserve.serve import api_server

    parse = cli.build_parser().parse_args
    args = parse(["serve", "m", "-tp", "2", "--max-model-len", "2k", "--disable-log-requests"])
    assert args.tensor_parallel_size == 2 and args.max_model_len == 2000
    assert parse(["serve", "m", "--max-model-len", "2K"]).max_model_len == 2048
    assert parse(["serve", "m", "--tokenizer", "tok"]).tokenizer == "tok"  # (LLM(tokenizer=): test_vllm_examples)
    assert parse(["serve", "m", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    for bad, says in [(["--kv-cache-dtype", "fp8_e5m2"], "auto, bfloat16, fp8"), (["--trust-remote-code"], "own code"),
                      (["--max-model-len", "two"], "like 2k")]:
        with pytest.raises(SystemExit) as stop:
            parse(["serve", "m", *bad])
        assert stop.value.code == 2 and says in capsys.readouterr().err
    served = {}
    monkeypatch.setattr(api_server, "serve", lambda llm, name, *a, **kw: served.update(llm=llm, name=name, **kw))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    assert main(["serve", "tiny-qwen3", "--device", "cpu", "--served-model-name", "mine", "--chat-template",
                 str(template), "--uvicorn-log-level", "info", "--num-gpu-blocks-override", "16",
                 "--kv-cache-dtype", "fp8"]) == 0
    assert served["llm"].cache.k_cache.dtype == torch.float8_e4m3fn
    tok = served["llm"].tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert served["name"] == "mine" and served["log_level"] == "info" and tok.decode(ids) == "<<hi>>"
    options = ("enable_request_id_headers", "return_tokens_as_token_ids", "enable_force_include_usage")
    assert not any(served[o] for o in options)  # off unless asked, and each flag reaches the app
    assert main(["serve", "tiny-qwen3", "--device", "cpu", "--num-gpu-blocks-override", "16",
                 *("--" + o.replace("_", "-") for o in options)]) == 0
    assert all(served[o] is True for o in options)
    assert main(["serve", "tiny-qwen3", "--served-model-name", "a", "b"]) == 2


def test_serve_engine_flags_come_from_engine_args(monkeypatch):
    """`nanoserve serve`'s engine flags are EngineArgs.add_cli_args's: one per setting (but those a server leaves
    out), each reaching the LLM; serve's own checks, defaults and aliases on top."""
    import dataclasses

    from nanoserve import cli
    from nanoserve.engine.engine_args import EngineArgs
    from nanoserve.serve import api_server

    parser = cli.build_parser()
    dests = set(vars(parser.parse_args(["serve", "m"])))
    left_out = {"model", "profiler_config", "disable_log_stats", "logits_processors", "parts"}
    assert {f.name for f in dataclasses.fields(EngineArgs)} - dests == left_out - {"model"}  # model: positional
    args = parser.parse_args(["serve", "m", "--no-fused-ops", "--cpu-kv-cache-gib", "0.5", "--no-async-scheduling",
                              "--no-enforce-eager", "-tp", "1", "--disable-custom-all-reduce"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.fused_ops, engine_args.cpu_kv_cache_gib, engine_args.async_scheduling,
            engine_args.enforce_eager, engine_args.custom_all_reduce, engine_args.max_num_batched_tokens) == \
        (False, 0.5, False, False, False, 8192)  # serve's 8192 tokens a step, not LLM's 16384
    assert parser.parse_args(["serve", "m"]).enforce_eager is None  # None: eager on a CPU, graphs on a GPU
    served = {}
    monkeypatch.setattr(api_server, "serve", lambda llm, name, *a, **kw: served.update(llm=llm))
    assert main(["serve", "tiny-qwen3", "--device", "cpu", "--no-fused-ops", "--max-num-seqs", "3",
                 "--num-gpu-blocks-override", "8"]) == 0
    llm = served["llm"]
    assert not llm.fused_ops and llm.engine.scheduler.max_num_seqs == 3 and llm.cache.block_manager.num_blocks == 8
