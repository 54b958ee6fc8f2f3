"""Loading checkpoints: single file and sharded, tied and untied, dtypes, and clear errors."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.cache.no_cache import NoCache
from nanoserve.checks.lesson01 import TINY_CONFIGS, hf_tiny_model
from nanoserve.model.loader import eos_token_ids, load_model


def logits(model, ids=(1, 7, 42, 99, 3)):
    ids = torch.tensor(ids)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), NoCache())).float()


@pytest.fixture(scope="module")
def hf_model():
    return hf_tiny_model(**TINY_CONFIGS["qwen3 group=2 head_dim=128"])


@pytest.fixture
def checkpoint(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_single_file_matches_transformers(checkpoint, hf_model):
    model = load_model(checkpoint, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied after loading
    with torch.no_grad():
        want = hf_model(torch.tensor([[1, 7, 42, 99, 3]])).logits[0]
    torch.testing.assert_close(logits(model), want, atol=1e-4, rtol=0)


def test_sharded_with_index_and_untied(tmp_path):
    hf = hf_tiny_model(**TINY_CONFIGS["llama group=2 head_dim=64"], tie=False)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    model = load_model(tmp_path / "sharded", device="cpu")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    with torch.no_grad():
        want = hf(torch.tensor([[1, 7, 42, 99, 3]])).logits[0]
    torch.testing.assert_close(logits(model), want, atol=1e-4, rtol=0)


def test_bf16_checkpoint_loads_in_the_dtype_asked_for(tmp_path, hf_model):
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    hf_model.float()
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    as_bf16 = load_model(tmp_path / "bf16", dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in as_bf16.parameters()} == {torch.bfloat16}
    as_fp32 = load_model(tmp_path / "bf16", device="cpu")  # CPU default: fp32
    assert {p.dtype for p in as_fp32.parameters()} == {torch.float32}
    torch.testing.assert_close(as_fp32.model.norm.weight, as_bf16.model.norm.weight.float(), atol=0, rtol=0)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(checkpoint)


def test_no_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(checkpoint)


def test_missing_tensor(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensors.*model.layers.1.mlp.up_proj.weight"):
        load_model(checkpoint)


def test_wrong_shape_names_file_and_tensor(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors: tensor model.layers.0.self_attn.k_proj.weight has shape \\(3, 3\\)"):
        load_model(checkpoint)


def test_unexpected_tensor(checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="does not use.*mystery"):
        load_model(checkpoint)


def test_missing_shard(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    shard = sorted((tmp_path / "sharded").glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(tmp_path / "sharded")


def test_eos_ids_from_generation_config(checkpoint):
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert eos_token_ids(checkpoint) == {5, 9}
    shutil.rmtree(checkpoint)
