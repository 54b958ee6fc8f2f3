"""The engine's side: a vLLM-style processor run as one of nanoserve's logits processors.

nanoserve's processors (features/processors.py) are told of a sequence when it first uses one and edit only the
rows of the sequences that asked; vLLM's see the whole persistent batch, each running request at a row index it
keeps until it leaves. VllmAdapter keeps such a batch for its processor: before each draw it finds who joined
(added at the lowest free index, else at the end) and who left (finished, preempted or aborted: removed, and the
last rows moved down into the holes, as vLLM condenses its batch), brings every request's output token list up
to date, calls update_state, then hands apply() the step's logits in the batch's order and puts them back."""
import importlib
import inspect
from dataclasses import dataclass

import torch

from nanoserve.config import DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from nanoserve.features.processors import LogitsProcessor as NanoserveProcessor, Rows, to_device
from nanoserve.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality

METHODS = ("update_state", "apply", "is_argmax_invariant")  # what makes a class a vLLM-style processor


def running(seq) -> bool:
    status = getattr(seq, "status", None)  # (lesson 02's requests have none)
    return seq.finish_reason is None and (status is None or status.name == "RUNNING")


@dataclass
class Member:
    """A request in the persistent batch."""
    seq: object
    output: list[int]  # the list the processor was given: it must stay the same object as it grows
    known: int  # how many leading entries of output are processed tokens (the rest: the device's, or -1)
    preemptions: int  # the sequence's count when it joined: a preempted sequence leaves, and joins again


class PersistentBatch:
    """Who holds which row index, as vLLM's persistent batch: indices 0 .. size - 1, no holes between steps."""

    def __init__(self):
        self.members: list[Member | None] = []
        self.index_of: dict[int, int] = {}  # seq_id -> its index

    def update(self, seqs: list) -> BatchUpdate | None:
        """The change since the last update, now that `seqs` (running) are in the step: None if nothing
        changed. Members that stopped running leave, whether in the step or not."""
        holes = [i for i, m in enumerate(self.members)
                 if not running(m.seq) or getattr(m.seq, "num_preemptions", 0) != m.preemptions]
        for i in holes:
            del self.index_of[self.members[i].seq.seq_id]
            self.members[i] = None
        added = []
        for seq in seqs:
            if seq.seq_id in self.index_of:
                continue
            member = Member(seq, [], 0, getattr(seq, "num_preemptions", 0))
            index = holes.pop(0) if holes else len(self.members)  # a reused index is not reported removed
            if index == len(self.members):
                self.members.append(member)
            else:
                self.members[index] = member
            self.index_of[seq.seq_id] = index
            added.append((index, seq.params, list(seq.prompt_ids), member.output))
        removed, moved = list(holes), []
        for hole in holes:  # condense: the last member moves down into the lowest hole
            while self.members and self.members[-1] is None:
                self.members.pop()
            if hole >= len(self.members):
                break
            member = self.members.pop()
            self.members[hole], self.index_of[member.seq.seq_id] = member, hole
            moved.append((len(self.members), hole, MoveDirectionality.UNIDIRECTIONAL))
        while self.members and self.members[-1] is None:
            self.members.pop()
        if not (removed or added or moved):
            return None
        return BatchUpdate(len(self.members), removed, added, moved)

    @staticmethod
    def sync(member: Member, pending: list[int]) -> None:
        """member's output list: its processed tokens, then `pending` (tokens drawn, not processed yet)."""
        seq, out = member.seq, member.output
        first = seq.num_prompt_tokens
        del out[member.known:]
        out.extend(seq.token_ids[first + member.known:])
        member.known = len(out)
        out.extend(pending)


