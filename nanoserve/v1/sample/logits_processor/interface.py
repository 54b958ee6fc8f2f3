"""vLLM's batch-level logits processor interface, as vLLM's own processors are written against it.

vLLM keeps a persistent batch: each running request holds a row index until it leaves. A processor is told of
the changes before each draw (update_state(BatchUpdate)), keeps its per-row state by index, and edits the whole
batch's logits at once (apply). nanoserve's engine drives such a processor through an adapter (state.py)."""
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at index a moves to index b; a is empty afterwards
    SWAP = auto()  # the requests at a and b trade places


RemovedRequest = int  # the index the request held
# (index, its SamplingParams, its prompt's token ids, its output token ids). The output list is the request's
# own, kept up to date before every update_state: a processor may keep it and read it at any later step.
AddedRequest = tuple[int, object, list[int] | None, list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]  # (from index a, to index b, how)


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the persistent batch since the last update_state. Apply in this order: removed, then
    added, then moved. An added or moved request may land on an index that another held: it replaces it."""
    batch_size: int  # the rows of the logits apply() will get: indices 0 .. batch_size - 1
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A vLLM batch-level logits processor. LLM(model, logits_processors=[YourClass]) makes one per engine:
    YourClass(vllm_config, device, is_pin_memory), with nanoserve.config.VllmConfig (the few settings a
    processor reads). It sees every request and decides per row from the request's SamplingParams (extra_args,
    say)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Refuse (ValueError) a request whose parameters this processor cannot take: that request fails alone."""
        return None

    @abstractmethod
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit the batch's logits [batch_size, vocab] (in place, or not) and return them."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """Does it leave every row's argmax where it was (so greedy rows need not run it)? nanoserve runs it on
        every row either way: the tokens are the same."""
        raise NotImplementedError

    def needs_output_token_ids(self) -> bool:
        """Does it read the values of the output token ids? With async scheduling the last drawn token is
        still on the device at apply time: a processor that says so is given it (a wait for it on a GPU);
        one that does not sees -1 in its place (the list's length is right either way)."""
        return False

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every apply: batch_update says what changed (None: nothing did), and the output token
        lists of the batch's requests have grown by the tokens drawn since."""
        raise NotImplementedError
