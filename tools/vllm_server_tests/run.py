"""Run vLLM's own server tests against `nanoserve serve`, and save what happened as last_run.json.

    .venv/bin/python tools/vllm_server_tests/run.py /path/to/vllm [--files F ...] [-n 2] [--timeout 120]

VLLM_DIR is a vLLM source tree (a git checkout, or the unpacked sdist, which carries tests/). Nothing of it is
copied into this repository: its tests/entrypoints is copied to a scratch folder, where tests/utils.py and
tests/conftest.py are replaced by standin_server.py and plugin.py, and pytest runs the files of FILES there.
README.md says what is stubbed, what counts as not applicable, and how failures are grouped.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# The files that start a server and exercise the OpenAI surface, relative to tests/entrypoints. Left out: files
# whose every test is a unit test of vLLM's classes, or needs LoRA, multimodal input, prompt embeddings,
# pooling, harmony (gpt-oss), SageMaker's container library, a tensorizer or a UNIX socket.
FILES = [
    "openai/chat_completion/test_batched_chat_completions.py",
    "openai/chat_completion/test_chat.py",
    "openai/chat_completion/test_chat_completion.py",
    "openai/chat_completion/test_chat_echo.py",
    "openai/chat_completion/test_chat_logit_bias_validation.py",
    "openai/chat_completion/test_completion_with_function_calling.py",
    "openai/chat_completion/test_enable_force_include_usage.py",
    "openai/chat_completion/test_extra_content_fields.py",
    "openai/chat_completion/test_include_reasoning.py",
    "openai/chat_completion/test_logprob_token_ids.py",
    "openai/chat_completion/test_root_path.py",
    "openai/chat_completion/test_thinking_token_budget.py",
    "openai/completion/test_completion.py",
    "openai/completion/test_prompt_validation.py",
    "openai/completion/test_token_in_token_out.py",
    "openai/models/test_models.py",
    "openai/test_chunked_prompt.py",
    "openai/test_return_token_ids.py",
    "openai/test_return_tokens_as_ids.py",
    "serve/instrumentator/test_basic.py",
    "serve/instrumentator/test_metrics.py",
    "serve/instrumentator/test_orca_metrics.py",
    "serve/middleware/test_optional_middleware.py",
    "serve/tokenize/test_tokenization.py",
]

# Failures whose cause is known, matched against "nodeid :: first line of the error", first match wins.
# kind: "stand-in model" (the test checks what the real model says or how its tokenizer counts),
# "wording" (the right status, other words than vLLM's), "by design" (nanoserve's own answer, not vLLM's),
# "timeout" (slow on a CPU, cause not determined), or "gap" (something nanoserve does not do).
CAUSES: list[tuple[str, str, str]] = [
    (r"test_named_tool_use", "random-weight tiny-qwen3 never ends its thinking: the named tool's call, which comes "
     "after it, never does", "stand-in model"),
    (r"test_function_tool_use\[", "random-weight tiny-qwen3: no tool call of its own (auto), or its thinking or its "
     "call not done within the stand-in's max_new_tokens", "stand-in model"),
    (r"test_include_reasoning", "random-weight tiny-qwen3 never ends its thinking: no content after it",
     "stand-in model"),
    (r"test_thinking_token_budget_limits_reasoning.*missing reasoning start marker",
     "random-weight tiny-qwen3 does not write <think> (the real model opens its thinking with it)", "stand-in model"),
    (r"test_return_token_ids.py::test_chat_completion_with_(emoji_and_token_ids|tool_use)",
     "a Qwen2.5 test: the stand-in renders Qwen3's template (its prompt ends in an empty think block) and random "
     "weights neither stop nor call a tool", "stand-in model"),
    (r"test_more_than_one_prompt_logprobs_chat|test_structured_outputs_regex_chat|test_response_format_json_"
     r"|test_complex_message_content|test_translategemma", "checks what the real model answers", "stand-in model"),
    (r"'length' == 'stop'", "the stand-in's answer does not end by itself: cut at its max_new_tokens",
     "stand-in model"),
    (r"test_models.py::test_check_models", "/v1/models' root is the stand-in's checkpoint", "stand-in model"),
    (r"test_single_chat_session", "counts the real model's prompt tokens (its tokenizer and template)",
     "stand-in model"),
    (r"test_metrics_counts.*expected value", "its counts assume no answer ends before max_tokens: one of the "
     "stand-in's does (sampled at temperature 1)", "stand-in model"),
    (r"test_chat_echo.py::test_prompt_logprobs.*Timeout", "prompt_logprobs -1: the whole vocabulary's log-probs for "
     "every prompt token, millions of JSON entries, past the per-test timeout on this CPU", "timeout"),
    (r"test_metrics_counts.*Timeout \(>", "ten SmolLM2 requests one after another: past the per-test timeout on a "
     "loaded 2-core CPU", "timeout"),
    (r"test_abort_metrics_reset.*assert 1\.0 == 0", "starts with a request of the module's test before it still "
     "running (that test timed out)", "timeout"),
    (r"test_long_seed", "seed outside int64: a 400, without pydantic's error-type names", "wording"),
    (r"test_show_version", "/version is nanoserve's own version", "by design"),
    (r"Timeout \(>", "ran past the per-test timeout on a CPU (cause not determined)", "timeout"),
    (r"logprob_token_ids", "logprob_token_ids refused: the engine returns the top-k log-probs and the drawn "
     "token's, not those of given ids", "gap"),
    (r"beam search", "beam search refused", "gap"),
    (r"run_batch", "no run_batch entry point", "gap"),
]


def vllm_identity(vllm_dir: Path) -> dict:
    """vLLM's version and commit: git's, or the sdist's _version.py."""
    out = {"path": str(vllm_dir)}
    git = subprocess.run(["git", "-C", str(vllm_dir), "rev-parse", "HEAD"], capture_output=True, text=True)
    if git.returncode == 0:
        out["commit"] = git.stdout.strip()
    version_py = vllm_dir / "vllm" / "_version.py"
    if version_py.is_file():
        text = version_py.read_text()
        if m := re.search(r"__version__ = version = '([^']+)'", text):
            out["version"] = m.group(1)
        if "commit" not in out and (m := re.search(r"commit_id = 'g?([0-9a-f]+)'", text)):
            out["commit"] = m.group(1)
    return out


