"""A checkpoint's tokenizer and chat template.

The BPE itself is the `tokenizers` library reading tokenizer.json. The chat template is
the checkpoint's own Jinja source, rendered in a sandbox: it is data from a download, so
it may not reach Python internals.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .config import CheckpointError, read_json


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken serialisation
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str):
    raise jinja2.TemplateError(message)


class ChatTokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise CheckpointError(f"{path} has no tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise CheckpointError(f"cannot read {path / 'tokenizer.json'}: {e}") from None
        settings = read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").exists() else {}
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        template = settings.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template
        if template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(template)
            except jinja2.TemplateError as e:
                raise CheckpointError(f"the chat template does not parse: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # A lone surrogate (JSON "\udcff", or argv bytes that are not UTF-8) is not text
        # the tokenizer can read: name it instead of letting its TypeError out.
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the text holds a lone surrogate {text[e.start]!r} at character {e.start}: not valid Unicode") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise CheckpointError("this checkpoint has no chat template; send a plain prompt instead")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Rendered text already holds the template's special tokens: add none."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)
