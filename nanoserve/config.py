"""vLLM's `vllm.config` names that mean the same here: ProfilerConfig, what LLM.start_profile records
(nanoserve/profiler.py does it), and VllmConfig, a small stand-in for what vLLM hands a logits processor of its
own (nanoserve/v1/sample/logits_processor/), with only the fields of its ModelConfig, SchedulerConfig and
DeviceConfig that such a processor reads. vLLM's full configs (CacheConfig, ParallelConfig, ...) split the
settings that nanoserve keeps in one EngineArgs (nanoserve/engine/engine_args.py): they have no home here, and
a script that imports one fails on that import, by its name. Also here, since they are vLLM's settings too:
those nanoserve refuses (LoRA, pooling models, ...), and the errors that name them."""
import os
from dataclasses import dataclass, field, fields

import torch

PROFILERS = ("torch", "cuda")
# vLLM's older environment variables for the torch profiler, read when no profiler_config is given
ENVIRONMENT = {"VLLM_TORCH_PROFILER_WITH_STACK": "torch_profiler_with_stack",
               "VLLM_TORCH_PROFILER_WITH_FLOPS": "torch_profiler_with_flops",
               "VLLM_TORCH_PROFILER_USE_GZIP": "torch_profiler_use_gzip",
               "VLLM_TORCH_PROFILER_DUMP_CUDA_TIME_TOTAL": "torch_profiler_dump_cuda_time_total",
               "VLLM_TORCH_PROFILER_RECORD_SHAPES": "torch_profiler_record_shapes",
               "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY": "torch_profiler_with_memory"}


@dataclass
class ProfilerConfig:
    """vLLM's profiler settings (EngineArgs.profiler_config, a ProfilerConfig or a dict of its fields).

    profiler "torch" records torch.profiler's trace of this process (the CPU, and CUDA's kernels on a GPU)
    from LLM.start_profile to stop_profile, and writes it to torch_profiler_dir as a Chrome trace
    (`<prefix>_rank0.<time>.pt.trace.json[.gz]`: chrome://tracing or ui.perfetto.dev), with a table of the
    ops' times (`profiler_out_0.txt`) unless torch_profiler_dump_cuda_time_total is off. profiler "cuda"
    brackets the same span with cudaProfilerStart/Stop, for Nsight Systems' --capture-range=cudaProfilerApi.
    delay_iterations skips that many engine steps after start_profile; max_iterations stops after that
    many (0: at stop_profile); warmup_iterations > 0 runs torch's schedule (wait, warmup, then
    active_iterations recorded), as vLLM's. With tensor parallelism the trace is rank 0's process."""
    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    capture_torch_profiler: bool = False  # vLLM's profile of CUDA graph capture: refused when True
    detailed_trace_annotation: bool = False  # vLLM's roofline annotations: refused when True
    ignore_frontend: bool = False  # vLLM's separate front-end process: nanoserve has none, refused when True
    delay_iterations: int = 0
    max_iterations: int = 0
    warmup_iterations: int = 0
    active_iterations: int = 5
    wait_iterations: int = 0

    def __post_init__(self):
        if self.profiler is not None and self.profiler not in PROFILERS:
            raise ValueError(f"profiler_config.profiler must be None, 'torch' or 'cuda', got {self.profiler!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"profiler_config.{f.name} must be True or False, got {value!r}")
            elif f.name.endswith("_iterations"):
                least = 1 if f.name == "active_iterations" else 0
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"profiler_config.{f.name} must be an integer >= {least}, got {value!r}")
        for name, why in (("capture_torch_profiler", "nanoserve's CUDA graphs are recorded before any profile"),
                          ("detailed_trace_annotation", "nanoserve's steps carry no roofline annotations"),
                          ("ignore_frontend", "nanoserve has no front-end process apart from the engine")):
            if getattr(self, name):
                raise ValueError(f"profiler_config.{name}: not supported ({why})")
        if not isinstance(self.torch_profiler_dir, str):
            raise ValueError(f"profiler_config.torch_profiler_dir must be a folder, got {self.torch_profiler_dir!r}")
        if self.torch_profiler_dir and self.profiler != "torch":
            raise ValueError("profiler_config.torch_profiler_dir goes with profiler 'torch'")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("profiler_config: profiler 'torch' needs torch_profiler_dir, the folder for its traces")
        if self.profiler == "cuda" and self.warmup_iterations:
            raise ValueError("profiler_config.warmup_iterations: torch's schedule goes with profiler 'torch'")
        if self.torch_profiler_dir:
            self.torch_profiler_dir = os.path.abspath(os.path.expanduser(self.torch_profiler_dir))

    @classmethod
    def of(cls, value) -> "ProfilerConfig":
        """EngineArgs.profiler_config as given: a ProfilerConfig or a dict of its fields."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"profiler_config must be a ProfilerConfig or a dict of its fields, got {value!r:.80}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"profiler_config: unknown field(s) {', '.join(unknown)}")
        return cls(**value)

    @classmethod
    def from_environment(cls) -> "ProfilerConfig | None":
        """vLLM's older way: VLLM_TORCH_PROFILER_DIR (and VLLM_TORCH_PROFILER_WITH_STACK, ... as 0 or 1)."""
        folder = os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not folder:
            return None
        flags = {}
        for variable, name in ENVIRONMENT.items():
            text = os.environ.get(variable)
            if text is not None:
                if text.strip().lower() not in ("0", "1", "true", "false"):
                    raise ValueError(f"{variable} must be 0 or 1, got {text!r}")
                flags[name] = text.strip().lower() in ("1", "true")
        return cls(profiler="torch", torch_profiler_dir=folder, **flags)