def nanoserve_commit() -> str:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+changes" if dirty else "")


def scratch_tree(vllm_dir: Path, root: Path) -> None:
    tests = root / "tests"
    shutil.copytree(vllm_dir / "tests" / "entrypoints", tests / "entrypoints")
    shutil.copy(vllm_dir / "tests" / "__init__.py", tests / "__init__.py")
    shutil.copy(HERE / "standin_server.py", tests / "utils.py")
    shutil.copy(HERE / "plugin.py", tests / "conftest.py")
    (root / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n"
        "filterwarnings =\n    ignore\n")


def outcome_of(phases: dict) -> tuple[str, str]:
    """A test's setup, call and teardown reports -> (outcome, the error's or the skip's first line)."""
    for when in ("setup", "call", "teardown"):
        rep = phases.get(when)
        if rep and rep["outcome"] == "failed":
            return ("error" if when != "call" else "failed"), rep["message"]
    for when in ("setup", "call"):
        rep = phases.get(when)
        if rep and rep["outcome"] == "skipped":
            return "skipped", rep["message"]
    return ("passed" if "call" in phases else "error"), ""


def classify(tests: dict) -> dict:
    counts: Counter = Counter()
    for nodeid, t in tests.items():
        outcome, message = t["outcome"], t["message"].removeprefix("Skipped: ")
        t["message"] = message
        if outcome == "skipped":
            t["status"] = "not applicable" if message.startswith("not applicable") else "skipped"
        elif not t["servers"]:
            t["status"] = "not applicable"
            t["message"] = "not applicable: unit test of vLLM's own classes (starts no server)"
        else:
            t["status"] = "passed" if outcome == "passed" else "failed"
        if t["status"] == "failed":
            t["cause"], t["kind"] = "unclassified: " + re.sub(r"\d+", "N", message)[:80], "gap"
            for pattern, cause, kind in CAUSES:
                if re.search(pattern, f"{nodeid} :: {message}"):
                    t["cause"], t["kind"] = cause, kind
                    break
        counts[t["status"]] += 1
    return dict(counts)


