"""LLM.start_profile() and stop_profile(), as vLLM's: torch's profiler over this process, configured by
EngineArgs.profiler_config (nanoserve.config.ProfilerConfig) or vLLM's older VLLM_TORCH_PROFILER_DIR.

A profile with delay_iterations, max_iterations or torch's schedule counts engine steps: while it runs, this
LLM's engine.step is wrapped by one that counts (put back at the end). Any other profile costs the steps
nothing but the profiler's own recording."""
import logging
import os

import torch

from nanoserve.config import ProfilerConfig

logger = logging.getLogger("nanoserve")


class Profile:
    """One start_profile ... stop_profile span."""

    def __init__(self, config: ProfilerConfig, engine, prefix: str):
        self.config, self.engine, self.prefix = config, engine, prefix
        self.recorder = None  # torch.profiler.profile while the torch profiler runs
        self.state = "waiting"  # -> "recording" -> "done"
        self.steps = self.recorded = 0
        counts = config.delay_iterations or config.max_iterations or config.warmup_iterations
        if counts:
            self._count_steps()
        if not config.delay_iterations:
            self.begin()

    def _count_steps(self) -> None:
        step = self.engine.step

        def counted_step():
            out = step()
            self.after_step()
            return out

        self.engine.step = counted_step  # on the instance: the class's step is untouched

    def after_step(self) -> None:
        self.steps += 1
        if self.state == "waiting" and self.steps == self.config.delay_iterations:
            self.begin()
        elif self.state == "recording":
            self.recorded += 1
            if self.config.warmup_iterations:
                self.recorder.step()
            if self.recorded == self.config.max_iterations:
                self.end()

    def begin(self) -> None:
        c = self.config
        self.state = "recording"
        if c.profiler == "cuda":
            torch.cuda.profiler.start()
            return
        os.makedirs(c.torch_profiler_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = None
        if c.warmup_iterations:
            schedule = torch.profiler.schedule(wait=c.wait_iterations, warmup=c.warmup_iterations,
                                               active=c.active_iterations, repeat=1)
        handler = torch.profiler.tensorboard_trace_handler(c.torch_profiler_dir, worker_name=f"{self.prefix}_rank0",
                                                           use_gzip=c.torch_profiler_use_gzip)
        self.recorder = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=handler,
            record_shapes=c.torch_profiler_record_shapes, profile_memory=c.torch_profiler_with_memory,
            with_stack=c.torch_profiler_with_stack, with_flops=c.torch_profiler_with_flops)
        self.recorder.start()

    def end(self) -> None:
        """Stop recording and write what was recorded; the engine's step is its own again."""
        was, self.state = self.state, "done"
        self.engine.__dict__.pop("step", None)
        if was != "recording":
            return
        if self.config.profiler == "cuda":
            torch.cuda.profiler.stop()
            return
        self.recorder.stop()  # its on_trace_ready writes the Chrome trace
        folder = self.config.torch_profiler_dir
        logger.info("profile: torch's trace is in %s", folder)
        if self.config.torch_profiler_dump_cuda_time_total:
            try:
                averages = self.recorder.key_averages()
            except (AssertionError, RuntimeError):  # nothing was recorded (stopped before the schedule's active steps)
                return
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            with open(os.path.join(folder, "profiler_out_0.txt"), "w") as f:
                f.write(averages.table(sort_by=sort, row_limit=50))


def start_profile(llm, profile_prefix: str | None = None) -> None:
    running = llm.__dict__.get("profiler")
    if running is not None and running.state != "done":
        raise RuntimeError("start_profile: a profile is already running; call stop_profile first")
    config = llm.args.profiler_config or ProfilerConfig.from_environment()
    if config is None or config.profiler is None:
        raise RuntimeError("start_profile: no profiler is configured: make the LLM with profiler_config={'profiler': "
                           "'torch', 'torch_profiler_dir': FOLDER} (or set VLLM_TORCH_PROFILER_DIR=FOLDER first)")
    if config.profiler == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("start_profile: profiler 'cuda' (cudaProfilerStart) needs a CUDA GPU; use 'torch'")
    llm.profiler = Profile(config, llm.engine, profile_prefix or "nanoserve")


def stop_profile(llm) -> None:
    running = llm.__dict__.get("profiler")
    if running is None:
        raise RuntimeError("stop_profile: no profile was started (call start_profile first)")
    llm.profiler = None
    running.end()  # (already done when max_iterations ended it: then nothing is left to do)
