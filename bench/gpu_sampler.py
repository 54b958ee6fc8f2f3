"""The sampler's promises on a GPU (issue 20): a filtered-out token is never chosen, top_k=1 is the argmax, and
a row's token does not depend on its batch-mates' parameters -- for lesson 02's Sampler and lesson 06's
FusedSampler, eager and compiled, on bf16 logits, over many seeds; then the same through LLM (CUDA graphs,
async scheduling).

    python bench/gpu_sampler.py --out results.json
"""
import argparse
import json
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.fused_sampler import FusedSampler
from nanoserve.engine.sampler import Sampler, hash_uniform

V = 151936
ISSUE_DRAWS = [(11, 3), (3, 11), (5, 12)]  # (seed, step) whose old uniforms hit 1.0 for some token


def logits_of(shape, n, gen):
    if shape == "peaked":  # all but 1e-8 of the mass on one token
        out = torch.full((n, V), -30.0, device="cuda")
        out[torch.arange(n), torch.randint(0, V, (n,), generator=gen, device="cuda")] = 0.0
        return out.bfloat16()
    if shape == "ties":
        return (torch.randint(-8, 8, (n, V), generator=gen, device="cuda").float() / 4).bfloat16()
    scale = {"flat": 0.05, "normal": 1.0, "sharp": 4.0}[shape]
    return (torch.randn(n, V, generator=gen, device="cuda") * scale).bfloat16()


def nucleus_ok(row_logits, temperature, top_k, top_p, token):
    order = row_logits.double().argsort(descending=True, stable=True)
    keep = order[:top_k] if top_k else order
    probs = (row_logits.double()[keep] / temperature).softmax(-1)
    before = probs.cumsum(-1) - probs
    return token in set(keep[before < top_p + 1e-4].tolist())


def uniforms(rounds):
    gen = torch.Generator(device="cuda").manual_seed(0)
    def e(seeds, steps):
        return -torch.log(hash_uniform(seeds, steps, V))
    compiled = torch.compile(e, dynamic=True)
    worst_u, worst_e, worst_e_compiled = 0.0, float("inf"), float("inf")
    for r in range(rounds):
        seeds = torch.randint(0, 2**62, (512,), generator=gen, device="cuda")
        steps = torch.randint(0, 4096, (512,), generator=gen, device="cuda")
        if r == 0:
            seeds[:3] = torch.tensor([s for s, _ in ISSUE_DRAWS], device="cuda")
            steps[:3] = torch.tensor([t for _, t in ISSUE_DRAWS], device="cuda")
        worst_u = max(worst_u, hash_uniform(seeds, steps, V).max().item())
        worst_e = min(worst_e, e(seeds, steps).min().item())
        worst_e_compiled = min(worst_e_compiled, compiled(seeds, steps).min().item())
    return {"draws": rounds * 512 * V, "max_u": worst_u, "min_E_eager": worst_e, "min_E_compiled": worst_e_compiled}


def properties(name, draw, rounds, gen):
    def sampler(*args):  # the samplers return a device tensor
        return draw(*args).tolist()

    top1_bad = nucleus_bad = mates_bad = rows = 0
    for r in range(rounds):
        for shape in ("flat", "normal", "sharp", "peaked", "ties"):
            n = 64
            logits = logits_of(shape, n, gen)
            seeds = torch.randint(0, 2**62, (n,), generator=gen, device="cuda").tolist()
            steps = torch.randint(0, 4096, (n,), generator=gen, device="cuda").tolist()
            if r == 0:
                for i, (s, t) in enumerate(ISSUE_DRAWS):
                    seeds[i], steps[i] = s, t
            temps = (torch.rand(n, generator=gen, device="cuda") * 1.9 + 0.1).tolist()
            # top_k = 1 is the argmax
            got = sampler(logits, [SamplingParams(temperature=t, top_k=1) for t in temps], seeds, steps)
            top1_bad += sum(g != a for g, a in zip(got, logits.argmax(-1).tolist()))
            # the nucleus is respected
            ks = torch.randint(0, 60, (n,), generator=gen, device="cuda").tolist()
            ps = (torch.rand(n, generator=gen, device="cuda") * 0.99 + 0.01).tolist()
            params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in zip(temps, ks, ps)]
            got = sampler(logits, params, seeds, steps)
            nucleus_bad += sum(not nucleus_ok(logits[i].float(), temps[i], ks[i], ps[i], got[i]) for i in range(n))
            # batch-mates: rows of plain sampling alone vs beside filtered rows
            plain = [SamplingParams(temperature=t) for t in temps]
            alone = sampler(logits, plain, seeds, steps)
            mixed = [plain[i] if i % 2 == 0 else params[i] for i in range(n)]
            together = sampler(logits, mixed, seeds, steps)
            mates_bad += sum(alone[i] != together[i] for i in range(0, n, 2))
            singles = [sampler(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1], steps[i:i + 1])[0] for i in range(8)]
            mates_bad += sum(s != g for s, g in zip(singles, got[:8]))
            rows += n
    return {"sampler": name, "rows": rows, "top_k_1_not_argmax": top1_bad, "outside_nucleus": nucleus_bad,
            "changed_by_batch_mates": mates_bad}


def through_llm():
    out = {}
    with LLM("tiny-qwen3", max_model_len=512) as llm:
        prompts = [f"Prompt number {i}:" for i in range(8)]
        def run(ps, params):
            return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        runner = llm.engine.runner
        out["runner"] = f"ModelRunner, graphs {runner.graphs is not None}, {type(runner.sampler).__name__}"
        out["engine"] = f"LLMEngine, async scheduling {llm.engine.async_scheduling}"
        ref = run(prompts, greedy)
        out["top_k_1_equals_greedy"] = sum(
            run(prompts, SamplingParams(temperature=1.0, top_k=1, seed=s, max_tokens=32, ignore_eos=True)) == ref
            for s in range(8))
        same = 0
        for seed in range(16):
            plain = SamplingParams(temperature=1.0, seed=seed, max_tokens=32, ignore_eos=True)
            nucleus = SamplingParams(temperature=1.0, top_p=0.9, seed=100 + seed, max_tokens=32, ignore_eos=True)
            same += run(prompts[3:4], plain) == run([prompts[3], "Another prompt"], [plain, nucleus])[:1]
        out["seeded_alone_equals_beside_top_p"] = f"{same}/16"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(1)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "uniforms": uniforms(40)}
    result["samplers"] = [properties(name, s, args.rounds, gen) for name, s in [
        ("Sampler (lesson 02)", Sampler()), ("FusedSampler eager", FusedSampler(256, "cuda", compiled=False)),
        ("FusedSampler compiled", FusedSampler(256, "cuda", compiled=True))]]
    result["llm"] = through_llm()
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
