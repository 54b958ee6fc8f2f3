"""Lesson 06's fused Qwen3, cut for tensor parallelism, and a loader that reads only this rank's slices.

Each rank builds the fused model with its share of the model (`rank_config`: its query heads, its
K/V heads, its columns of the MLP) and swaps four layers for parallel ones: o_proj and down_proj
become row-parallel (an all-reduce each), the embedding and the LM head vocabulary-parallel. The
packed qkv_proj and gate_up_proj need no change: they are column-parallel simply by holding fewer rows.

K/V heads: with at least as many K/V heads as ranks, each rank holds its own share. With fewer
(Qwen3-8B has 8, so TP=16 would; a tiny test model with 1 head at TP=2), each K/V head is
REPLICATED on the ranks whose query heads use it: every rank then holds exactly one K/V head, and
keeps a copy of that head's K/V in its own pool.
"""
from dataclasses import replace
from pathlib import Path

import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.loader import IGNORED_SUFFIXES, open_weights, weight_files
from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM
from nanoserve.model.tp_layers import ParallelLMHead, RowParallelLinear, TPGroup, VocabParallelEmbedding, vocab_shard


def kv_heads_per_rank(config: ModelConfig, group: TPGroup) -> int:
    if config.num_kv_heads >= group.size:
        return group.split(config.num_kv_heads, "key/value heads")
    if group.size % config.num_kv_heads:
        raise ValueError(f"{config.num_kv_heads} key/value heads cannot be replicated evenly over "
                         f"tensor_parallel_size {group.size}")
    return 1  # replicated: group.size // num_kv_heads ranks share each K/V head


def first_kv_head(config: ModelConfig, group: TPGroup) -> int:
    """The first K/V head this rank holds (of the full model's)."""
    if config.num_kv_heads >= group.size:
        return group.rank * kv_heads_per_rank(config, group)
    return group.rank // (group.size // config.num_kv_heads)  # the head this rank's query heads use


def rank_config(config: ModelConfig, group: TPGroup) -> ModelConfig:
    """The model as one rank sees it: its query heads, K/V heads and MLP columns (the vocabulary stays
    whole: it is cut inside the vocabulary-parallel layers, and the engine checks token ids against it)."""
    return replace(config, num_heads=group.split(config.num_heads, "query heads"),
                   num_kv_heads=kv_heads_per_rank(config, group),
                   intermediate_size=group.split(config.intermediate_size, "MLP intermediate features"))


class TPQwen3ForCausalLM(FusedQwen3ForCausalLM):
    """One rank's slice of the model. Its forward takes the same inputs as the whole model's on every
    rank; compute_logits returns the full logits on every rank."""

    def __init__(self, config: ModelConfig, group: TPGroup, compiled: bool = False):
        super().__init__(rank_config(config, group), compiled)
        self.group, self.full_config = group, config
        hidden = config.hidden_size
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, group)
        self.lm_head = ParallelLMHead(config.vocab_size, hidden, group)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # the same rows: both are cut by vocabulary
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(config.num_heads * config.head_dim, hidden, group)
            layer.mlp.down_proj = RowParallelLinear(config.intermediate_size, hidden, group)

    def checkpoint_slices(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Checkpoint tensor name -> (where it goes in this rank's parameters, the dimension it is cut
        along, the first index this rank reads); the destination's size along that dimension says how
        many. Dimension None: the whole tensor (norms)."""
        c, g, D = self.full_config, self.group, self.config.head_dim
        local = self.config
        vocab_start, _ = vocab_shard(c.vocab_size, g)
        out = {}
        for name, dest in self.checkpoint_tensors().items():
            part = name.rsplit(".", 2)[-2]  # q_proj, k_proj, ..., embed_tokens, lm_head, input_layernorm
            if part == "q_proj":
                out[name] = (dest, 0, g.rank * local.num_heads * D)  # rows: this rank's query heads
            elif part in ("k_proj", "v_proj"):
                out[name] = (dest, 0, first_kv_head(c, g) * D)
            elif part in ("gate_proj", "up_proj"):
                out[name] = (dest, 0, g.rank * local.intermediate_size)
            elif part == "o_proj":
                out[name] = (dest, 1, g.rank * local.num_heads * D)  # columns: its heads' outputs
            elif part == "down_proj":
                out[name] = (dest, 1, g.rank * local.intermediate_size)
            elif part in ("embed_tokens", "lm_head"):
                out[name] = (dest, 0, vocab_start)
            else:
                out[name] = (dest, None, 0)
        return out


def load_tp_model(path, group: TPGroup, dtype: torch.dtype, device, compiled: bool = False) -> TPQwen3ForCausalLM:
    """This rank's slice of the checkpoint at `path`, read slice by slice (safetensors' get_slice reads
    only the requested rows or columns from the file): no rank ever holds the whole model."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    with torch.device("meta"):  # shapes only, as lesson 01's loader does
        model = TPQwen3ForCausalLM(config, group, compiled)
        full_shapes = {n: t.shape for n, t in FusedQwen3ForCausalLM(config).checkpoint_tensors().items()}
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty breaks the sharing; tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    slices = model.checkpoint_slices()
    where = weight_files(path)
    expected = {n for n in slices if not (config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected - where.keys())
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    unexpected = sorted(n for n in where if n not in slices and not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"{path}: checkpoint has tensors this model does not use, e.g. {unexpected[:3]}")
    by_file: dict[Path, list[str]] = {}
    for name in sorted(expected):
        by_file.setdefault(where[name], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with open_weights(file) as f:
                for name in names:
                    source = f.get_slice(name)  # nothing read yet: indexing it reads just those bytes
                    if tuple(source.get_shape()) != tuple(full_shapes[name]):
                        raise ValueError(f"{file}: tensor {name} has shape {tuple(source.get_shape())}, "
                                         f"the config says {tuple(full_shapes[name])}")
                    dest, dim, start = slices[name]
                    if dim is None:
                        dest.copy_(source[:])
                        continue
                    # the last vocabulary slice may be short (the rest of its rows is padding)
                    stop = min(start + dest.shape[dim], full_shapes[name][dim])
                    dest.narrow(dim, 0, stop - start).copy_(source[start:stop] if dim == 0 else source[:, start:stop])
                    dest.narrow(dim, stop - start, dest.shape[dim] - (stop - start)).zero_()
    return model.eval()
