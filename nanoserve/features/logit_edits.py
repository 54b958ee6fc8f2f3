"""vLLM's sampling parameters that edit a row's logits by a rule fixed when the request joins: logit_bias,
allowed_token_ids, min_p, and the bans of min_tokens and bad_words. Each keeps its rows' state on the device,
written once per sequence (add), so that a step costs one batched operation, whatever the vocabulary or the
number of words a request brings."""
import math

import torch

from nanoserve.engine.features import LogitsProcessor, to_device


class RowTable:
    """[max_rows, vocab_size] of one dtype on the device, allocated when first written (a request that asks
    for logit_bias over a 151,936-token vocabulary keeps a row of it, not a Python dict, in the step)."""

    def __init__(self, processor: LogitsProcessor, dtype: torch.dtype, fill):
        self.shape, self.dtype, self.fill, self.device = (processor.max_rows, processor.vocab_size), dtype, fill, \
            processor.device
        self.rows: torch.Tensor | None = None

    def write(self, slot: int, ids: torch.Tensor, values) -> None:
        if self.rows is None:
            self.rows = torch.full(self.shape, self.fill, dtype=self.dtype, device=self.device)
        self.rows[slot] = self.fill
        self.rows[slot, ids.to(self.device, non_blocking=True)] = values


def cached(params, name: str, source, make):
    """make(source), kept on params while params.<field> is still `source`: a request's n completions, and
    every request given the same SamplingParams, build it once."""
    kept = params.__dict__.get(name)
    if kept is None or kept[0] is not source:
        kept = (source, make(source))
        params.__dict__[name] = kept
    return kept[1]


class LogitBias(LogitsProcessor):
    def __init__(self, *args):
        super().__init__(*args)
        self.bias = RowTable(self, torch.float32, 0.0)

    def add(self, slot, seq):
        bias = seq.params.logit_bias
        ids, values = cached(seq.params, "_bias", bias, lambda b: (torch.tensor(list(b)), torch.tensor(list(b.values()))))
        self.bias.write(slot, ids, values.to(self.device, non_blocking=True))

    def apply(self, logits, rows):
        logits.index_add_(0, rows.index, self.bias.rows[rows.slots])


class AllowedTokens(LogitsProcessor):
    def __init__(self, *args):
        super().__init__(*args)
        self.allowed = RowTable(self, torch.bool, False)

    def add(self, slot, seq):
        self.allowed.write(slot, cached(seq.params, "_allowed", seq.params.allowed_token_ids, torch.tensor), True)

    def apply(self, logits, rows):
        logits[rows.index] = logits[rows.index].masked_fill(~self.allowed.rows[rows.slots], float("-inf"))


class MinP(LogitsProcessor):
    """p < min_p * p_max, after temperature T: logit < max logit + T * log(min_p)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.floor = torch.zeros(self.max_rows, device=self.device)

    def add(self, slot, seq):
        self.floor[slot] = seq.params.temperature * math.log(seq.params.min_p)

    def apply(self, logits, rows):
        part = logits[rows.index]
        logits[rows.index] = part.masked_fill(part < part.amax(dim=-1, keepdim=True) + self.floor[rows.slots, None],
                                              float("-inf"))


class BadWords:
    """A request's bad words as token ids, indexed for the step: for each length n, the tokens to ban after an
    output whose last n tokens begin a bad word. A step looks up one key per length, whatever the number of
    words (a list scanned word by word costs 10,000 comparisons a step for 10,000 words)."""

    def __init__(self, words_ids: list[list[int]]):
        self.after: dict[int, dict[tuple, set[int]]] = {}  # n -> the n tokens before a word's last -> its lasts
        for word in words_ids:
            self.after.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), set()).add(word[-1])
        self.single = frozenset(self.after.pop(0, {}).get((), ()))  # words of one token: banned always
        self.multi_token = bool(self.after)  # a ban that depends on the last token drawn
        self.largest = max((max(word) for word in words_ids), default=-1)  # the largest token id in a word

    def banned_after(self, output: list[int]) -> set[int]:
        """The last tokens of words of several tokens whose others end this output."""
        ban = set()
        for n, table in self.after.items():
            if n <= len(output):
                ban |= table.get(tuple(output[len(output) - n:]), set())
        return ban

    def banned(self, output: list[int]) -> set[int]:
        """The tokens that would complete a bad word after this output."""
        return self.single | self.banned_after(output)


def tokenize_bad_words(tokenizer, words: list[str]) -> BadWords:
    """Each bad word as token ids, as it would start the text and after a space (vLLM tokenizes both)."""
    ids = dict.fromkeys(tuple(tokenizer.encode(text, add_special_tokens=False))
                        for word in words for text in (word.lstrip(), " " + word.lstrip()))
    return BadWords([list(t) for t in ids if t])


class BannedTokens(LogitsProcessor):
    """min_tokens (no stop token before it) and bad_words: one-token words are a fixed row of bans; a longer
    word's last token is banned after the rest of it, which needs the output's last tokens on the host."""

    def __init__(self, *args):
        super().__init__(*args)
        self.single = RowTable(self, torch.bool, False)
        self.has_single = [False] * self.max_rows

    def add(self, slot, seq):
        words = seq.bad_words
        self.has_single[slot] = bool(words is not None and words.single)
        if self.has_single[slot]:
            self.single.write(slot, cached(seq.params, "_single_bans", words, lambda w: torch.tensor(sorted(w.single))),
                              True)

    def apply(self, logits, rows):
        ban_rows, ban_ids, fixed = [], [], []
        for r, (seq, step) in enumerate(zip(rows.seqs, rows.steps)):
            ban = set(seq.stop_ids) if step < seq.params.min_tokens else set()
            words = seq.bad_words
            if words is not None and words.multi_token:  # the output is known to here: the step waited for it
                ban |= words.banned_after(seq.output_ids)
            ban_rows += [r] * len(ban)
            ban_ids += ban
            if words is not None and words.single:
                fixed.append(r)
        if ban_rows:
            index = to_device([ban_rows, ban_ids], torch.long, self.device)
            logits[rows.index[index[0]], index[1]] = float("-inf")
        if fixed:
            which = to_device(fixed, torch.long, self.device)
            part = rows.index[which]
            logits[part] = logits[part].masked_fill(self.single.rows[rows.slots[which]], float("-inf"))


def check_drawn(seq, token: int) -> None:
    """Take the token drawn for seq if its own constraints allow it, else raise ValueError: the sampler draws a
    forbidden one only when they forbid every token (allowed_token_ids that are all bad words, say), and the
    request then ends with that error, never with a token it ruled out."""
    output, p = seq.output_ids, seq.params
    broken = ("allowed_token_ids" if seq.allowed is not None and token not in seq.allowed else
              "bad_words" if seq.bad_words is not None and (token in seq.bad_words.single
                                                            or token in seq.bad_words.banned_after(output)) else
              "min_tokens" if token in seq.stop_ids and len(output) < p.min_tokens else None)
    if broken is not None:
        raise ValueError(f"this request's constraints forbid every token after {len(output)} output tokens "
                         f"(allowed_token_ids, bad_words, min_tokens and structured_outputs leave nothing; "
                         f"the draw broke {broken})")
    if seq.matcher is not None and (not seq.matcher.consume_token(token) or seq.matcher.is_error()):
        error = seq.matcher.get_error().strip().split("\n")[0][:300]  # llguidance's, short
        raise ValueError(f"structured_outputs: the grammar cannot go on after {len(output)} output tokens "
                         f"({error or 'no token of its own mask fits what came before'})")
