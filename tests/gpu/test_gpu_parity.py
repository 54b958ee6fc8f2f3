"""On a GPU, the model's numbers against transformers' and the Triton kernels' against torch's: logits in bf16,
greedy tokens in float32 (where near-ties cannot excuse a difference), for Qwen3-0.6B's shapes, for head sizes
that are not a power of two, and for SmolLM2's real weights."""
import shutil
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.cache.paged import PagedKVCache  # noqa: E402
from nanoserve.course.generate import generate  # noqa: E402
from nanoserve.course.no_cache import NoCache  # noqa: E402
from nanoserve.model.loader import load_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in lengths]


def _hf(path, dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def _hf_greedy(hf, prompts, steps):
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def test_bf16_logits_follow_transformers(model_dir):
    path = model_dir("qwen3-0.6b-random")
    ours = load_model(path, dtype=torch.bfloat16, device="cuda")
    hf = _hf(path, torch.bfloat16)
    prompt = _prompts([64])[0]
    with torch.inference_mode():
        ids = torch.tensor(prompt, device="cuda")
        mine = ours.compute_logits(ours(ids, torch.arange(len(prompt), device="cuda"), NoCache())).float()
        theirs = hf(ids[None]).logits[0].float()
    # bf16 rounds differently in each library's kernels: close, not equal (the stored H200 run: cosine 0.99987,
    # argmax 58 of 64 positions, where random weights leave near-ties)
    assert torch.nn.functional.cosine_similarity(mine, theirs, dim=-1).min() > 0.995
    assert (mine.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.8


def test_paged_triton_kernels_give_the_contiguous_caches_tokens_in_float32(model_dir):
    model = load_model(model_dir("qwen3-0.6b-random"), dtype=torch.float32, device="cuda")
    prompts = _prompts((15, 16, 17, 64, 100))  # on and around the 16-token block boundaries
    contiguous = [c.token_ids for c in generate(model, prompts, GREEDY)[0]]
    cache = PagedKVCache(model.config, num_blocks=256, block_size=16, dtype=torch.float32, device="cuda")
    paged = [c.token_ids for c in generate(model, prompts, GREEDY, cache=cache)[0]]
    assert paged == contiguous
    assert cache.block_manager.num_free == 256  # every block came back


@pytest.mark.parametrize("head_dim,kv_heads,heads", [(96, 2, 4), (256, 2, 8), (80, 1, 4)])
def test_head_sizes_that_are_not_a_power_of_two_follow_transformers(model_dir, head_dim, kv_heads, heads):
    from nanoserve.checks.lesson01 import hf_tiny_model

    hf = hf_tiny_model("Qwen3ForCausalLM", heads, kv_heads, head_dim, hidden=256, layers=2, vocab=512, tie=False,
                       seed=3)
    prompts = [[5, 9, 2, 44, 17] * k for k in (1, 3, 7)]
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        for f in Path(model_dir("tiny-qwen3")).glob("tokenizer*"):
            shutil.copy(f, tmp)
        with LLM(tmp, dtype="float32", max_model_len=512, num_gpu_blocks_override=256) as llm:
            assert llm.cache.kernels.__name__.endswith("triton_paged")
            ours = [o.outputs[0].token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    assert ours == _hf_greedy(hf.cuda().eval(), prompts, 24)


def test_real_weights_give_transformers_greedy_tokens(model_dir):
    """SmolLM2-135M-Instruct's trained weights in float32 through every fast path (graphs, compiled ops, the
    Triton kernels): trained logits have clear winners, so the tokens must be transformers' own."""
    path = model_dir("smollm2-135m-instruct")
    with LLM(path, dtype="float32", max_model_len=512) as llm:
        texts = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are"]
        prompts = [llm.tokenizer.encode(t) for t in texts]
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == _hf_greedy(_hf(path, torch.float32), prompts, 32)
