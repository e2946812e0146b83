"""The chat template: the model's own (``tokenizer_config.json`` in the vindex, as the extractor writes
it from GGUF ``tokenizer.chat_template`` or a Hugging Face folder), or ``--chat-template FILE``, else
its family's built-in one (`chat_defaults`).

Rendered as Hugging Face transformers renders it (``apply_chat_template``): a sandboxed, immutable
Jinja2 environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, and the variables
``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt``. A template that raises or fails
to render is the caller's 400 (its messages made it fail), never a 500.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from larql_edge.errors import BadRequest, SetupError


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@dataclass
class ChatTemplate:
    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    origin: str = ""
    end_of_turn: str | None = None  # a built-in template's turn end, which replies also stop at

    def __post_init__(self) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(self.source)
        except TemplateError as e:
            raise SetupError(f"chat template ({self.origin}) does not compile: {e}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """``tools``: the request's tools, as transformers passes them (absent from the context when None)."""
        from jinja2.exceptions import TemplateError

        extra = {} if tools is None else {"tools": tools}
        try:
            return self._template.render(messages=messages, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "", add_generation_prompt=add_generation_prompt,
                                         **extra)
        except TemplateError as e:
            raise BadRequest(f"the chat template refused these messages: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # a template's own mistakes on odd input
            raise BadRequest(f"the chat template could not render these messages: {e}") from None


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json may hold {"content": "<s>", ...} (AddedToken) instead of the string.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(vindex: Path, override: str | None, tokenizer=None, family: str = "") -> ChatTemplate | None:
    """``override`` (a file path) wins; else the vindex's tokenizer_config.json; else the built-in
    template of ``family`` when ``tokenizer`` has its tokens; else None."""
    cfg: dict[str, Any] = {}
    cfg_path = Path(vindex) / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise SetupError(f"{cfg_path}: unreadable ({e})") from None
        if isinstance(loaded, dict):
            cfg = loaded
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    if override:
        try:
            text = Path(override).read_text()
        except OSError as e:
            raise SetupError(f"--chat-template {override}: {e.strerror or e}") from None
        return ChatTemplate(text, bos, eos, origin=str(override))
    source = cfg.get("chat_template")
    if isinstance(source, list):  # HF's named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str) or not source.strip():
        from .chat_defaults import default_chat

        builtin = default_chat(family, tokenizer) if tokenizer is not None else None
        if builtin is None:
            return None
        return ChatTemplate(builtin.source, bos, eos, origin=f"built-in {builtin.name} template",
                            end_of_turn=builtin.end_of_turn)
    return ChatTemplate(source, bos, eos, origin=str(cfg_path))


def eos_from_generation_config(vindex: Path) -> tuple[int, ...]:
    """``generation_config.json``'s ``eos_token_id`` (an int or a list), or nothing."""
    p = Path(vindex) / "generation_config.json"
    if not p.is_file():
        return ()
    try:
        value = json.loads(p.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if type(v) is int and v >= 0)
