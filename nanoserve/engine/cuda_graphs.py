"""CUDA graphs for decode steps: the whole forward (28 layers, ~400 kernels) recorded once per batch
size and replayed with one launch.

A graph replays the exact kernels, pointers and launch sizes it recorded, so
- its inputs are the step-metadata builder's device buffers, which never move (lesson 02): each step
  writes new values into them and replays;
- a batch of n sequences runs the graph of the smallest recorded size >= n; rows n.. are padding:
  token 0 at position 0, slot -1 (its K/V written nowhere), context length 0 (the decode kernel returns
  zeros for it), and their logits are never looked at;
- the attention kernel's split of the context was fixed when recorded, so it is recorded for the
  longest context (max_model_len): a split past a sequence's end does no work.
Prefill and mixed steps (a few dozen in a run of a thousand steps) stay eager.
"""
import bisect

import torch

from nanoserve.cache.metadata import StepMetadata
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.sampler import Sampler
from nanoserve.engine.scheduler import ScheduledBatch


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to record: 1, 2, 4, 8, then every multiple of 16, and max_num_seqs itself so
    every decode batch finds a graph."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest recorded size that holds n sequences (None: larger than every graph)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class GraphModelRunner(ModelRunner):
    """A ModelRunner that replays a CUDA graph for decode steps (cuda_graphs=False: eager, like lesson
    05's, but with another sampler, e.g. lesson 06's FusedSampler)."""

    def __init__(self, model, cache, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 sampler: Sampler | None = None, cuda_graphs: bool = True):
        super().__init__(model, cache, max_num_seqs, max_num_batched_tokens, max_model_len)
        self.sampler = sampler or self.sampler
        self.max_model_len = max_model_len
        self.sizes = graph_sizes(min(max_num_seqs, max_num_batched_tokens)) if cuda_graphs else []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> (graph, its logits)
        if self.sizes:
            self.capture()

    def static_metadata(self, size: int) -> StepMetadata:
        """A decode step of `size` sequences over the builder's device buffers (their full width)."""
        d = self.builder.d
        return StepMetadata(d["input_ids"][:size], d["positions"][:size], d["slot_mapping"][:size],
                            d["block_tables"][:size], d["context_lens"][:size], d["cu_seqlens_q"][:size + 1],
                            d["sample_rows"][:size], True, self.max_model_len, 1)

    def pad(self, n: int, size: int) -> None:
        """Rows n..size of the host buffers become padding (the builder writes rows < n and copies all)."""
        h = self.builder.h
        h["input_ids"][n:size], h["positions"][n:size], h["slot_mapping"][n:size] = 0, 0, -1
        h["context_lens"][n:size] = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, all in one memory pool: a smaller graph reuses the
        memory of a larger one (only one runs at a time)."""
        self.pad(0, self.sizes[-1])
        self.builder.dev.copy_(self.builder.host)
        pool = None
        for size in reversed(self.sizes):
            meta = self.static_metadata(size)
            self._logits(meta)  # a warm-up run outside the graph: compiles kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._logits(meta)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def _logits(self, meta: StepMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(meta.input_ids, meta.positions, self.cache, meta))

    def run(self, batch: ScheduledBatch):
        n = len(batch.seqs)
        size = padded_size(n, self.sizes)
        if size is not None and all(k == 1 for k in batch.num_new):
            self.pad(n, size)  # before the builder's copy, which carries the padding over
        return super().run(batch)

    def forward(self, meta: StepMetadata) -> torch.Tensor:
        n = meta.context_lens.shape[0]
        size = padded_size(n, self.sizes)
        if not meta.is_decode or size is None:
            return super().forward(meta)
        graph, logits = self.graphs[size]
        graph.replay()
        self.cache.tokens_per_forward.append(n)  # what PagedKVCache.attend records in an eager step
        return logits[:n] if meta.sample_rows.shape[0] == n else logits[meta.sample_rows]
