"""EngineArgs (vLLM's names, checked when made) and EngineParts (a lesson's own parts, by class or import path)."""
import dataclasses

import pytest

from nanoserve import LLM, EngineArgs, EngineParts, SamplingParams


@pytest.mark.parametrize("field, value", [("max_num_seqs", 0), ("max_model_len", "4096"), ("block_size", True),
                                          ("gpu_memory_utilization", 1.5), ("enable_prefix_caching", "yes"),
                                          ("num_gpu_blocks_override", 0), ("seed", 1.5), ("parts", "mine")])
def test_a_bad_setting_fails_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        EngineArgs("tiny-qwen3", **{field: value})
    with pytest.raises(ValueError, match=field):
        LLM("tiny-qwen3", **{field: value})


def test_an_unknown_setting_is_refused_by_name():
    with pytest.raises(TypeError, match="enable_lora"):
        LLM("tiny-qwen3", enable_lora=True)
    with pytest.raises(ValueError, match="trust_remote_code"):  # vLLM's setting: only False is supported
        LLM("tiny-qwen3", trust_remote_code=True)


def test_engine_args_round_trip_as_vllm_users_write_it():
    args = EngineArgs(model="tiny-qwen3", max_model_len=128, max_num_seqs=4, num_gpu_blocks_override=32, device="cpu")
    prompts, params = ["Hello there", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(**dataclasses.asdict(args)) as a, LLM.from_engine_args(args) as b:
        assert a.engine.scheduler.max_num_seqs == 4 and a.cache.block_manager.num_blocks == 32
        assert [o.outputs[0].token_ids for o in a.generate(prompts, params, use_tqdm=False)] == \
               [o.outputs[0].token_ids for o in b.generate(prompts, params, use_tqdm=False)]


def test_parts_by_class_or_path_and_what_a_spawned_worker_cannot_import():
    from nanoserve.cache.prefix import PrefixCachingKVCache

    class Counting(PrefixCachingKVCache):  # a notebook's own part, say
        made = 0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            Counting.made += 1

    with LLM("tiny-qwen3", max_model_len=64, num_gpu_blocks_override=16, device="cpu",
             parts=EngineParts(prefix_cache=Counting)) as llm:
        llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert type(llm.cache) is Counting and Counting.made == 1
    parts = EngineParts(model=Counting, graphs="nanoserve.engine.cuda_graphs:CUDAGraphs")
    assert parts.path("graphs") == "nanoserve.engine.cuda_graphs:CUDAGraphs"
    assert parts.path("paged_cache") == "nanoserve.cache.paged:PagedKVCache"
    with pytest.raises(ValueError, match="EngineParts.model.*import a class by its path"):
        parts.path("model")
    with pytest.raises(ValueError, match="EngineParts.sampler: cannot import 'nowhere:Sampler'"):
        EngineParts(sampler="nowhere:Sampler").get("sampler")


def test_engine_args_and_settings_together_are_refused():
    args = EngineArgs("tiny-qwen3", device="cpu")
    with pytest.raises(TypeError, match="engine_args alone"):
        LLM("tiny-qwen3", engine_args=args)
    with pytest.raises(TypeError, match="engine_args alone"):
        LLM(engine_args=args, max_num_seqs=4)


def test_an_engine_that_cannot_be_built_raises_instead_of_failing_each_request():
    from nanoserve import LLM

    with LLM("tiny-qwen3", device="cpu", cpu_kv_cache_gib=1e-9) as llm:  # room for no KV block at all
        with pytest.raises(ValueError, match="no memory left for the KV cache"):
            llm.generate(["hello"], use_tqdm=False)


def test_the_engine_freezes_what_it_holds_out_of_the_collector_and_shutdown_gives_it_back():
    # A full collection walks every unfrozen object: with the model's hundreds of thousands frozen, the step
    # loop's pauses stay short; after shutdown the LLM's objects can be collected again.
    import gc
    import weakref

    with LLM("tiny-qwen3", max_model_len=64, num_gpu_blocks_override=16, device="cpu") as llm:
        llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert gc.get_freeze_count() > 10_000
        engine = weakref.ref(llm.engine)
    assert gc.get_freeze_count() == 0 and engine() is None
