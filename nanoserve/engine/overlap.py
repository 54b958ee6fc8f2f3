"""Overlapping the CPU's work with the GPU's: while the GPU computes one decode step, the CPU schedules
and launches the next one and then processes the step before it.

A decode step's inputs are the tokens the previous step sampled, so the next step is launched before
they are known on the host: its input ids are copied from the previous step's token tensor on the
device, in the GPU's own queue (which runs in order). Everything else about the next step is known on
the host already: each sequence moves on by one position, and a sequence that reaches max_tokens is
left out. A sequence that stops on an end-of-sequence token or a stop string is found out one step
late; the row it computed in the step launched ahead is thrown away.

Only plain decode steps are launched ahead; a step that admits, preempts, prefills or returns
log-probs runs as in lesson 05. Two steps may be in flight, so every host buffer that a step copies
to the GPU is doubled (the builder's, the sampler's) and used in turn.
"""
from dataclasses import dataclass

import torch

from nanoserve.cache.metadata import StepMetadataBuilder
from nanoserve.engine.cuda_graphs import GraphModelRunner, padded_size
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import prepare_inputs
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class LaunchedStep:
    batch: ScheduledBatch  # a decode step: one new token per sequence, every one sampled
    tokens: torch.Tensor  # [num_seqs] sampled, on the device
    host: torch.Tensor  # their copy on the host: valid once `done` has passed
    done: torch.cuda.Event | None  # None on a CPU: everything ran already


class OverlappedModelRunner(GraphModelRunner):
    """GraphModelRunner, plus launch() (queue a decode step, return at once) and collect() (its tokens)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        first = self.builder
        second = StepMetadataBuilder(first.max_num_tokens, first.max_num_seqs, first.h["block_tables"].shape[1],
                                     first.device)
        second.dev, second.d = first.dev, first.d  # its own host buffer, the same device buffer (the graphs')
        self.builders, self.turn = [first, second], 0
        on_gpu = first.device.type == "cuda"
        self.host_tokens = [torch.zeros(first.max_num_seqs, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)]
        self.host_rows = [torch.zeros(first.max_num_seqs, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)]

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, step: list, sample_steps: list[int], feed: LaunchedStep | None = None,
               rows: list[int] | None = None) -> LaunchedStep:
        """Queue a decode step (`step` as the builder takes it). feed, rows: its input ids are feed's tokens
        at these rows, which the host does not know yet."""
        self.builder, host_tokens, host_rows = self.builders[self.turn], self.host_tokens[self.turn], self.host_rows[self.turn]
        self.turn ^= 1
        n = len(step)
        size = padded_size(n, self.sizes)
        if size is not None:
            self.pad(n, size)
        meta = self.builder.build(self.cache, step)
        if feed is not None:  # the GPU copies them in its queue, after feed's sampler has run
            host_rows[:n] = torch.tensor(rows)
            index = host_rows[:n].to(meta.input_ids.device, non_blocking=True)
            meta.input_ids.copy_(feed.tokens.index_select(0, index))
        logits = self.forward(meta)
        seqs = batch.seqs
        tokens = self.sampler.launch(logits, [s.params for s in seqs], [s.seed for s in seqs], sample_steps)
        host = host_tokens[:n]
        host.copy_(tokens, non_blocking=True)
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(batch, tokens, host, done)

    def collect(self, launched: LaunchedStep) -> list[int]:
        if launched.done is not None:
            launched.done.synchronize()  # the CPU waits here, and only here
        return launched.host.tolist()


class OverlappedLLMEngine(LLMEngine):
    """LLMEngine whose decode steps overlap: step() launches the next step before it waits for this one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ahead: LaunchedStep | None = None  # a step launched by the previous call, not yet processed
        self.steps_ahead = 0  # how many steps were launched before the previous one was processed

    def step(self) -> list[tuple[Sequence, int | None]]:
        launched, self.ahead = self.ahead, None
        if launched is None:
            batch = self.scheduler.schedule()
            if not self.plain_decode(batch):
                return self.run_scheduled(batch)  # as in lesson 05
            step, _ = prepare_inputs(batch)
            launched = self.runner.launch(batch, step, [s.num_output_tokens for s in batch.seqs])
        try:
            self.ahead = self.launch_next(launched)
            tokens = self.runner.collect(launched)
            out = self.process_launched(launched.batch, tokens)
            if self.ahead is not None and not any(s.status is SequenceStatus.RUNNING for s in self.ahead.batch.seqs):
                self.ahead = None  # every sequence in it has finished: nothing to wait for
            return out
        except BaseException:
            # The step launched ahead assumed this one would be processed in full; it was not, so it
            # is forgotten (its sequences' counts never included it) and the next step starts afresh.
            self.ahead = None
            raise

    def plain_decode(self, batch: ScheduledBatch) -> bool:
        """One new token per sequence, every one sampled, no log-probs: a step that can run ahead."""
        return bool(batch.seqs) and all(batch.decoding) and not batch.preempted and all(
            s.params.logprobs is None for s in batch.seqs)

    def launch_next(self, launched: LaunchedStep) -> LaunchedStep | None:
        """The decode step after `launched`, launched now, or None where it cannot be known yet."""
        if self.scheduler.waiting or len(self.scheduler.running) != len(launched.batch.seqs):
            return None  # someone waits to be admitted, or was not in this step: schedule normally
        # `launched` is not processed yet: each sequence is one token and one position further than its counts
        rows = [i for i, s in enumerate(launched.batch.seqs)
                if s.status is SequenceStatus.RUNNING and s.num_output_tokens + 1 < s.params.max_tokens]
        seqs = [launched.batch.seqs[i] for i in rows]
        if not seqs or not all(self.cache.grow(s.seq_id, s.num_computed + 2) for s in seqs):
            return None  # nobody left, or blocks are short: the scheduler decides (and may preempt)
        step = [(s.seq_id, s.num_computed + 1, [0]) for s in seqs]  # token 0: a placeholder the GPU overwrites
        batch = ScheduledBatch(seqs, [1] * len(seqs), [True] * len(seqs))
        self.steps_ahead += 1
        return self.runner.launch(batch, step, [s.num_output_tokens + 1 for s in seqs], feed=launched, rows=rows)

    def process_launched(self, batch: ScheduledBatch, tokens: list[int]) -> list[tuple[Sequence, int | None]]:
        """Process a launched step; a sequence that finished (or was aborted) meanwhile drops its row."""
        keep = [i for i, s in enumerate(batch.seqs) if s.status is SequenceStatus.RUNNING]
        live = ScheduledBatch([batch.seqs[i] for i in keep], [1] * len(keep), [True] * len(keep))
        return self.process(live, [tokens[i] for i in keep], [None] * len(keep))
