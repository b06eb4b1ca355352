"""GGUF files, read with the ``gguf`` package and dequantized to float32.

llama.cpp's converter permutes the rows of Llama q/k projections for its interleaved rotary
layout; kiln uses the Hugging Face (half-split) layout, so those rows are permuted back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.checkpoint.base import Checkpoint, file_fingerprint
from kiln.config import ModelConfig
from kiln.errors import CheckpointError

GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor; None for tensors kiln derives itself (rope_freqs)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (pairs, 2) -> (2, pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint(Checkpoint):
    kind = "gguf"

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path.resolve()
        self.source = str(self.path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the gguf package raises plain ValueError/OSError on bad files
            raise CheckpointError(f"cannot read GGUF file {self.source!r}: {e}.") from e
        self.arch = self._field("general.architecture")
        if self.arch not in GGUF_ARCHS:
            raise CheckpointError(
                f"GGUF architecture {self.arch!r} is not supported; kiln reads "
                f"{', '.join(GGUF_ARCHS)} GGUF files."
            )
        self._by_name = {t.name: t for t in self.reader.tensors}
        self.config = self._config()

    def _field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _config(self) -> ModelConfig:
        a = self.arch
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        head_dim = self._field(f"{a}.attention.key_length") or self._field(
            f"{a}.rope.dimension_count"
        )
        vocab = self._field(f"{a}.vocab_size") or len(
            self.reader.fields["tokenizer.ggml.tokens"].data
        )
        scaling = None
        if "rope_freqs.weight" in self._by_name:
            factors = self._tensor(self._by_name["rope_freqs.weight"]).tolist()
            scaling = {"rope_type": "freq_factors", "factors": factors}
        elif self._field(f"{a}.rope.scaling.type") == "linear":
            scaling = {
                "rope_type": "linear",
                "factor": float(self._field(f"{a}.rope.scaling.factor")),
            }
        eos = self._field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=GGUF_ARCHS[a],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._field(f"{a}.feed_forward_length")),
            num_hidden_layers=int(self._field(f"{a}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._field(f"{a}.attention.head_count_kv") or heads),
            head_dim=int(head_dim or hidden // heads),
            max_position_embeddings=int(self._field(f"{a}.context_length", 4096)),
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            attention_bias="blk.0.attn_q.bias" in self._by_name,
            tie_word_embeddings="output.weight" not in self._by_name,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    @staticmethod
    def _tensor(t: Any) -> torch.Tensor:
        import gguf

        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))

    def fingerprint(self) -> str:
        return file_fingerprint([self.path])

    def tensor_names(self) -> list[str]:
        return [n for n in (hf_name(t.name) for t in self.reader.tensors) if n]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            w = self._tensor(t)
            if self.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                n = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
                w = unpermute_rows(w, n)
            yield name, w

    def save_tokenizer(self, dst: Path) -> bool:
        if "tokenizer.ggml.tokens" not in self.reader.fields:
            return False
        from transformers import AutoTokenizer

        # transformers builds a fast tokenizer (and the chat template) from GGUF metadata.
        tok = AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        tok.save_pretrained(dst)
        return True
