"""Checks for lesson 03 (paging). Oracles: a plain-Python model of the pool, and lesson 02's contiguous cache."""
import random
from collections import Counter

import torch

from nanoserve.checks.lesson01 import TINY_CONFIGS, _close, hf_tiny_model, ours_from_hf


def pool_problems(bm) -> list[str]:
    """Invariants of a BlockManager's state: every block free xor held, held blocks counted once per table
    that holds them, tables sized to their tokens."""
    problems = []
    holders = Counter(b for table in bm.block_tables.values() for b in table)
    free = list(bm.free_blocks)
    if sorted(set(holders) | set(free)) != list(range(bm.num_blocks)) or set(holders) & set(free) \
            or len(set(free)) != len(free):
        problems.append(f"blocks lost, duplicated or both free and owned: owned {sorted(holders)}, free {sorted(free)}")
    for b in range(bm.num_blocks):
        if bm.ref_count[b] != holders[b]:
            problems.append(f"block {b}: ref_count {bm.ref_count[b]} but {holders[b]} block tables hold it")
    for seq, table in bm.block_tables.items():
        if len(table) != bm.blocks_for(bm.num_tokens[seq]):
            problems.append(f"sequence {seq!r} holds {bm.num_tokens[seq]} tokens in {len(table)} blocks")
    return problems


def check_block_manager(manager_cls) -> None:
    OutOfBlocks = RuntimeError  # the lesson's OutOfBlocks is a RuntimeError (the notebook has its own class)
    bm = manager_cls(num_blocks=6, block_size=4)
    table = bm.allocate("a", 5)
    if len(table) != 2 or bm.num_free != 4:
        raise AssertionError(f"allocate('a', 5) with block_size 4 should take 2 blocks, took {table}")
    if bm.append("a", 3) != [] or len(bm.block_tables["a"]) != 2:
        raise AssertionError("5 + 3 = 8 tokens still fit in 2 blocks of 4: append must not take a block")
    if len(bm.append("a", 1)) != 1:
        raise AssertionError("the 9th token needs a 3rd block")
    bm.allocate("b", 12)
    for bad, error in [(lambda: bm.append("a", 4), OutOfBlocks), (lambda: bm.allocate("c", 1), OutOfBlocks),
                       (lambda: bm.allocate("d", 25), ValueError)]:
        before = (dict(bm.num_tokens), {s: list(t) for s, t in bm.block_tables.items()}, list(bm.free_blocks))
        try:
            bad()
        except error:
            pass
        else:
            raise AssertionError(f"expected {'OutOfBlocks' if error is RuntimeError else error.__name__} when the "
                                 f"pool is full (ValueError when a request can never fit)")
        after = (dict(bm.num_tokens), {s: list(t) for s, t in bm.block_tables.items()}, list(bm.free_blocks))
        if after != before:
            raise AssertionError("a failed allocate/append changed the pool: check before taking any block")
    bm.free("a")
    try:
        bm.free("a")
        raise AssertionError("freeing twice must raise")
    except KeyError:
        pass
    # A random workload against the invariants.
    random_workload(manager_cls(num_blocks=40, block_size=3), 600, random.Random(0),
                    draw_prompt=lambda rng: [0] * rng.randint(1, 20),
                    admit=lambda bm, seq, tokens: bm.allocate(seq, len(tokens)),
                    problems=lambda bm, live: pool_problems(bm) or (
                        [] if bm.num_tokens == {s: len(t) for s, t in live.items()} else ["token counts wrong"]))
    print("✓ BlockManager: allocation, growth, freeing, errors without corruption, 600 random operations")


def random_workload(bm, steps: int, rng: random.Random, draw_prompt, admit, problems) -> dict:
    """Random allocate / append / free on a block manager; after each operation, problems(bm, live) must
    be empty (live: each live sequence's tokens). draw_prompt(rng) gives a new prompt, admit allocates it."""
    live = {}
    for step in range(steps):
        if live and rng.random() < 0.3:
            seq = rng.choice(sorted(live))
            bm.free(seq)
            del live[seq]
        elif live and rng.random() < 0.6:
            seq = rng.choice(sorted(live))
            new = [rng.randrange(50) for _ in range(rng.randint(1, 5))]
            if bm.can_append(seq, len(new)):
                bm.append(seq, len(new))
                live[seq] += new
                bm.commit(seq, live[seq], len(live[seq]))  # a finished step (a no-op before lesson 04)
        else:
            tokens = draw_prompt(rng)
            if bm.can_allocate(len(tokens)):
                admit(bm, step, tokens)
                live[step] = tokens
        if found := problems(bm, live):
            raise AssertionError(f"after {step + 1} random operations: {found[:3]}")
    return live


