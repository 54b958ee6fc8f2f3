"""lm-evaluation-harness against `nanoserve serve`, next to lm-eval's own `hf` model on the same checkpoint
(the server's proof of parity): loglikelihood (multiple choice), rolling perplexity and generate_until, on small local
tasks written here (the hub is unreachable), SmolLM2-135M-Instruct in float32 on the CPU.

    python bench/lm_eval_parity.py --python /path/to/venv-with-lm_eval/bin/python [--out FILE]

lm-eval is not one of nanoserve's dependencies: run this with an interpreter that has lm_eval (0.4.13) and
nanoserve importable. It starts the server itself, runs both models, and compares per-document scores."""
import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TEXT = [  # for rolling perplexity: plain prose, a list, some code
    "The river rises in the hills to the north and runs for about two hundred miles before it reaches the sea. "
    "Along the way it passes three market towns, each built where an old road once crossed the water.",
    "To make bread you need flour, water, salt and yeast. Mix them, knead the dough for ten minutes, let it rise "
    "for an hour, shape it, let it rise again, and bake it in a hot oven until the crust is brown.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the seven days of the week. "
    "January is the first month of the year and December is the last.",
]


def tasks(folder: Path) -> list[str]:
    """Three small tasks as lm-eval YAML over local JSON lines."""
    rng = random.Random(0)
    mc, gen = [], []
    for _ in range(40):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        choices = [a + b, a + b + 1, a + b - 1, a + b + 2]
        rng.shuffle(choices)
        mc.append({"question": f"Question: What is {a} plus {b}?\nAnswer:", "choices": [f" {c}" for c in choices],
                   "answer": choices.index(a + b)})
        gen.append({"question": f"2 + 2 = 4\n3 + 5 = 8\n10 + 7 = 17\n{a} + {b} =", "answer": f" {a + b}"})
    colours = [("grass", "green"), ("the sky", "blue"), ("snow", "white"), ("coal", "black"), ("a lemon", "yellow")]
    for thing, colour in colours:
        others = [c for _, c in colours if c != colour][:3]
        mc.append({"question": f"Question: What colour is {thing}?\nAnswer:", "choices": [f" {colour}"] +
                   [f" {c}" for c in others], "answer": 0})
    files = {"mc": mc, "gen": gen, "ppl": [{"text": t} for t in TEXT]}
    for name, rows in files.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "nano_mc.yaml").write_text(
        f"task: nano_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "nano_ppl.yaml").write_text(
        f"task: nano_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (folder / "nano_gen.yaml").write_text(
        f"task: nano_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: [\"\\n\", \",\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    return ["nano_mc", "nano_ppl", "nano_gen"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_lm_eval(python: str, folder: Path, names: list[str], model: str, model_args: str, out: Path) -> dict:
    code = (
        "import json, sys, lm_eval\nfrom lm_eval.tasks import TaskManager\n"
        f"r = lm_eval.simple_evaluate(model={model!r}, model_args={model_args!r}, tasks={names!r}, "
        f"task_manager=TaskManager(include_path={str(folder)!r}), log_samples=True, batch_size=8, device='cpu')\n"
        "keep = {'results': r['results'], 'samples': {t: [{'doc_id': s['doc_id'], 'resps': s['resps'],"
        " 'filtered_resps': s['filtered_resps']} for s in v] for t, v in r['samples'].items()}}\n"
        f"json.dump(keep, open({str(out)!r}, 'w'), default=str)\n")
    subprocess.run([python, "-c", code], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    return json.loads(out.read_text())


def loglikelihoods(result: dict, task: str) -> list[float]:
    """Each request's log-likelihood, in document order (multiple choice: one per choice)."""
    values = []
    for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"]):
        for resp in sample["resps"]:
            first = resp[0]
            values.append(float(first[0] if isinstance(first, (list, tuple)) else first))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="an interpreter with lm_eval installed")
    parser.add_argument("--out", default=str(ROOT / "bench/results/accuracy/cpu_lm_eval.json"))
    args = parser.parse_args()
    from nanoserve.model.zoo import resolve_model
    model_dir = str(resolve_model("smollm2-135m-instruct"))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", model_dir, "--port", str(port),
                               "--device", "cpu", "--dtype", "float32", "--max-model-len", "2048",
                               "--served-model-name", "smollm2", "--disable-log-requests"])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            names = tasks(folder)
            for _ in range(600):  # the server loads the model, then answers /health
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    if server.poll() is not None:
                        raise SystemExit("the server exited")
                    time.sleep(0.5)
            t0 = time.perf_counter()
            ours = run_lm_eval(args.python, folder, names, "local-completions",
                               f"model=smollm2,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={model_dir},"
                               "tokenized_requests=True,max_length=2048", folder / "ours.json")
            t1 = time.perf_counter()
            hf = run_lm_eval(args.python, folder, names, "hf", f"pretrained={model_dir},dtype=float32",
                             folder / "hf.json")
            t2 = time.perf_counter()
    finally:
        server.terminate()
        server.wait(30)
    report = {"model": "smollm2-135m-instruct (float32, CPU)", "seconds": {"nanoserve": t1 - t0, "hf": t2 - t1},
              "metrics": {}, "loglikelihood_max_abs_diff": {}}
    for task in names:
        report["metrics"][task] = {"nanoserve": ours["results"][task], "hf": hf["results"][task]}
    for task in ("nano_mc", "nano_ppl"):
        a, b = loglikelihoods(ours, task), loglikelihoods(hf, task)
        assert len(a) == len(b), (task, len(a), len(b))
        report["loglikelihood_max_abs_diff"][task] = max(abs(x - y) for x, y in zip(a, b))
    gen = [(s["filtered_resps"], t["filtered_resps"]) for s, t in zip(
        sorted(ours["samples"]["nano_gen"], key=lambda s: s["doc_id"]), sorted(hf["samples"]["nano_gen"], key=lambda s: s["doc_id"]))]
    report["generate_until_same_text"] = f"{sum(a == b for a, b in gen)}/{len(gen)}"
    report["generate_until_examples"] = [a for a, _ in gen[:5]]  # (nanoserve's; the targets are " a+b")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items()}, indent=1))


if __name__ == "__main__":
    main()
