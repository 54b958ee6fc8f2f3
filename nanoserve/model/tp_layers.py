"""Tensor parallelism's layers: each rank holds a slice of a weight matrix and computes a slice of the
layer's work; one collective puts the pieces together.

Two ways to cut a linear layer y = x @ W.T (W is [out_features, in_features], as nn.Linear stores it):
- column-parallel: each rank holds some ROWS of W (some output features). Its output is a slice of y,
  and nothing needs to be communicated as long as the next layer only needs that slice (attention
  heads, the MLP's gate and up).
- row-parallel: each rank holds some COLUMNS of W (some input features) and gets x's matching slice,
  which is what a column-parallel layer left it. Each rank's product is a partial sum of y: one
  all-reduce adds them up. Attention's o_proj and the MLP's down_proj are cut this way, so a whole
  transformer layer costs two all-reduces.
The embedding and the LM head are cut along the vocabulary: each rank holds the rows of its share of
the tokens.

A column-parallel layer is a plain nn.Linear holding fewer rows, so none is defined here; the loader
(model/qwen3_tp.py) decides which rows each rank reads.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class TPGroup:
    """This process's place in a tensor-parallel group (rank of size) and its two collectives, over
    torch.distributed's default process group. At size 1 both are no-ops, and torch.distributed is
    never touched: the same model runs alone."""

    def __init__(self, rank: int = 0, size: int = 1):
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x summed, on every rank (in place)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [rows, n] side by side along the last dimension: [rows, size * n], rank order."""
        if self.size == 1:
            return x
        rows, n = x.shape
        stacked = torch.empty(self.size * rows, n, dtype=x.dtype, device=x.device)  # rank r's x at rows r*rows..
        dist.all_gather_into_tensor(stacked, x.contiguous())
        return stacked.view(self.size, rows, n).permute(1, 0, 2).reshape(rows, self.size * n)

    def split(self, n: int, what: str) -> int:
        """This rank's share of n things (heads, features) that must split evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) do not split evenly over tensor_parallel_size {self.size}")
        return n // self.size


class RowParallelLinear(nn.Linear):
    """Holds in_features / size columns of the full weight; its input is the matching slice of the full
    input, so its product is a partial sum, completed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup):
        super().__init__(group.split(in_features, "input features"), out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


def vocab_shard(vocab_size: int, group: TPGroup) -> tuple[int, int]:
    """(first token id, number of rows) of this rank's vocabulary slice. Every rank holds the same
    number of rows, so the LM head's gather is even: the last rank's tail past the vocabulary is
    zero padding (vocab_size need not split evenly)."""
    rows = -(-vocab_size // group.size)
    return group.rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    """Holds the embedding rows of this rank's tokens. A rank looks up the tokens it holds and writes
    zeros for the others; the all-reduce then gives every rank every token's embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup):
        super().__init__()
        self.group = group
        self.start, rows = vocab_shard(vocab_size, group)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(x * mine[:, None].to(x.dtype))


class ParallelLMHead(nn.Module):
    """Holds the LM head rows of this rank's tokens: each rank computes the logits of its tokens, and an
    all-gather lays them side by side, so every rank has the full logits (only rank 0 samples).
    All-gather rather than gather to rank 0: the same collective on every rank, which a CUDA graph
    records like any other kernel."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        _, rows = vocab_shard(vocab_size, group)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather(F.linear(hidden, self.weight))
        return logits[:, :self.vocab_size]  # drop the last rank's padding rows