def summarize(report: dict) -> None:
    """Fill in the report's counts and failure groups from its tests (again, after CAUSES changed)."""
    tests = report["tests"]
    counts = classify(tests)
    groups: dict = defaultdict(list)
    for nodeid, t in tests.items():
        if t["status"] == "failed":
            groups[(t["kind"], t["cause"])].append(nodeid)
    failed = sum(map(len, groups.values()))
    report["counts"] = {"collected": len(tests), "applicable": counts.get("passed", 0) + failed, **counts,
                        "failed by kind": dict(Counter(tests[i]["kind"] for ids in groups.values() for i in ids))}
    report["failures_by_cause"] = [
        {"kind": kind, "cause": cause, "tests": len(ids), "example": ids[0], "first_line": tests[ids[0]]["message"]}
        for (kind, cause), ids in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vllm_dir", type=Path, help="a vLLM source tree with tests/")
    parser.add_argument("--files", nargs="+", default=FILES, help="test files, relative to tests/entrypoints")
    parser.add_argument("-n", type=int, default=2, help="pytest-xdist workers, one file each at a time")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (pytest-timeout)")
    parser.add_argument("--session-timeout", type=int, default=0,
                        help="stop starting tests after this many seconds (0: run them all); counts what ran")
    parser.add_argument("--out", type=Path, default=HERE / "last_run.json")
    parser.add_argument("--keep", action="store_true", help="keep the scratch tree and the servers' logs")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    parser.add_argument("--reclassify", action="store_true", help="only regroup the failures of --out's tests")
    args = parser.parse_args(argv)
    if args.reclassify:
        report = json.loads(args.out.read_text())
        summarize(report)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["counts"], indent=1))
        return 0

    vllm_dir = args.vllm_dir.resolve()
    if not (vllm_dir / "tests" / "entrypoints").is_dir():
        parser.error(f"{vllm_dir} has no tests/entrypoints (a vLLM checkout or unpacked sdist is needed)")
    for plugin in ("pytest_asyncio", "pytest_timeout") + (("xdist",) if args.n > 1 else ()):
        if subprocess.run([sys.executable, "-c", f"import {plugin}"], capture_output=True).returncode:
            parser.error(f"{plugin} is not importable: pip install pytest-asyncio pytest-timeout (README.md)")
    vllm = vllm_identity(vllm_dir)
    root = Path(tempfile.mkdtemp(prefix="vllm-server-tests-"))
    scratch_tree(vllm_dir, root)
    (root / "logs").mkdir()
    results = root / "results.jsonl"
    nanoserve = Path(sys.executable).parent / "nanoserve"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
           "VST_NANOSERVE": str(nanoserve if nanoserve.exists() else "nanoserve"),
           "VST_VLLM_DIR": str(vllm_dir), "VST_VLLM_VERSION": vllm.get("version", "0.0.0"),
           "VST_RESULTS": str(results), "VST_LOG_DIR": str(root / "logs"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--no-header", "-rN",
               f"--timeout={args.timeout}", "--timeout-method=signal",
               *([f"--session-timeout={args.session_timeout}"] if args.session_timeout else []),
               *(["-n", str(args.n), "--dist", "loadfile"] if args.n > 1 else []),
               *[f"tests/entrypoints/{f}" for f in args.files], *args.pytest_args]
    started = datetime.datetime.now(datetime.timezone.utc)
    proc = subprocess.run(command, cwd=root, env=env)
    seconds = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()

    phases: dict = defaultdict(dict)
    for line in results.read_text().splitlines() if results.exists() else []:
        rec = json.loads(line)
        phases[rec["nodeid"]][rec["when"]] = rec
    tests = {}
    for nodeid, ph in phases.items():
        outcome, message = outcome_of(ph)
        servers = [s for rep in ph.values() for s in rep.get("servers", [])]
        unique = {json.dumps(s, sort_keys=True): s for s in servers}
        tests[nodeid.removeprefix("tests/entrypoints/")] = {
            "outcome": outcome, "message": message, "servers": list(unique.values()),
            "seconds": round(sum(rep["duration"] for rep in ph.values()), 1)}
    stubs = sorted({name for p in root.glob("results.jsonl.stubs.*") for name in json.loads(p.read_text())})
    report = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "nanoserve_commit": nanoserve_commit(),
        "vllm": vllm,
        "command": " ".join(["run.py"] + ["VLLM_DIR" if a == str(args.vllm_dir) else a
                                          for a in (sys.argv[1:] if argv is None else argv)]),
        "wall_seconds": round(seconds),
        "pytest_exit_code": proc.returncode,
        "files": args.files,
        "stubbed_vllm_names": stubs,
        "tests": dict(sorted(tests.items())),
    }
    summarize(report)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("counts", "wall_seconds", "nanoserve_commit")}, indent=1))
    if args.keep:
        print(f"scratch tree and server logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
