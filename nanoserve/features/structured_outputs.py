"""Structured outputs (vLLM's names): the output follows a JSON schema, a regular expression, one of a few
strings, or a grammar. llguidance (a well-kept grammar library; vLLM uses it too) compiles the constraint
and, before each token, says which tokens may come next: a bitmask over the vocabulary. The logits of all
the other tokens become -inf. The masks of a step's rows are filled in parallel (llguidance's own threads)
while the device runs the forward, and applied on the device."""
import json
import threading

import llguidance
import llguidance.gbnf_to_lark
import numpy as np
import torch

from nanoserve.engine.features import LogitsProcessor
from nanoserve.engine.sampling_params import StructuredOutputsParams

_LL_TOKENIZERS: dict = {}  # id(tokenizer) -> (tokenizer, its llguidance twin): building one takes a second
# (id of the twin, the constraint) -> a fresh matcher, compiled once and checked: each request gets a copy (a
# tenth of a millisecond, where compiling takes milliseconds).
_COMPILED: dict = {}
_LOCK = threading.Lock()
CACHED_GRAMMARS = 64  # the most recently compiled constraints kept

# Budgets on what one constraint may cost to compile. A server compiles a request's constraint before it admits
# the request (lesson 08), but the thread that compiles cannot be stopped, so each step must be bounded.
MAX_GRAMMAR_CHARS = 2 * 2**20  # the grammar llguidance compiles, as text: a real schema or regex is far smaller
MAX_GBNF_RULES = 1000  # GBNF -> Lark is pure Python and quadratic in the rules: 1,000 take about a second
# llguidance's own limits: its defaults, with errors that do not repeat the grammar (a server logs them)
LIMITS = dict(verbose_errors=False)


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary, built once per tokenizer: a second of Python that holds the GIL
    (a server builds it as it starts, lesson 08, not while it serves)."""
    with _LOCK:  # one thread builds it; the others wait for that one
        entry = _LL_TOKENIZERS.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            import llguidance.hf  # imported when first used: it imports transformers
            entry = _LL_TOKENIZERS[id(tokenizer)] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer))
    return entry[1]


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The constraint in llguidance's grammar format."""
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        # JSON's whitespace kept to single spaces: free whitespace lets a weak model pad forever
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema if isinstance(schema, str) else json.dumps(schema), defaults={"whitespace_flexible": False})
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # each choice a quoted literal (JSON's escapes are Lark's)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    lark = llguidance.gbnf_to_lark.gbnf_to_lark(spec.grammar) if "::=" in spec.grammar else spec.grammar
    return llguidance.LLMatcher.grammar_from_lark(lark)


def constraint_key(spec: StructuredOutputsParams) -> tuple:
    """The constraint as a hashable value (the cache's key: looked up before any conversion is paid for)."""
    value = json.dumps(spec.json) if isinstance(spec.json, dict) else spec.json  # key order is meaningful
    return value, spec.regex, tuple(spec.choice or ()), spec.grammar, spec.json_object


def grammar_matcher(tokenizer, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
    """A matcher that follows one output token by token, ready for its first token. A constraint that does not
    compile, is over the budgets above, or that llguidance refuses at its first mask (a grammar too complex to
    follow, or one that allows no output at all) raises ValueError, before any request uses it."""
    if tokenizer is None:
        raise ValueError("structured_outputs need the tokenizer: pass tokenizer=...")
    ll = ll_tokenizer(tokenizer)
    key = (id(ll), constraint_key(spec))
    with _LOCK:
        matcher = _COMPILED.get(key)
    if matcher is None:
        matcher = compile_checked(ll, spec)
        with _LOCK:  # a server compiles in several threads
            while len(_COMPILED) >= CACHED_GRAMMARS:
                del _COMPILED[next(iter(_COMPILED))]  # the oldest
            _COMPILED[key] = matcher
    return matcher.deep_copy()


def compile_checked(ll: llguidance.LLTokenizer, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
    if spec.grammar is not None and "::=" in spec.grammar and spec.grammar.count("::=") > MAX_GBNF_RULES:
        raise ValueError(f"structured_outputs: a GBNF grammar may have at most {MAX_GBNF_RULES} rules")
    try:
        grammar = grammar_text(spec)
    except Exception as e:  # a JSON schema or grammar llguidance cannot read
        raise ValueError(f"structured_outputs: {first_line(str(e))}") from None
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"structured_outputs: the compiled grammar is {len(grammar):,} characters, over this "
                         f"engine's limit of {MAX_GRAMMAR_CHARS:,}")
    limits = llguidance.LLParserLimits(**LIMITS)
    error = llguidance.LLMatcher.validate_grammar(grammar, ll, limits=limits)
    matcher = None if error else llguidance.LLMatcher(ll, grammar, limits=limits, log_level=0)
    # The first mask, then a request's copy's: some limits are only met there (a lexer's budget is shared)
    for probe in (matcher, matcher.deep_copy()) if matcher is not None else ():
        words = np.frombuffer(probe.compute_bitmask(), dtype=np.int32)
        if probe.is_error() or not words.any():
            error = f"llguidance refuses it at its first token: {probe.get_error() or 'no token may start it'}"
            break
    if error:
        raise ValueError(f"structured_outputs: {first_line(error)}")
    return matcher


def first_line(error: str) -> str:
    """llguidance's error, short: its first line (the rest can quote the whole grammar)."""
    return error.strip().split("\n")[0][:300]


class GrammarMask(LogitsProcessor):
    """Each row's grammar mask: int32 words (a bit per token), filled for every row at once by llguidance's
    thread pool into pinned host memory, copied in one go, and unpacked on the device."""

    def __init__(self, *args):
        super().__init__(*args)
        self.executor = llguidance.LLExecutor()
        self.host: list[torch.Tensor] = []  # two buffers, used in turn: a copy from one may still be queued
        self.turn = 0

    def apply(self, logits, rows):
        width = (ll_tokenizer(rows.seqs[0].tokenizer).vocab_size + 31) // 32
        if not self.host or self.host[0].shape[1] != width:
            pinned = self.device.type == "cuda"
            self.host = [torch.empty(self.max_rows, width, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        words, self.turn = self.host[self.turn][:len(rows.seqs)], self.turn ^ 1
        # A sequence that finished since the step was launched (its grammar complete) is not drawn for: any mask
        ready = [(seq.matcher, r) for r, seq in enumerate(rows.seqs) if seq.finish_reason is None]
        if len(ready) < len(rows.seqs):
            words.fill_(-1)
        self.executor.unsafe_compute_mask_ptr(ready, words.data_ptr(), width * 4, len(rows.seqs))
        allowed = unpack_bitmask(words.to(self.device, non_blocking=True), self.vocab_size)
        logits[rows.index] = logits[rows.index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool. Bit j of word w (bit 0 the lowest) says whether token
    32 * w + j may come next. Tokens past the words' 32 * W bits may not (a model's vocabulary is often padded
    beyond its tokenizer's)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]; an arithmetic shift, but only bit 0 is kept
    allowed = bits.reshape(bitmask.shape[0], -1).bool()[:, :vocab_size]
    missing = vocab_size - allowed.shape[1]
    return torch.cat([allowed, allowed.new_zeros(allowed.shape[0], missing)], dim=1) if missing > 0 else allowed
