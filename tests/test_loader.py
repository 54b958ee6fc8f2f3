"""Loading checkpoints: single file and sharded, tied and untied, dtypes, and clear errors."""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.cache.no_cache import NoCache
from nanoserve.checks.lesson01 import TINY_CONFIGS, hf_tiny_model
from nanoserve.model.loader import eos_token_ids, load_model, load_tokenizer
from nanoserve.model.zoo import resolve_model


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


# ---- broken checkpoints: each fails with a ValueError (or FileNotFoundError) naming the file


def names(file):
    """A `match=` pattern for an error message that names `file`."""
    return re.escape(str(file))


def edit_config(checkpoint, **changes):
    config = json.loads((checkpoint / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (checkpoint / "config.json").write_text(json.dumps(config))


@pytest.fixture
def sharded(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    return tmp_path / "sharded"


@pytest.mark.parametrize("keep", [0, 1000], ids=["empty", "truncated"])
def test_damaged_safetensors_names_file(checkpoint, keep):
    file = checkpoint / "model.safetensors"
    file.write_bytes(file.read_bytes()[:keep])
    with pytest.raises(ValueError, match=names(file) + ": not a readable safetensors file"):
        load_model(checkpoint, device="cpu")


def test_truncated_shard_names_file(sharded):
    shard = sorted(sharded.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=names(shard) + ": not a readable safetensors file"):
        load_model(sharded, device="cpu")


def test_config_not_a_json_object(checkpoint):
    (checkpoint / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + ": expected a JSON object"):
        load_model(checkpoint, device="cpu")


def test_config_missing_keys_names_them(checkpoint):
    edit_config(checkpoint, hidden_size=None, num_hidden_layers=None)
    with pytest.raises(ValueError, match=names(checkpoint / "config.json")
                       + ": missing required key\\(s\\) hidden_size, num_hidden_layers"):
        load_model(checkpoint, device="cpu")


@pytest.mark.parametrize("key, value", [("num_hidden_layers", "2"), ("hidden_size", 0), ("num_attention_heads", -2),
                                        ("vocab_size", True), ("intermediate_size", 96.5), ("rms_norm_eps", "1e-6")])
def test_config_bad_value_names_key(checkpoint, key, value):
    edit_config(checkpoint, **{key: value})
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + f": {key} is {re.escape(repr(value))}"):
        load_model(checkpoint, device="cpu")


def test_index_not_json_names_file(sharded):
    index = sharded / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=names(index) + ": not valid JSON"):
        load_model(sharded, device="cpu")


@pytest.mark.parametrize("content", [{"metadata": {}}, {"weight_map": ["model-00001-of-00002.safetensors"]}],
                         ids=["no weight_map", "weight_map is a list"])
def test_index_without_weight_map_names_file(sharded, content):
    index = sharded / "model.safetensors.index.json"
    index.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=names(index) + ': no "weight_map"'):
        load_model(sharded, device="cpu")


@pytest.mark.parametrize("outside", ["relative", "absolute"])
def test_index_entry_outside_model_directory(sharded, outside):
    # a real, loadable shard, but outside the model directory: the old loader read it quietly
    index = sharded / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    name, shard = next(iter(content["weight_map"].items()))
    stray = shutil.copy(sharded / shard, sharded.parent / "stray.safetensors")
    content["weight_map"][name] = "../stray.safetensors" if outside == "relative" else str(stray)
    index.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=names(index) + f": tensor {re.escape(name)} points at .*stray.safetensors.*"
                                                      "outside the model directory"):
        load_model(sharded, device="cpu")


def test_symlinked_shards_still_load(tmp_path, sharded):
    """The Hugging Face cache links each shard to a blob elsewhere; that is not "outside"."""
    want = logits(load_model(sharded, device="cpu"))
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sharded.glob("*.safetensors"):
        shard.rename(blobs / shard.name)
        shard.symlink_to(os.path.relpath(blobs / shard.name, sharded))
    torch.testing.assert_close(logits(load_model(sharded, device="cpu")), want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_non_float_tensor_names_tensor_and_file(checkpoint, dtype):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=names(file) + f": tensor model.norm.weight is {dtype}, not floating point"):
        load_model(checkpoint, device="cpu")


def test_generation_config_not_json_names_file(checkpoint):
    (checkpoint / "generation_config.json").write_text("eos_token_id: 5")
    with pytest.raises(ValueError, match=names(checkpoint / "generation_config.json") + ": not valid JSON"):
        eos_token_ids(checkpoint)


# ---- tokenizers: refuse a directory AutoTokenizer would turn into a 1-token tokenizer


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A copy of tiny-qwen3's tokenizer files (tokenizer.json + tokenizer_config.json) and config."""
    source = resolve_model("tiny-qwen3")
    (tmp_path / "tok").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / "tok" / name)
    return tmp_path / "tok"


def test_load_tokenizer(tokenizer_dir):
    assert load_tokenizer(tokenizer_dir)("hello world").input_ids == [14990, 1879]
    (tokenizer_dir / "tokenizer_config.json").unlink()  # tokenizer.json alone is enough
    assert load_tokenizer(tokenizer_dir)("hello world").input_ids == [14990, 1879]


def test_load_tokenizer_from_vocab_and_merges(tokenizer_dir):
    """The older GPT-2 style pair of files is a usable tokenizer too."""
    bpe = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    (tokenizer_dir / "tokenizer.json").unlink()
    (tokenizer_dir / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]]
    (tokenizer_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    assert load_tokenizer(tokenizer_dir)("hello world").input_ids == [14990, 1879]


def test_load_tokenizer_without_tokenizer_files_names_them(tokenizer_dir):
    (tokenizer_dir / "tokenizer.json").unlink()  # tokenizer_config.json alone: 26 added tokens, no vocabulary
    with pytest.raises(FileNotFoundError, match=names(tokenizer_dir) + ": no tokenizer files: it needs "
                       "tokenizer.json or tokenizer.model or vocab.json \\+ merges.txt"):
        load_tokenizer(tokenizer_dir)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_load_tokenizer_corrupt_json_names_file(tokenizer_dir, name):
    (tokenizer_dir / name).write_text('{"model": ')
    with pytest.raises(ValueError, match=names(tokenizer_dir / name) + ": not valid JSON"):
        load_tokenizer(tokenizer_dir)