@dataclass
class ModelConfig:
    """The part of vLLM's ModelConfig that logits processors read. (Not nanoserve.model.config.ModelConfig,
    the checkpoint's architecture.)"""
    model: str | None = None  # the model as LLM was given it (a zoo name or a folder)
    vocab_size: int = 0  # the logits' width
    max_model_len: int | None = None
    dtype: torch.dtype = torch.float32  # of the logits a processor is given: nanoserve's processors edit float32

    def get_vocab_size(self) -> int:
        return self.vocab_size


@dataclass
class SchedulerConfig:
    """The part of vLLM's SchedulerConfig that logits processors read: how many rows a batch can have."""
    max_num_seqs: int = 256
    max_model_len: int | None = None


@dataclass
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass
class VllmConfig:
    """Not vLLM's full config: only what a vLLM-style logits processor reads in its __init__ (the batch's
    most rows, the vocabulary, the device). nanoserve's own settings are EngineArgs; a processor that reads
    another of vLLM's configs fails on that attribute, by its name."""
    model_config: ModelConfig = field(default_factory=ModelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)


# vLLM's settings for what nanoserve does not do: LLM(**settings) with one of them says so, by name
UNSUPPORTED = {"enable_lora": "LoRA adapters", "max_loras": "LoRA adapters", "max_lora_rank": "LoRA adapters",
               "runner": "pooling models", "convert": "pooling models", "pooler_config": "pooling models",
               "speculative_config": "speculative decoding", "quantization": "quantized checkpoints",
               "enable_sleep_mode": "sleep mode", "pipeline_parallel_size": "pipeline parallelism",
               "hf_overrides": "overriding the checkpoint's config (YaRN's longer context, say)"}
POOLING = ("embed", "classify", "score", "reward", "encode")  # vLLM's LLM methods for pooling models


def unsupported(settings: dict, error: TypeError) -> TypeError:
    """The error for LLM(**settings) that EngineArgs refused with `error`: vLLM's settings for what nanoserve
    does not do name the feature."""
    named = [f"{name} ({UNSUPPORTED[name]})" for name in settings if name in UNSUPPORTED]
    return TypeError(f"not supported by nanoserve: {', '.join(named)}") if named else error


def no_attribute(name: str) -> AttributeError:
    """An LLM's missing attribute: vLLM's methods for pooling models say why they are missing."""
    if name in POOLING:
        return AttributeError(f"LLM.{name}: pooling models (embeddings, classes, scores, rewards) are not "
                              "supported: nanoserve generates text")
    if name in ("sleep", "wake_up", "is_sleeping"):  # vLLM's sleep mode: hands the GPU's memory to another process
        return AttributeError(f"LLM.{name}: sleep mode is not supported by nanoserve: shut the LLM down "
                              "(LLM.shutdown()) and create it again")
    return AttributeError(f"'LLM' object has no attribute {name!r}")
