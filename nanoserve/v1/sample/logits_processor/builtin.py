"""vLLM's helpers for writing batch-level processors: process_dict_updates (state kept in a dict by row index)
and AdapterLogitsProcessor (a per-request callable made batch-level)."""
import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch

from nanoserve.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality

T = TypeVar("T")

# A request's own processor: (output_ids, logits) -> logits, or (prompt_ids, output_ids, logits) -> logits,
# where logits is the request's row [vocab] and output_ids grows as the request draws tokens.
RequestLogitsProcessor = Callable[..., torch.Tensor]


def process_dict_updates(entries: dict[int, T], batch_update: BatchUpdate | None,
                         new_state: Callable[[object, list[int] | None, list[int]], T | None]) -> bool:
    """Bring `entries` ({row index: a request's state}) up to date with a BatchUpdate. new_state(params,
    prompt_ids, output_ids) makes an added request's state, or None if the processor leaves that request alone.
    Returns whether anything changed."""
    if not batch_update:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            entries[index] = state
            changed = True
        else:  # the index may be one a removed request held
            changed |= entries.pop(index, None) is not None
    for a, b, how in batch_update.moved:
        at_a, at_b = entries.pop(a, None), entries.pop(b, None)
        if at_a is not None:
            entries[b] = at_a
        if at_b is not None and how is MoveDirectionality.SWAP:
            entries[a] = at_b
        changed |= at_a is not None or at_b is not None
    return changed


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch-level processor made of per-request callables. Subclass it, say is_argmax_invariant(), and
    write new_req_logits_processor(params): the request's callable, or None to leave its row alone. A
    subclass's own __init__ must call super().__init__(vllm_config, device, is_pin_memory)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # row index -> the request's callable with its token lists bound (the lists grow as it draws)
        self.req_info: dict[int, partial] = {}

    @abstractmethod
    def new_req_logits_processor(self, params) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(self, params, prompt_ids: list[int] | None, output_ids: list[int]) -> partial | None:
        request_processor = self.new_req_logits_processor(params)
        if request_processor is None:
            return None
        takes_prompt = len(inspect.signature(request_processor).parameters) == 3
        return partial(request_processor, *((prompt_ids, output_ids) if takes_prompt else (output_ids,)))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, request_processor in self.req_info.items():
            row = logits[index]
            edited = request_processor(row)
            if edited is not row:  # a new tensor, not the row edited in place
                logits[index] = edited
        return logits
