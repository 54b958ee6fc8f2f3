"""Checks for lesson 01 (the naive forward). Oracles: Hugging Face transformers and torch SDPA."""
import torch
import transformers
from torch.nn import functional as F

from nanoserve.course.no_cache import NoCache
from nanoserve.model.config import ModelConfig
from nanoserve.model.offline_models import tiny_init

# Small random models covering the shapes that matter: GQA groups 1, 2 and 4, head_dim 64 and 128,
# hidden_size != num_heads * head_dim (as in the real Qwen3 models), and the Llama family.
TINY_CONFIGS = {
    "qwen3 group=1 head_dim=64": dict(arch="Qwen3ForCausalLM", num_heads=4, num_kv_heads=4, head_dim=64, hidden=128),
    "qwen3 group=2 head_dim=128": dict(arch="Qwen3ForCausalLM", num_heads=4, num_kv_heads=2, head_dim=128, hidden=192),
    "qwen3 group=4 head_dim=64": dict(arch="Qwen3ForCausalLM", num_heads=8, num_kv_heads=2, head_dim=64, hidden=96),
    "llama group=2 head_dim=64": dict(arch="LlamaForCausalLM", num_heads=4, num_kv_heads=2, head_dim=64, hidden=256),
}


def _close(what: str, got, want: torch.Tensor, atol: float, hint: str = "") -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(got).__name__}")
    if got.shape != want.shape:
        raise AssertionError(f"{what}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
    err = (got.double() - want.double()).abs().max().item()
    if not err <= atol:  # also catches NaN
        raise AssertionError(f"{what}: max abs error {err:.3g} exceeds {atol:g}. {hint}".strip())


def _spread_init(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise like tiny-qwen3: logits spread out and context-dependent, so greedy tokens
    are unambiguous and a wrong position or a wrong cached key changes them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(tiny_init(name, tuple(p.shape), gen))


def hf_tiny_model(arch: str, num_heads: int, num_kv_heads: int, head_dim: int, hidden: int,
                  layers: int = 2, vocab: int = 512, tie: bool = True, seed: int = 0):
    """A random transformers model (fp32, eager attention) of the given shape."""
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 32, num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=tie, architectures=[arch],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6 if arch.startswith("Qwen3") else 1e4},
    )
    config_cls = transformers.Qwen3Config if arch.startswith("Qwen3") else transformers.LlamaConfig
    model_cls = transformers.Qwen3ForCausalLM if arch.startswith("Qwen3") else transformers.LlamaForCausalLM
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    model = model_cls(config).float().eval()
    _spread_init(model, seed)
    return model


def ours_from_hf(model_cls, hf_model):
    """Build model_cls from a transformers model's config and copy its weights in by name."""
    ours = model_cls(ModelConfig.from_hf(hf_model.config.to_dict()))
    missing, unexpected = ours.load_state_dict(hf_model.state_dict(), strict=False)
    if missing or unexpected:
        raise AssertionError(f"parameter names differ from the checkpoint's: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}. Keep the names given in the lesson.")
    return ours.eval()


def check_rms_norm(rms_norm) -> None:
    gen = torch.Generator().manual_seed(1)
    for shape, eps in [((5, 64), 1e-6), ((3, 7, 128), 1e-5), ((1, 8), 0.5)]:
        x = torch.randn(shape, generator=gen) * 3
        w = 1 + torch.randn(shape[-1], generator=gen) * 0.1
        ref = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(shape[-1], eps=eps)
        ref.weight.data.copy_(w)
        _close(f"rms_norm(x of shape {shape}, eps={eps})", rms_norm(x, w, eps), ref(x), 1e-5,
               "Normalise over the last dim only, and add eps inside the square root.")
    x = (torch.randn(8, 64, generator=gen) * 3).to(torch.bfloat16)
    w = (1 + torch.randn(64, generator=gen) * 0.3).to(torch.bfloat16)  # not ones: the order of the cast shows
    got = rms_norm(x, w, 1e-6)
    if not isinstance(got, torch.Tensor) or got.dtype != torch.bfloat16:
        raise AssertionError("rms_norm of a bfloat16 x must return bfloat16: compute in float32, then cast back")
    ref = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    ref.weight.data.copy_(w)
    if not torch.equal(got, ref(x)):  # bit for bit, as the lesson promises
        raise AssertionError("rms_norm in bfloat16 differs from transformers' in the last bit: compute in float32, "
                             "cast back to x's dtype, and only then multiply by the weight")
    print("✓ rms_norm matches transformers' Qwen3RMSNorm")