def check_slot_mapping(manager_cls) -> None:
    bm = manager_cls(num_blocks=10, block_size=4)
    bm.allocate("x", 3)
    bm.allocate("y", 9)
    bm.append("x", 6)  # x: 9 tokens over blocks [0, 5, 6]
    for seq in ("x", "y"):
        table = bm.block_tables[seq]
        want = [table[p // 4] * 4 + p % 4 for p in range(bm.num_tokens[seq])]
        got = bm.slots(seq, 0, bm.num_tokens[seq])
        if got != want:
            raise AssertionError(f"slots of {seq!r} with block table {table}: got {got}, want {want}")
    everything = bm.slots("x", 0, 9) + bm.slots("y", 0, 9)
    if len(set(everything)) != len(everything):
        raise AssertionError("two tokens share a slot")
    print("✓ slot mapping: block_table[p // block_size] * block_size + p % block_size, no slot shared")


def check_gather_kv(gather_kv) -> None:
    gen = torch.Generator().manual_seed(13)
    # kv_heads larger than block_size too: a block_size read from the wrong dimension shows
    for block_size, length, kv_heads in [(4, 1, 2), (4, 4, 2), (4, 9, 2), (16, 33, 2), (2, 5, 4), (1, 3, 8)]:
        cache = torch.randn(12, block_size, kv_heads, 8, generator=gen)
        table = torch.randperm(12, generator=gen)[: -(-length // block_size)].to(torch.int32)
        padded = torch.cat([table, torch.full((3,), -1, dtype=torch.int32)])  # tables are padded with -1
        want = torch.cat([cache[b] for b in table.tolist()])[:length]
        _close(f"gather_kv(block_size={block_size}, length={length})", gather_kv(cache, padded, length), want, 0,
               "Index the cache with the table's first ceil(length / block_size) ids, flatten, cut to length.")
    # Past the sequence's blocks a table may hold anything (padding, a longer row): ids of no block here,
    # which raise if read. Reading them would cost a block each, up to the whole row's width.
    cache, table = torch.randn(12, 4, 2, 8, generator=gen), torch.tensor([3, 7, 12, 40, 99], dtype=torch.int32)
    try:
        got = gather_kv(cache, table, 7)
    except IndexError as e:
        raise AssertionError(f"gather_kv(length=7, block_size=4) read past the sequence's 2 blocks ({e}): read "
                             f"only the table's first ceil(length / block_size) ids") from None
    _close("gather_kv through a table with ids past its blocks", got, cache[[3, 7]].flatten(0, 1)[:7], 0)
    print("✓ gather_kv reads a sequence's tokens back in order through its block table")


def check_paged_generate(cache_cls) -> None:
    from nanoserve.course.generate import generate
    from nanoserve.model.qwen3 import Qwen3ForCausalLM
    from nanoserve.engine.sampling_params import SamplingParams

    block_size = 4
    # Prompt lengths just under, on and over block boundaries; outputs that cross several.
    prompts = [[7] * 3, [8, 9, 10, 11], [12] * 5, list(range(20, 28)), [3]]
    max_tokens = [6, 4, 11, 1, 9]
    for name in ["qwen3 group=2 head_dim=128", "llama group=2 head_dim=64"]:
        model = ours_from_hf(Qwen3ForCausalLM, hf_tiny_model(**TINY_CONFIGS[name], seed=14, tie=False))
        params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
        want = [c.token_ids for c in generate(model, prompts, params)[0]]
        cache = cache_cls(model.config, num_blocks=32, block_size=block_size)
        got = [c.token_ids for c in generate(model, prompts, params, cache=cache)[0]]
        if got != want:
            raise AssertionError(f"{name}: paged {got} != contiguous {want}")
        if cache.block_manager.num_free != 32 or cache.block_manager.block_tables:
            raise AssertionError(f"{name}: blocks not all returned: {cache.block_manager.num_free} of 32 free")
    print("✓ paged cache: greedy tokens identical to the contiguous cache; every block returned")


def _paged_case(lengths, heads, kv_heads, head_dim, block_size, dtype, device, seed):
    """Random K/V for sequences of `lengths` in a shuffled paged cache, with block tables."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in lengths]
    num_blocks = sum(pages) + 2
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    for b, p in enumerate(pages):
        tables[b, :p] = ids[sum(pages[:b]):sum(pages[:b]) + p]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return gen, k_cache, v_cache, tables.to(device), lens


def _kernel_setting():
    """bf16 on a GPU; fp32 in Triton's interpreter on a CPU (which is wrong for bf16)."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16, 2e-2
    return "cpu", torch.float32, 1e-4


def check_triton_decode(paged_decode_attention) -> None:
    from nanoserve.kernels import paged as reference

    device, dtype, atol = _kernel_setting()
    for lengths, heads, kv_heads, splits in [([1, 37, 200], 4, 2, 1), ([130, 64, 5], 8, 2, 3)]:
        gen, k_cache, v_cache, tables, lens = _paged_case(lengths, heads, kv_heads, 64, 16, dtype, device, 15)
        q = torch.randn(len(lengths), heads, 64, generator=gen).to(device, dtype)
        want = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens)
        got = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=splits)
        _close(f"Triton decode (lengths {lengths}, {heads} heads / {kv_heads} kv heads, {splits} splits)",
               got.float(), want.float(), atol,
               "Online softmax: m_new = max(m, row max of s); alpha = exp2(m - m_new); p = exp2(s - m_new); "
               "l = l * alpha + row sum of p.")
    print(f"✓ Triton decode kernel matches the torch paged attention ({device}, {str(dtype)[6:]}), with and without splits")


def check_triton_prefill(paged_prefill_attention) -> None:
    from nanoserve.kernels import paged as reference

    device, dtype, atol = _kernel_setting()
    lengths, new = [70, 16, 33], [70, 5, 1]  # the first has no cached prefix, the others do
    gen, k_cache, v_cache, tables, lens = _paged_case(lengths, 4, 2, 64, 16, dtype, device, 16)
    q = torch.randn(sum(new), 4, 64, generator=gen).to(device, dtype)
    cu = torch.tensor([0, 70, 75, 76], dtype=torch.int32, device=device)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables)
    _close("Triton prefill", paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables).float(), want.float(), atol)
    print(f"✓ Triton prefill kernel matches the torch paged attention ({device}, {str(dtype)[6:]}), cached prefixes included")


