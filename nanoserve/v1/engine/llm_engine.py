"""vLLM's LLMEngine (`from vllm import LLMEngine`): requests added by id, one step at a time, RequestOutputs out.

Lesson 05's LLMEngine (nanoserve.engine.llm_engine) is the step loop underneath, at the level of tokens: its
add_request takes token ids and returns a Sequence, its step() returns (sequence, token) pairs. This class is
the request-level surface vLLM's scripts drive, made over an LLM (which loads the model and builds that loop),
as vLLM's LLMEngine is over its engine core."""
from nanoserve.engine.llm import LLM, CompletionOutput, RequestOutput, complete_output
from nanoserve.engine.output_router import Delta


class LLMEngine:
    """add_request(request_id, prompt, params), step() -> the RequestOutputs of the requests this step moved
    (cumulative: each holds its text and tokens so far; `finished` on the last), has_unfinished_requests(),
    abort_request(ids), reset_prefix_cache(). Several requests run together, as in vLLM."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.requests: dict[str, tuple[RequestOutput, list]] = {}  # id -> (its output, its sequences)
        self.owner: dict[int, str] = {}  # seq_id -> its request's id
        self.news: list[Delta] = []  # deltas routed to this engine, not read yet

    @classmethod
    def from_engine_args(cls, engine_args, **vllm_options) -> "LLMEngine":
        """vLLM's usage_context, stat_loggers and enable_multiprocessing choose how vLLM runs its processes;
        nanoserve runs in this one: refused by name rather than ignored."""
        if vllm_options:
            raise TypeError(f"LLMEngine.from_engine_args: {', '.join(sorted(vllm_options))} not supported "
                            "(nanoserve's engine runs in this process)")
        return cls(LLM(engine_args=engine_args))

    def append(self, delta: Delta) -> None:  # the OutputRouter hands this engine its sequences' deltas
        self.news.append(delta)

    def get_tokenizer(self):
        return self.llm.tokenizer

    def add_request(self, request_id: str, prompt, params) -> None:
        """prompt: a string, token ids, {"prompt": ...} or {"prompt_token_ids": [...]}. A malformed prompt or
        parameters, or a request that can never be served, raises here, as in vLLM."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        if isinstance(prompt, (list, tuple)) and not all(isinstance(t, int) for t in prompt):
            raise TypeError("add_request takes one prompt")
        outputs, seqs = self.llm._submit(self.llm._encode(prompt), params)
        out = outputs[0]
        if out.error:
            raise ValueError(out.error.removeprefix("prompt 0: "))
        out.request_id, group = str(request_id), [seq for _, seq in seqs.values()]
        for seq in group:
            seq.stream_text()  # each step's new text, for the outputs of unfinished requests
            self.owner[seq.seq_id] = out.request_id
        self.requests[out.request_id] = (out, group)
        self.llm.router.add(group, self)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        if not self.news and self.llm.engine.has_unfinished():
            self.llm._step()
        moved, self.news = dict.fromkeys(self.owner.pop(d.seq.seq_id) if d.finished else self.owner[d.seq.seq_id]
                                         for d in self.news), []
        return [self._output(request_id) for request_id in moved]

    def _output(self, request_id: str) -> RequestOutput:
        out, group = self.requests[request_id]
        if all(seq.seq_id not in self.owner for seq in group):  # every completion finished
            del self.requests[request_id]
            complete_output(out, group)
            return out
        return RequestOutput(request_id, out.prompt, out.prompt_token_ids, [  # its completions so far
            CompletionOutput(seq.index, seq.detok.text if seq.detok is not None else "", list(seq.output_ids),
                             seq.finish_reason) for seq in sorted(group, key=lambda s: s.index)], finished=False)

    def abort_request(self, request_ids) -> None:
        """Drop these requests (ids not running are skipped, as in vLLM)."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            _, group = self.requests.pop(str(request_id), (None, []))
            self.llm.router.remove(group)
            for seq in group:
                self.owner.pop(seq.seq_id, None)
                self.llm.engine.scheduler.abort(seq)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the prefix cache's blocks. While requests hold blocks: False (nothing forgotten), unless
        reset_running_requests, which preempts them first (they recompute their tokens at the next steps)."""
        if reset_connector:
            raise ValueError("reset_prefix_cache: reset_connector: nanoserve has no KV connector")
        engine = self.llm.engine
        if reset_running_requests:
            if engine.in_flight is not None:
                raise RuntimeError("reset_prefix_cache(reset_running_requests=True) between steps only: a step "
                                   "is in flight (async scheduling)")
            engine.scheduler.pending_copies = []  # preempted forks recompute their prompt: no block to copy
            for seq in list(engine.scheduler.running):
                engine.scheduler.preempt(seq)
        return self.llm.reset_prefix_cache()