class VllmAdapter(NanoserveProcessor):
    """One of nanoserve's logits processors that drives a vLLM-style one (`target`, set by adapt()). Every
    request goes through it: a vLLM processor sees every row and decides per row from the params.

    If the processor raises (in __init__, update_state or apply), the step fails with a RuntimeError naming
    the class and the method: the requests of the call that ran it fail with it (a server fails the step's
    requests). The processor is then made afresh, with an empty batch, for the steps that follow."""
    target: type
    model: str | None = None
    max_model_len: int | None = None

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        super().__init__(max_rows, vocab_size, device)
        self.inner = None  # the vLLM-style processor, made at its first step
        self.batch = PersistentBatch()

    @classmethod
    def wanted(cls, params) -> bool:
        check = getattr(cls.target, "validate_params", None)
        if check is not None:
            check(params)  # a ValueError refuses this request alone
        return True

    def vllm_config(self) -> VllmConfig:
        return VllmConfig(ModelConfig(self.model, self.vocab_size, self.max_model_len, torch.float32),
                          SchedulerConfig(self.max_rows, self.max_model_len),
                          DeviceConfig(self.device))

    def apply(self, logits: torch.Tensor, rows: Rows) -> None:
        method = "__init__"
        try:
            if self.inner is None:
                self.inner = self.target(self.vllm_config(), self.device, self.device.type == "cuda")
            method = "update_state"
            step = [(i, seq) for i, seq in enumerate(rows.seqs) if running(seq)]  # (a finished row is dropped)
            update = self.batch.update([seq for _, seq in step])
            self.sync_outputs(rows, step)
            self.inner.update_state(update)
            method = "apply"
            if step:
                self.edit(logits, rows, step)
        except Exception as e:
            self.inner, self.batch = None, PersistentBatch()
            raise RuntimeError(f"logits processor {self.target.__qualname__}.{method} raised "
                               f"{type(e).__name__}: {e}") from e
        except BaseException:  # Ctrl-C in the middle of an update: start afresh too
            self.inner, self.batch = None, PersistentBatch()
            raise

    def sync_outputs(self, rows: Rows, step: list) -> None:
        """Every member's output list up to date. A row's tokens drawn but not processed yet (async
        scheduling) are -1, or their values if the processor asks for them (the last is the row's last input,
        on the device)."""
        pending = {}
        for i, seq in step:
            pending[seq.seq_id] = max(0, rows.steps[i] - (len(seq.token_ids) - seq.num_prompt_tokens))
        needs = getattr(self.inner, "needs_output_token_ids", None)
        last = None
        if any(pending.values()) and needs is not None and needs():
            last = dict(zip((seq.seq_id for _, seq in step),
                            rows.last_inputs()[rows.index[[i for i, _ in step]]].tolist()))
        for member in self.batch.members:
            seq = member.seq
            count = pending.get(seq.seq_id, getattr(seq, "num_placeholders", 0))
            tail = [-1] * count
            if count and last is not None and seq.seq_id in last:
                tail[-1] = last[seq.seq_id]
            self.batch.sync(member, tail)

    def edit(self, logits: torch.Tensor, rows: Rows, step: list) -> None:
        """apply() on the batch's logits: the step's rows at their indices, zeros for members not in the step."""
        at = to_device([self.batch.index_of[seq.seq_id] for _, seq in step], torch.long, self.device)
        take = rows.index if len(step) == len(rows.seqs) else rows.index[[i for i, _ in step]]
        batch = logits.new_zeros((len(self.batch.members), logits.shape[1]))
        batch[at] = logits[take]
        out = self.inner.apply(batch)
        if not isinstance(out, torch.Tensor) or out.shape != batch.shape:
            raise TypeError(f"apply must return the logits [{len(batch)}, {batch.shape[1]}], got "
                            f"{getattr(out, 'shape', type(out).__name__)}")
        logits[take] = out[at].to(logits.dtype)


def find(path: str):
    """vLLM's "module:Class" path (the class may be nested: "module:Outer.Inner")."""
    module, colon, name = path.partition(":")
    if not colon or not name:
        raise ValueError(f"logits_processors: a path is 'module:Class', got {path!r}")
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def adapt(processor, engine_args=None) -> type:
    """EngineArgs.logits_processors' entry as one of nanoserve's LogitsProcessor classes: nanoserve's own as
    they are, a vLLM-style class (or its "module:Class" path) inside a VllmAdapter of its own."""
    if isinstance(processor, str):
        processor = find(processor)
    if isinstance(processor, type) and issubclass(processor, NanoserveProcessor):
        return processor
    if not (isinstance(processor, type) and all(callable(getattr(processor, m, None)) for m in METHODS)):
        raise ValueError("logits_processors must be LogitsProcessor classes (nanoserve's, or vLLM's batch-level "
                         f"ones: {', '.join(METHODS)}) or their 'module:Class' paths, got {processor!r:.100}")
    if inspect.isabstract(processor):
        raise ValueError(f"logits_processors: {processor.__qualname__} is abstract (it lacks "
                         f"{', '.join(sorted(processor.__abstractmethods__))})")
    settings = {name: getattr(engine_args, name, None) for name in ("model", "max_model_len")}
    return type(processor.__name__, (VllmAdapter,),
                {"target": processor, "__qualname__": f"VllmAdapter[{processor.__qualname__}]",
                 "__module__": __name__, **settings})
