"""Tokenizers: the engine's own (transformers' fast tokenizer, with the checkpoint's chat
template rendered in transformers' sandboxed Jinja environment), or a byte-level fallback
for engines without one (dummy presets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from kiln.errors import CheckpointError, ConfigError


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str: ...


class HFTokenizer:
    def __init__(self, path: Path) -> None:
        if (path / "tokenizer.json").is_file():
            # The fast tokenizer straight from tokenizer.json: seconds quicker to import than
            # AutoTokenizer, and no tokenizer class named by the checkpoint is looked up.
            from transformers import PreTrainedTokenizerFast

            self._tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            from transformers import AutoTokenizer

            # trust_remote_code=False: a tokenizer class shipped as code is never run.
            try:
                self._tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
            except (ValueError, OSError) as e:
                reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else e
                raise CheckpointError(
                    f"cannot load the tokenizer in {path} ({reason}); kiln never runs tokenizer "
                    "code, so rebuild from a checkpoint that has a tokenizer.json."
                ) from e

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if not self.has_chat_template:
            raise ConfigError(
                "this model's tokenizer has no chat template; pass a raw prompt "
                "(`kiln run --raw`, or LLM.generate instead of LLM.chat)."
            )
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, for engines built without a tokenizer. Ids >= 256
    (a random model may emit them) decode to nothing."""

    has_chat_template = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def load_tokenizer(engine_dir: Path, manifest: dict[str, Any]) -> HFTokenizer | ByteTokenizer:
    sub = manifest.get("tokenizer")
    if sub:
        return HFTokenizer(engine_dir / sub)
    return ByteTokenizer()