NO_TRITON = ("Triton is not installed here (it ships for Linux): this section's kernels are skipped; the torch "
             "path above is what your CPU runs. On a Linux machine `pip install triton` (a CUDA build of PyTorch "
             "brings it) runs them, in Triton's interpreter where there is no GPU, and exercise 3.4 with them.")
TRITON_MODULE = "#| export kernels.triton_paged"  # first line of the cells that define the kernels
NEEDS_TRITON = "# needs Triton"  # a line of each other cell that runs them (the checks)


def needs_triton(lines: list[str]) -> bool:
    """Whether a cell (its lines) defines or runs the Triton kernels."""
    return bool(lines) and lines[0].rstrip() == TRITON_MODULE or any(line.strip() == NEEDS_TRITON for line in lines)


def _skip_if_needs_triton(lines: list[str]) -> list[str]:
    """An IPython input transformer: a cell that needs Triton becomes one that says it was skipped."""
    return ['print("skipped: this cell needs Triton (see above)")\n'] if needs_triton(lines) else lines


def have_triton() -> bool:
    """True where triton can be imported. Where it cannot (macOS, Windows), print why, and have this notebook
    skip each later cell that defines or runs the kernels: IPython hands every cell's code to an input
    transformer before running it, and ours replaces such a cell's code by a print. The cells themselves, and
    the module they export, stay exactly what they are on Linux."""
    import importlib.util

    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:  # running the cell again must not stack a second transformer
        shell.input_transformers_post[:] = [t for t in shell.input_transformers_post if t is not _skip_if_needs_triton]
    if importlib.util.find_spec("triton") is not None:
        return True
    print(NO_TRITON)
    if shell is not None:
        shell.input_transformers_post.append(_skip_if_needs_triton)
    return False


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "3.1 block manager": lambda ns: check_block_manager(ns["BlockManager"]),
    "3.2 slot mapping": lambda ns: check_slot_mapping(ns["BlockManager"]),
    "3.3 gather_kv": lambda ns: check_gather_kv(ns["gather_kv"]),
    # On a CPU the kernel runs only in Triton's interpreter, switched on before triton is first imported.
    "3.4 Triton decode": lambda ns: check_triton_decode(ns["paged_decode_attention"]),
}
