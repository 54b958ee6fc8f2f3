"""Log-probs, as vLLM returns them: of the model's raw distribution (before temperature, top-k, top-p and the
logits processors). logprobs=k: each drawn token's, and the step's k likeliest, computed on the device for the
whole step at once and copied with its tokens; the {token: Logprob} dicts (and their text) are made when read,
not in the step. prompt_logprobs=k: each prompt token's, scored as its prompt is computed."""
from collections.abc import Sequence

import torch


class Logprob(float):
    """A log-probability (use it as a float) with vLLM's Logprob attributes: .logprob, .rank (1 = likeliest) and
    .decoded_token (the token's text)."""

    def __new__(cls, value: float, rank: int, decoded_token: str | None = None):
        item = super().__new__(cls, value)
        item.rank, item.decoded_token = rank, decoded_token
        return item

    @property
    def logprob(self) -> float:
        return float(self)


def score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple:
    """On the device, for each row: its k likeliest tokens' log-probs, and its target token's log-prob and
    rank (1 + how many tokens were likelier)."""
    logprobs = logits.float().log_softmax(dim=-1)
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    return top.values, top.indices, chosen[:, 0], (logprobs > chosen).sum(dim=-1) + 1


_TEXTS: dict = {}  # id(tokenizer) -> (tokenizer, {token id: its text})


def token_text(tokenizer, token: int) -> str | None:
    """vLLM's Logprob.decoded_token, decoded once per token id."""
    if tokenizer is None:
        return None
    entry = _TEXTS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _TEXTS[id(tokenizer)] = (tokenizer, {})
    texts = entry[1]
    if token not in texts:
        texts[token] = tokenizer.decode([token])
    return texts[token]


def logprob_entry(values, indices, k: int, token: int, chosen: float, rank: int, tokenizer=None) -> dict:
    """{token: Logprob}: a row's k likeliest tokens, and its own token (sampled, or the prompt's)."""
    entry = {int(t): Logprob(float(v), j + 1, token_text(tokenizer, int(t)))
             for j, (t, v) in enumerate(zip(indices[:k], values[:k]))}
    entry[token] = Logprob(float(chosen), int(rank), token_text(tokenizer, token))
    return entry


class SampledLogprobs:
    """logprobs=k for one step: score_rows for every sampled row (on a GPU; on a CPU, those that asked), packed
    as one float32 tensor [rows, 2k + 2] (values, token ids, the drawn token's log-prob and rank: ids and ranks
    below 2**24 are exact) and copied to the host with the step's tokens."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, ks: list[int | None]):
        self.k = max(k for k in ks if k is not None)
        if logits.is_cuda:
            self.rows = list(range(len(ks)))
        else:
            self.rows = [i for i, k in enumerate(ks) if k is not None]
            index = torch.tensor(self.rows)
            logits, tokens = logits[index], tokens[index]
        values, indices, chosen, ranks = score_rows(logits, tokens, self.k)
        packed = torch.cat([values, indices.float(), chosen[:, None], ranks[:, None].float()], dim=1)
        self.host = torch.empty(packed.shape, pin_memory=packed.is_cuda)
        self.host.copy_(packed, non_blocking=True)

    def read(self, tokens: list[int], ks: list[int | None]) -> list:
        """Once the step is done: per sampled row, (its numbers, the drawn token) or None (it did not ask)."""
        numbers = self.host.numpy().copy()  # plain memory: the pinned buffer goes back at once
        out = [None] * len(ks)
        for row, i in enumerate(self.rows):
            if ks[i] is not None:
                out[i] = (numbers[row], tokens[i])
        return out


class LogprobsList(Sequence):
    """A completion's log-probs, as vLLM's list of {token: Logprob} per output token: a dict is made when read
    (LogprobsList[i]), from the numbers the step copied."""

    def __init__(self, k: int, tokenizer=None):
        self.k, self.tokenizer, self.steps = k, tokenizer, []

    def append(self, step) -> None:
        self.steps.append(step)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        numbers, token = self.steps[i]
        packed_k = (len(numbers) - 2) // 2
        return logprob_entry(numbers[:self.k], numbers[packed_k:packed_k + self.k].astype(int), self.k, token,
                             numbers[-2], numbers[-1], self.tokenizer)

    def cumulative(self) -> float:
        """The sum of the drawn tokens' log-probs."""
        return float(sum(numbers[-2] for numbers, _ in self.steps))

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __radd__(self, other) -> list:
        return list(other) + list(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, LogprobsList)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


class PromptScorer:
    """prompt_logprobs for one step: which rows of its logits score prompt tokens (the logits at position p
    score token p + 1), and, as ModelRunner.compute hands it the logits chunk by chunk, their scores. It keeps
    the first num_sampled rows (the sampled ones) and returns them."""

    def __init__(self, num_sampled: int, targets: list[int], k: int, rows=(), spans=()):
        self.num_sampled, self.targets, self.k = num_sampled, targets, k
        self.rows, self.spans = list(rows), list(spans)  # spans: (sequence, first token scored, count)
        self.scores: tuple | None = None

    @classmethod
    def of_step(cls, batch, num_sampled: int) -> "PromptScorer | None":
        """The scorer of a step, or None if none of its rows scores a prompt token."""
        rows, targets, spans, first = [], [], [], 0
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new):
            if seq.scores_prompt:
                lo, hi = max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)
                if lo < hi:
                    rows += range(first + lo - start, first + hi - start)
                    targets += seq.token_ids[lo + 1:hi + 1]
                    spans.append((seq, lo + 1, hi - lo))
            first += n
        k = max((seq.params.prompt_logprobs for seq, _, _ in spans), default=0)
        return cls(num_sampled, targets, k, rows, spans) if rows else None

    def take(self, chunks) -> torch.Tensor:
        kept, scores, at = [], [], 0  # at: the first row of the chunk
        for logits in chunks:
            n = len(logits)
            cut = min(max(self.num_sampled - at, 0), n)  # the chunk's sampled rows come first
            # copied out, not a view: a view of even no rows would keep the whole chunk's memory alive
            kept.append(logits[:cut].clone() if cut < n else logits)
            if cut < n:
                first = at + cut - self.num_sampled
                targets = torch.tensor(self.targets[first:first + n - cut], device=logits.device)
                scores.append(score_rows(logits[cut:], targets, self.k))
            at += n
        self.scores = tuple(torch.cat(parts) for parts in zip(*scores))
        return torch.cat(kept)

    def read(self) -> list[tuple]:
        """(sequence, first prompt token, its entries: {token: Logprob}) per sequence scored, once the step is
        done: the k likeliest tokens and the prompt's own."""
        values, indices, chosen, ranks = (t.tolist() for t in self.scores)
        out, row = [], 0
        for seq, first, count in self.spans:
            out.append((seq, first, [logprob_entry(values[r], indices[r], seq.params.prompt_logprobs,
                                                   seq.token_ids[first + r - row], chosen[r], ranks[r])
                                     for r in range(row, row + count)]))
            row += count
        return out
