"""Checkpoint readers and their safety: pickles are refused unread, checkpoint code is never
imported, incomplete or mismatched checkpoints are refused by name, dummy presets have the
right shapes and reproducible weights, and the GGUF reader undoes llama.cpp's q/k layout."""

from __future__ import annotations

import builtins
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.build.engine_dir import MANIFEST
from kiln.build.loader import load_engine
from kiln.checkpoint import PRESETS, default_model_path, open_checkpoint
from kiln.checkpoint.dummy import DummyCheckpoint
from kiln.checkpoint.gguf_reader import unpermute_rows
from kiln.config import SUPPORTED_ARCHITECTURES, BuildConfig, ModelConfig
from kiln.errors import CheckpointError, KilnError

from .util import save_tiny_llama

CPU = BuildConfig(device="cpu")
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hf"))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def no_leftovers(out: Path) -> None:
    """A failed build leaves neither the output nor its temporary directory behind."""
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.building-*"))


# ---- pickles ---------------------------------------------------------------------------


class _OpenOnUnpickle:
    """Unpickling this calls builtins.open(path, "w"): a stand-in for arbitrary code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (builtins.open, (self.path, "w"))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_OpenOnUnpickle(marker))


def test_evil_pickle_payload_is_live(tmp_path: Path) -> None:
    """Control: the payload really runs code when unpickled, so the tests below mean something."""
    marker = tmp_path / "control-marker"
    pickle.loads(evil_pickle(marker)).close()
    assert marker.exists()


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth"])
def test_pickle_file_refused_unread(tmp_path: Path, suffix: str) -> None:
    marker = tmp_path / "unpickled"
    path = tmp_path / f"model{suffix}"
    path.write_bytes(evil_pickle(marker))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(str(path))
    msg = str(e.value)
    assert "pickle" in msg and "safetensors" in msg and str(path) in msg
    with pytest.raises(CheckpointError, match="convert the checkpoint to safetensors"):
        LLM(str(path), progress=False)
    assert not marker.exists()


def test_hf_directory_with_only_pytorch_model_bin(tmp_path: Path, tiny_hf: Path) -> None:
    marker = tmp_path / "unpickled"
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_bytes((tiny_hf / "config.json").read_bytes())
    (d / "pytorch_model.bin").write_bytes(evil_pickle(marker))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(str(d))
    assert "pytorch_model.bin" in str(e.value)
    assert "safetensors" in str(e.value)
    out = tmp_path / "engine"
    with pytest.raises(CheckpointError, match="pickle"):
        build_engine(str(d), out, CPU, progress=False)
    no_leftovers(out)
    with pytest.raises(CheckpointError, match="pickle"):
        LLM(d, progress=False)
    assert not marker.exists()


def test_junk_pickle_suffix_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    path.write_bytes(b"\x80\x04junk that is not even a pickle")
    with pytest.raises(CheckpointError, match="safetensors"):
        open_checkpoint(str(path))


# ---- checkpoint code is never run ------------------------------------------------------


def with_custom_code(src: Path, dst: Path, architecture: str, marker: Path) -> Path:
    """A copy of ``src`` whose config.json points auto_map at modules that, if imported,
    write ``marker``; a fast tokenizer whose tokenizer_config.json does the same."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = copy_checkpoint(src, dst)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = [architecture]
    cfg["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModel": "modeling_evil.EvilModel",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    for module in ("modeling_evil", "configuration_evil", "tokenization_evil"):
        (d / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').write({module!r})\n")
    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        **{w: i + 3 for i, w in enumerate(["a", "b", "c", "hi"])},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


def test_auto_map_code_never_imported(tmp_path: Path, tiny_hf: Path) -> None:
    marker = tmp_path / "code-ran"
    d = with_custom_code(tiny_hf, tmp_path / "ckpt", "LlamaForCausalLM", marker)
    ckpt = open_checkpoint(str(d))
    assert ckpt.config.architecture == "LlamaForCausalLM"
    manifest = build_engine(str(d), tmp_path / "engine", CPU, progress=False)
    assert manifest["tokenizer"] == "tokenizer"
    assert not any(name.endswith(".py") for name in manifest["files"])
    llm = LLM(tmp_path / "engine", progress=False)
    out = llm.generate("a b c", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert not marker.exists()


def test_custom_code_tokenizer_refused_not_run(tmp_path: Path, tiny_hf: Path) -> None:
    """A tokenizer that exists only as code (auto_map, no tokenizer.json) is refused."""
    marker = tmp_path / "code-ran"
    d = with_custom_code(tiny_hf, tmp_path / "ckpt", "LlamaForCausalLM", marker)
    (d / "tokenizer.json").unlink()
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": "EvilTokenizer"}))
    with pytest.raises(KilnError) as e:
        LLM(d, progress=False)
    assert "tokenizer" in str(e.value) and "tokenizer.json" in str(e.value)
    assert not marker.exists()


def test_custom_architecture_refused(tmp_path: Path, tiny_hf: Path) -> None:
    marker = tmp_path / "code-ran"
    d = with_custom_code(tiny_hf, tmp_path / "ckpt", "EvilForCausalLM", marker)
    with pytest.raises(KilnError) as e:
        open_checkpoint(str(d))
    msg = str(e.value)
    assert "EvilForCausalLM" in msg
    for name in SUPPORTED:
        assert name in msg
    out = tmp_path / "engine"
    with pytest.raises(KilnError, match="EvilForCausalLM"):
        build_engine(str(d), out, CPU, progress=False)
    no_leftovers(out)
    assert not marker.exists()


def test_supported_architectures_are_the_documented_three() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == set(SUPPORTED)


# ---- incomplete or mismatched checkpoints ----------------------------------------------


def test_sharded_checkpoint_builds(tmp_path: Path) -> None:
    d = save_tiny_llama(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1 and (d / "model.safetensors.index.json").is_file()
    build_engine(str(d), tmp_path / "engine", CPU, progress=False)
    assert load_engine(tmp_path / "engine").config.num_hidden_layers == 2


def test_sharded_checkpoint_missing_shard(tmp_path: Path) -> None:
    d = save_tiny_llama(tmp_path / "sharded", max_shard_size="40KB")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(str(d))
    assert shard.name in str(e.value)
    assert "complete checkpoint" in str(e.value)
    with pytest.raises(CheckpointError, match=shard.name):
        LLM(d, progress=False)


def rewrite_weights(d: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Replace (or with None, drop) tensors of ``d/model.safetensors``."""
    state = load_file(str(d / "model.safetensors"))
    for name, t in edit.items():
        assert name in state
        if t is None:
            del state[name]
        else:
            state[name] = t
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor_named(tmp_path: Path, tiny_hf: Path, name: str) -> None:
    d = copy_checkpoint(tiny_hf, tmp_path / "ckpt")
    rewrite_weights(d, {name: None})
    out = tmp_path / "engine"
    with pytest.raises(CheckpointError) as e:
        build_engine(str(d), out, CPU, progress=False)
    assert name in str(e.value)
    assert "missing" in str(e.value)
    no_leftovers(out)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.mlp.down_proj.weight", (64, 100)),
        ("model.layers.1.self_attn.k_proj.weight", (32, 63)),
        ("model.layers.1.self_attn.k_proj.weight", (48, 64)),
        ("model.embed_tokens.weight", (299, 64)),
    ],
)
def test_wrong_shape_refused(
    tmp_path: Path, tiny_hf: Path, name: str, shape: tuple[int, int]
) -> None:
    d = copy_checkpoint(tiny_hf, tmp_path / "ckpt")
    rewrite_weights(d, {name: torch.zeros(shape)})
    out = tmp_path / "engine"
    with pytest.raises(CheckpointError) as e:
        build_engine(str(d), out, CPU, progress=False)
    msg = str(e.value)
    assert name in msg, msg
    assert str(shape) in msg, msg
    no_leftovers(out)


def test_unknown_tensor_refused(tmp_path: Path, tiny_hf: Path) -> None:
    d = copy_checkpoint(tiny_hf, tmp_path / "ckpt")
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        build_engine(str(d), tmp_path / "engine", CPU, progress=False)


def test_config_json_without_weights(tmp_path: Path, tiny_hf: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_bytes((tiny_hf / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        open_checkpoint(str(d))


# ---- dummy presets ---------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_is_a_valid_model_config(preset: str) -> None:
    ckpt = open_checkpoint(f"dummy:{preset}")
    assert isinstance(ckpt, DummyCheckpoint)
    cfg = ckpt.config
    assert cfg == ModelConfig.from_dict(cfg.to_dict())
    assert cfg.num_params() > 0
    assert ckpt.tensor_names() == []


@pytest.mark.parametrize(
    ("preset", "params"),
    [
        ("llama-3.1-8b", 8.03e9),
        ("llama-3.1-70b", 70.6e9),
        ("llama-2-7b", 6.74e9),
        ("smollm2-135m", 1.35e8),
    ],
)
def test_preset_parameter_count(preset: str, params: float) -> None:
    assert open_checkpoint(f"dummy:{preset}").config.num_params() == pytest.approx(params, rel=0.01)


@pytest.mark.parametrize("preset", ["tiny", "llama-3.1-70b"])
def test_dummy_engine_stores_no_weights(tmp_path: Path, preset: str) -> None:
    out = tmp_path / "engine"
    manifest = build_engine(f"dummy:{preset}", out, CPU, seed=7, progress=False)
    assert manifest["weights"] == {"kind": "dummy", "seed": 7}
    assert list(manifest["files"]) == ["tuning.json"]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == sorted([MANIFEST, "tuning.json"])
    assert sum(p.stat().st_size for p in files) < 16_384


def test_dummy_weights_follow_the_seed(tmp_path: Path) -> None:
    for seed in (0, 1):
        build_engine("dummy:tiny", tmp_path / f"seed{seed}", CPU, seed=seed, progress=False)
    a = load_engine(tmp_path / "seed0").model.state_dict()
    b = load_engine(tmp_path / "seed0").model.state_dict()
    c = load_engine(tmp_path / "seed1").model.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    matrices = [k for k in a if a[k].dim() == 2]
    assert matrices and all(not torch.equal(a[k], c[k]) for k in matrices)


def test_dummy_llm_seed_reproducible() -> None:
    ids = [[5, 6, 7]]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    run = [
        LLM("dummy:tiny", seed=s, progress=False).generate(ids, greedy, use_tqdm=False)
        for s in (3, 3, 4)
    ]
    tokens = [r[0].outputs[0].token_ids for r in run]
    assert tokens[0] == tokens[1]
    assert tokens[0] != tokens[2]


def test_unknown_preset_refused() -> None:
    with pytest.raises(CheckpointError) as e:
        open_checkpoint("dummy:llama-9")
    assert "llama-9" in str(e.value)
    for name in PRESETS:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "spec",
    ["tiny,foo=1", "tiny,num_hidden_layers=0", "tiny,num_hidden_layers=x", "tiny,hidden_size=8"],
)
def test_bad_override_refused(spec: str) -> None:
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(f"dummy:{spec}")
    msg = str(e.value)
    assert spec.split(",")[1] in msg
    for key in ("num_hidden_layers", "max_position_embeddings", "vocab_size"):
        assert key in msg


def test_override_works() -> None:
    llm = LLM("dummy:tiny,num_hidden_layers=3", progress=False)
    assert llm.config.num_hidden_layers == 3
    assert llm.engine.manifest["source"]["model"] == "dummy:tiny,num_hidden_layers=3"
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# ---- GGUF ------------------------------------------------------------------------------


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py's permute() of q/k rows (HF half-split -> interleaved)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize(
    ("n_head", "head_dim", "cols"),
    [(1, 2, 1), (3, 6, 7), (9, 64, 13), (5, 10, 3), (4, 2, 9), (2, 128, 5)],
)
def test_unpermute_rows_inverts_llama_cpp(n_head: int, head_dim: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(n_head * 1000 + head_dim * 10 + cols)
    w = torch.randn(n_head * head_dim, cols, generator=gen)
    permuted = llama_cpp_permute(w, n_head)
    if head_dim > 2:
        assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, n_head), w)
    assert torch.equal(llama_cpp_permute(unpermute_rows(w, n_head), n_head), w)


def test_unpermute_rows_pairs_interleaved_rotary_halves() -> None:
    # one head of dim 6: llama.cpp stores rows as (x0, x3, x1, x4, x2, x5)
    w = torch.tensor([[0.0], [3.0], [1.0], [4.0], [2.0], [5.0]])
    assert unpermute_rows(w, 1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_embedded_smollm2_gguf_config() -> None:
    ckpt = open_checkpoint(str(default_model_path()))
    assert ckpt.kind == "gguf"
    cfg = ckpt.config
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.num_hidden_layers == 30
    assert cfg.hidden_size == 576
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings is True
    assert cfg.eos_token_ids == (2,)
    assert cfg.intermediate_size == 1536
    assert "lm_head.weight" not in ckpt.tensor_names()
    assert cfg.num_params() == pytest.approx(1.35e8, rel=0.01)


def test_gguf_garbage_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="cannot read GGUF"):
        open_checkpoint(str(path))
