"""Everything a request can ask for beyond a plain draw (temperature, top-k, top-p, seed, stop, n) is a feature
beside the core: its code is in nanoserve/features/, imported when a request first asks for it, and a step in
which nobody asks runs none of it. FEATURES says which fields of SamplingParams ask for which feature.

Most features edit the logits before the draw: logits processors. Each keeps its state per batch row ("slot")
in device tensors, written when a sequence joins and updated on the device after each draw (the penalties
count the drawn tokens there): a step sends the processors only its rows' slots, in one copy."""
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

# name -> (its class, as "module:name"; does a request with these SamplingParams ask for it?). The logits
# processors edit the logits in this order (bans commute with every edit but min_p, which comes last).
FEATURES = {
    "structured_outputs": ("nanoserve.features.structured_outputs:GrammarMask",
                           lambda p: p.structured_outputs is not None),
    "logit_bias": ("nanoserve.features.logit_edits:LogitBias", lambda p: bool(p.logit_bias)),
    "allowed_token_ids": ("nanoserve.features.logit_edits:AllowedTokens", lambda p: p.allowed_token_ids is not None),
    "penalties": ("nanoserve.features.penalties:Penalties",
                  lambda p: p.repetition_penalty != 1 or bool(p.frequency_penalty or p.presence_penalty)),
    "banned_tokens": ("nanoserve.features.logit_edits:BannedTokens", lambda p: p.min_tokens > 0 or bool(p.bad_words)),
    "min_p": ("nanoserve.features.logit_edits:MinP", lambda p: p.min_p > 0 and p.temperature > 0),
    "logprobs": ("nanoserve.features.logprobs:SampledLogprobs", lambda p: p.logprobs is not None),
    "prompt_logprobs": ("nanoserve.features.logprobs:PromptScorer", lambda p: p.prompt_logprobs is not None),
}
NOT_PROCESSORS = {"logprobs", "prompt_logprobs"}  # features that read the logits but leave them as they are


def features_of(params, custom=()) -> frozenset[str]:
    """The features a request asks for; custom: the LLM's own processors (classes), which say themselves."""
    asked = {name for name, (_, asks) in FEATURES.items() if asks(params)}
    return frozenset(asked | {cls.__name__ for cls in custom if cls.wanted(params)})


def load(name: str, attr: str | None = None):
    """A feature's class, or another attribute of its module, imported now if it was not."""
    module, _, cls = FEATURES[name][0].partition(":")
    return getattr(importlib.import_module(module), attr or cls)


@dataclass
class Rows:
    """The rows of one step that use one logits processor."""
    index: torch.Tensor  # [R] their rows of the step's logits, on the device
    slots: torch.Tensor  # [R] their slots (rows of the processor's state), on the device
    slot_ids: list[int]  # the same slots, on the host
    seqs: list
    steps: list[int]  # the tokens each has drawn before this step's
    last_inputs: Callable  # () -> [B] each row of the step's last input token, on the device


class LogitsProcessor:
    """A feature that edits logits. One instance per engine, made when a request first asks for it.

    - add(slot, seq): seq joins the batch at row `slot` of the processor's device state (after a preemption
      it may join again, at another slot);
    - apply(logits, rows): edit, in place, the float32 logits of these rows (a Rows);
    - drawn(rows, tokens): the tokens just drawn (the whole step's, [B] on the device).
    A processor that reads a sequence's last drawn token on the host (a grammar) has the sequence say so
    (waits_for_last_token): with async scheduling its step's draw then waits until that token is processed
    (the step's forward does not)."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device

    @classmethod
    def wanted(cls, params) -> bool:
        """A custom processor's choice of requests (the built-ins are chosen by FEATURES)."""
        return bool(getattr(params, "extra_args", None) and cls.__name__ in params.extra_args)

    def add(self, slot: int, seq) -> None:
        pass

    def apply(self, logits: torch.Tensor, rows: Rows) -> None:
        raise NotImplementedError

    def drawn(self, rows: Rows, tokens: torch.Tensor) -> None:
        pass


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without a wait: a GPU copies it from pinned memory in its own queue."""
    tensor = torch.as_tensor(values, dtype=dtype)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


class BatchProcessors:
    """The logits processors of one engine, and the slots of the sequences that use them."""

    def __init__(self, max_rows: int, vocab_size: int, device, custom=()):
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, torch.device(device)
        self.custom = {cls.__name__: cls for cls in custom}
        self.names = [n for n in FEATURES if n not in NOT_PROCESSORS] + list(self.custom)
        self.made: dict[str, LogitsProcessor] = {}
        self.slot_of: dict[int, int] = {}  # seq_id -> its slot
        self.holders: dict[int, object] = {}  # slot -> its sequence
        self.free = list(range(max_rows))[::-1]
        self.last: list = []  # (processor, rows, slots) of the last apply: drawn() tells them the tokens

    def processor(self, name: str) -> LogitsProcessor:
        if name not in self.made:
            cls = self.custom[name] if name in self.custom else load(name)
            self.made[name] = cls(self.max_rows, self.vocab_size, self.device)
        return self.made[name]

    def slot(self, seq) -> int:
        """seq's slot: a new one (its state written by each of its processors) if it has none."""
        slot = self.slot_of.get(seq.seq_id)
        if slot is None:
            for old, holder in list(self.holders.items()):  # slots of sequences that stopped running
                status = getattr(holder, "status", None)  # (lesson 02's requests have none)
                if holder.finish_reason is not None or (status is not None and status.name != "RUNNING"):
                    del self.holders[old], self.slot_of[holder.seq_id]
                    self.free.append(old)
            slot = self.slot_of[seq.seq_id] = self.free.pop()
            self.holders[slot] = seq
            for name in seq.features:
                if name in self.names:
                    self.processor(name).add(slot, seq)
        return slot

    def apply(self, logits: torch.Tensor, seqs: list, steps: list[int], last_inputs=None) -> torch.Tensor:
        """The step's logits [B, V] with every processor's edits, float32 (the input is left as it is: its
        log-probs are what logprobs report, as in vLLM). Rows that ask for nothing keep their values.
        last_inputs(): [B] on the device, each row's last input token (a drawn token the host has not seen yet,
        with async scheduling)."""
        users: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            for name in seq.features:
                users.setdefault(name, []).append(i)
        users = {name: users[name] for name in self.names if name in users}
        self.last = []
        if not users:
            return logits
        slot_of = {i: self.slot(seqs[i]) for rows in users.values() for i in rows}
        flat = [x for rows in users.values() for x in (*rows, *(slot_of[i] for i in rows))]
        index, at = to_device(flat, torch.long, self.device), 0  # one copy for every processor's rows and slots
        out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        for name, rows in users.items():
            n, processor = len(rows), self.processor(name)
            part = Rows(index[at:at + n], index[at + n:at + 2 * n], [slot_of[i] for i in rows],
                        [seqs[i] for i in rows], [steps[i] for i in rows], last_inputs)
            at += 2 * n
            processor.apply(out, part)
            self.last.append((processor, part))
        return out

    def drawn(self, tokens: torch.Tensor) -> None:
        for processor, rows in self.last:
            processor.drawn(rows, tokens)
        self.last = []
