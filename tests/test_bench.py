"""`nanoserve bench --profile`: where a step's time goes, measured on the engine as it is; and
`nanoserve bench --features`: what each sampling feature costs."""
import json

import pytest

from nanoserve import LLM
from nanoserve.bench import PHASES, profile_decode
from nanoserve.engine.sampler import Sampler


def test_profile_accounts_for_the_whole_step_and_leaves_the_engine_as_it_was():
    llm = LLM("tiny-qwen3", max_model_len=128, num_gpu_blocks_override=64)
    found = profile_decode(llm, [[1, 2, 3], [4, 5], [6] * 20], num_steps=4)
    phases = found["ms_per_step"]
    assert found["batch"] == 3 and list(phases) == list(PHASES)
    assert all(ms >= 0 for ms in phases.values()) and phases["forward: launch"] > 0 and phases["sample"] > 0
    assert abs(sum(phases.values()) - found["total_ms_per_step"]) < 1e-6
    # the timers are gone, the profiled requests too, and the engine still generates
    engine = llm.engine
    assert "schedule" not in vars(engine.scheduler) and "forward" not in vars(engine.runner)
    assert isinstance(engine.runner.sampler, Sampler)
    assert not engine.has_unfinished() and not llm.cache.block_manager.block_tables
    assert len(llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_profile_runs_on_lesson_06s_engine_and_removes_its_timers():
    llm = LLM("tiny-qwen3", max_model_len=128, num_gpu_blocks_override=64, async_scheduling=True)
    found = profile_decode(llm, [[1, 2, 3], [4, 5]], num_steps=3)
    assert found["ms_per_step"]["sample"] > 0
    assert type(llm.engine.runner.sampler).__name__ == "FusedSampler" and "forward" not in vars(llm.engine.runner)
    assert len(llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids) == 16



def test_features_bench_writes_every_row_and_mixes_features_per_request(tmp_path, capsys):
    from nanoserve.bench import FEATURES, feature_params
    from nanoserve.cli import main

    out = tmp_path / "features.json"
    assert main(["bench", "--features", "--model", "tiny-qwen3", "--num-seqs", "4", "--max-tokens", "4",
                 "--rounds", "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    found = json.loads(out.read_text())
    rows = found["rows"]
    assert found["rounds"] == 2 and found["device"] == "cpu" and list(rows) == list(FEATURES)
    for name, row in rows.items():
        assert len(row["tok_per_s"]) == len(row["seconds"]) == len(row["output_tokens"]) == 2
        assert all(t > 0 for t in row["tok_per_s"]) and all(0 < n <= 4 * 4 for n in row["output_tokens"])
        assert row["ratio_to_plain"] == pytest.approx(row["median_tok_per_s"] / rows["plain"]["median_tok_per_s"])
        assert f"\n| {name} | " in table
        # an output that ended early (a grammar completed) gets a plain twin of the same lengths, timed beside it
        ended_early = any(n < rows["plain"]["output_tokens"][0] for n in row["output_tokens"])
        assert ("ratio_to_same_lengths" in row) == ended_early
    assert rows["plain"]["ratio_to_plain"] == 1.0
    # mixed: request i is request i of the row it names (i % 4); the four features differ from each other and plain
    mixed, plain = feature_params("mixed", [300] * 8, cap=4), feature_params("plain", [300] * 8, cap=4)
    assert [p.seed for p in mixed] == list(range(8)) and {p.max_tokens for p in mixed} == {4}
    for i, p in enumerate(mixed):
        assert p == feature_params(FEATURES["mixed"][i % 4], [300] * 8, cap=4)[i] and p != plain[i]
    assert mixed[0].logprobs == 5 and mixed[1].repetition_penalty == 1.1 and len(mixed[2].logit_bias) == 100
    assert mixed[3].structured_outputs.json_object and len({repr(p) for p in mixed[:4]}) == 4
    assert main(["bench", "--rounds", "3"]) == 2  # --rounds without --features: a usage error, not ignored


def test_stored_results_say_where_they_come_from_and_what_cites_them_exists():
    """bench/results: every JSON names the commit, machine and date of its run; every path the README, the docs
    and bench/README.md cite is there; bench/README.md describes every script in bench/."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    results = root / "bench" / "results"
    stored = sorted(results.rglob("*.json"))
    assert len(stored) > 30
    for path in stored:
        if path.name.endswith("_decode_timeline.json"):  # a trace, whose top level is its timelines
            continue
        found = json.loads(path.read_text())
        assert {"commit", "machine", "date"} <= set(found), f"{path.relative_to(root)} does not say where it is from"
        assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", found["commit"]) and found["machine"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", found["date"]), path
    subdirs = {p.name for p in results.iterdir() if p.is_dir()}
    for doc in ("README.md", "CONTRIBUTING.md", "docs/performance.md", "bench/README.md"):
        text = (root / doc).read_text()
        cited = [root / p.rstrip(".") for p in re.findall(r"bench/[\w./*-]+", text)]
        # the docs name results relative to bench/results: `throughput/h200.json`
        cited += [results / p for p in re.findall(r"`([\w-]+/[\w./*-]*)`", text) if p.split("/")[0] in subdirs]
        for path in cited:
            assert list(path.parent.glob(path.name)) or path.is_dir(), f"{doc} cites {path.relative_to(root)}"
    # the scripts bench/README.md describes are there, and it describes every script the others run or cite
    described = (root / "bench" / "README.md").read_text()
    assert all((root / "bench" / s).is_file() for s in re.findall(r"^\| `([\w-]+\.(?:py|sh))`", described, re.M))
    users = "".join((root / f).read_text() for f in ("bench/run_gpu.sh", "docs/performance.md", "README.md"))
    assert {s for s in re.findall(r"bench/([\w-]+\.(?:py|sh))", users) if f"`{s}`" not in described} == set()
