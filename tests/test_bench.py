"""`nanoserve bench --profile`: where a step's time goes, measured on the engine as it is."""
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