def check_apply_rope(apply_rope) -> None:
    gen = torch.Generator().manual_seed(2)
    rope = transformers.models.qwen3.modeling_qwen3
    for T, H, D, theta in [(1, 2, 64, 1e6), (9, 3, 128, 1e6), (6, 4, 64, 1e4)]:
        config = transformers.Qwen3Config(head_dim=D, rope_parameters={"rope_type": "default", "rope_theta": theta})
        positions = torch.randint(0, 4000, (T,), generator=gen)  # any positions, in any order
        x = torch.randn(T, H, D, generator=gen)
        cos, sin = rope.Qwen3RotaryEmbedding(config)(x, positions[None])  # [1, T, D]
        want, _ = rope.apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
        _close(f"apply_rope(x of shape {(T, H, D)})", apply_rope(x, cos[0], sin[0]), want[0].transpose(0, 1), 1e-5,
               "Pair channel j with j + head_dim/2: rotate_half(x) = cat([-x2, x1]); broadcast cos/sin over heads.")
    print("✓ apply_rope matches transformers' apply_rotary_pos_emb")


def check_causal_attention(causal_attention) -> None:
    gen = torch.Generator().manual_seed(3)
    cases = [(1, 1, 2, 2, 64), (7, 7, 4, 4, 64), (7, 7, 4, 2, 128), (5, 12, 8, 2, 64), (1, 9, 6, 2, 128), (4, 4, 3, 1, 64)]
    for Tq, Tk, H, Hkv, D in cases:
        q = torch.randn(Tq, H, D, generator=gen)
        k, v = torch.randn(Tk, Hkv, D, generator=gen), torch.randn(Tk, Hkv, D, generator=gen)
        # Oracle: torch's own attention with an explicit mask; query i sits at position Tk - Tq + i.
        mask = torch.arange(Tk)[None, :] <= (Tk - Tq + torch.arange(Tq))[:, None]
        g = H // Hkv
        want = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1),
                                              v.repeat_interleave(g, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
        hint = ("Query head h uses kv head h // (num_heads // num_kv_heads); scale by 1/sqrt(head_dim); "
                "query i may see keys 0..Tk-Tq+i.")
        _close(f"causal_attention(Tq={Tq}, Tk={Tk}, heads={H}, kv_heads={Hkv}, head_dim={D})",
               causal_attention(q, k, v), want, 1e-5, hint)
    print("✓ causal_attention matches torch's scaled_dot_product_attention (GQA groups 1-4, Tk >= Tq)")


def check_mlp(mlp_cls) -> None:
    for name, shape in list(TINY_CONFIGS.items())[:2]:
        hf = hf_tiny_model(**shape, layers=1)
        ref = hf.model.layers[0].mlp
        ours = mlp_cls(ModelConfig.from_hf(hf.config.to_dict()))
        ours.load_state_dict(ref.state_dict())
        x = torch.randn(5, shape["hidden"], generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            _close(f"MLP ({name})", ours(x), ref(x), 1e-5, "down_proj(silu(gate_proj(x)) * up_proj(x))")
    print("✓ MLP matches transformers")


def _layer_io(hf_model, layer_idx: int, input_ids: torch.Tensor):
    """Run the transformers model and capture one decoder layer's input and output hidden states."""
    seen = {}

    def hook(module, args, kwargs, output):
        seen["in"] = args[0] if args else kwargs["hidden_states"]
        seen["out"] = output[0] if isinstance(output, tuple) else output

    handle = hf_model.model.layers[layer_idx].register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            hf_model(input_ids[None])
    finally:
        handle.remove()
    return seen["in"][0], seen["out"][0]


def check_decoder_layer(layer_cls, backend=None) -> None:
    from nanoserve.model.qwen3 import rope_cos_sin

    backend = backend or NoCache()
    for name, shape in TINY_CONFIGS.items():
        hf = hf_tiny_model(**shape)
        config = ModelConfig.from_hf(hf.config.to_dict())
        ours = layer_cls(config, 1)
        ours.load_state_dict(hf.model.layers[1].state_dict())
        input_ids = torch.randint(0, config.vocab_size, (11,), generator=torch.Generator().manual_seed(5))
        x, want = _layer_io(hf, 1, input_ids)
        cos, sin = rope_cos_sin(torch.arange(11), config.head_dim, config.rope_theta)
        with torch.no_grad():
            got = ours(x, cos, sin, backend)
        _close(f"DecoderLayer ({name})", got, want, 1e-4,
               "Two residual blocks: h = x + attn(norm1(x)); out = h + mlp(norm2(h)).")
    print("✓ DecoderLayer matches transformers (Qwen3 and Llama)")


def check_model(model_cls, backend=None) -> None:
    backend = backend or NoCache()
    for name, shape in TINY_CONFIGS.items():
        hf = hf_tiny_model(**shape, tie=name.startswith("qwen3"))
        ours = ours_from_hf(model_cls, hf)
        gen = torch.Generator().manual_seed(6)
        input_ids = torch.randint(0, 512, (13,), generator=gen)
        # Positions 0..12, then positions that neither start at 0 nor step by 1 (a chunk after a cached
        # prefix, a decode step): an equal shift of every position leaves attention as it was, gaps do not.
        later = 100 + torch.randint(1, 4, (13,), generator=gen).cumsum(0)
        shifted = f" at positions {int(later[0])}, {int(later[1])}, ..."
        for positions, what in [(torch.arange(13), ""), (later, shifted)]:
            with torch.no_grad():
                want = hf(input_ids[None], position_ids=positions[None]).logits[0]
                got = ours.compute_logits(ours(input_ids, positions, backend))
            _close(f"logits{what} ({name})", got, want, 1e-4,
                   "Embed, compute cos/sin once from the positions given (not 0, 1, 2, ...), run every layer, "
                   "then the final norm.")
    print("✓ logits match transformers within 1e-4 for", ", ".join(TINY_CONFIGS))


def hf_greedy(hf_model, prompt_ids: list[int], steps: int) -> list[int]:
    """Greedy tokens from transformers, re-running the full sequence each step (no cache involved)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def check_greedy_tokens(generate_fn, model_cls=None, steps: int = 32) -> None:
    from nanoserve.model.qwen3 import Qwen3ForCausalLM

    model_cls = model_cls or Qwen3ForCausalLM
    for name in ["qwen3 group=2 head_dim=128", "llama group=2 head_dim=64"]:
        hf = hf_tiny_model(**TINY_CONFIGS[name], seed=7, tie=False)  # untied: varied, not repetitive, tokens
        ours = ours_from_hf(model_cls, hf)
        prompt = [3, 141, 59, 26, 5]
        want = hf_greedy(hf, prompt, steps)
        got = list(generate_fn(ours, prompt, max_new_tokens=steps))
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(f"greedy tokens ({name}) differ from transformers at step {first}: "
                                 f"got {got[first:first + 5]}, want {want[first:first + 5]} (lengths {len(got)}, {len(want)})")
    print(f"✓ {steps} greedy tokens identical to transformers (Qwen3 and Llama)")


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "1.1 rms_norm": lambda ns: check_rms_norm(ns["rms_norm"]),
    "1.2 apply_rope": lambda ns: check_apply_rope(ns["apply_rope"]),
    "1.3 causal_attention": lambda ns: check_causal_attention(ns["causal_attention"]),
    "1.4 MLP": lambda ns: check_mlp(ns["MLP"]),
    "1.5 DecoderLayer": lambda ns: check_decoder_layer(ns["DecoderLayer"], ns["NoCache"]()),
    "1.6 model": lambda ns: check_model(ns["Qwen3ForCausalLM"], ns["NoCache"]()),
}
