"""Built-in chat templates for the model families larql-edge supports, used when a vindex carries
none (Gemma 3 270M's packaged GGUF has no ``tokenizer.chat_template``, so a first chat was a 400).

As llama.cpp does for known models, the template is recognised from the tokenizer's special tokens,
not guessed from the name: ``<start_of_turn>``/``<end_of_turn>`` on a gemma3 vindex is Gemma 3's
turn format, ``<|im_start|>``/``<|im_end|>`` is ChatML as SmolLM2 publishes it (with its default
system message). Anything else keeps having no template: a wrong one would be worse than the 400.
The model's own template (the vindex's tokenizer_config.json) and ``--chat-template FILE`` win.

Each is written here to render exactly what the family's published template renders for text
conversations (tests/test_chat_defaults.py renders both side by side); multimodal parts, which the
API refuses before rendering, are left out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DefaultChat:
    name: str
    source: str
    end_of_turn: str  # the token a reply stops at (beside the model's EOS)
    markers: tuple[str, ...]  # special tokens the tokenizer must have
    families: tuple[str, ...]


# Gemma 3 (google/gemma-3-*-it): no system role (a system message prefixes the first user turn),
# "model" for the assistant, contents trimmed, turns strictly alternating.
GEMMA3 = DefaultChat(
    name="gemma3",
    source=(
        "{{ bos_token }}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for m in turns -%}"
        "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif -%}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n'"
        " + (prefix if loop.first else '') + (m['content'] | trim) + '<end_of_turn>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
    ),
    end_of_turn="<end_of_turn>",
    markers=("<start_of_turn>", "<end_of_turn>"),
    families=("gemma3",),
)

# ChatML as HuggingFaceTB/SmolLM2-*-Instruct publishes it: a default system message when the
# conversation brings none, contents as they are.
CHATML = DefaultChat(
    name="chatml",
    source=(
        "{%- for m in messages -%}"
        "{%- if loop.first and m['role'] != 'system' -%}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    ),
    end_of_turn="<|im_end|>",
    markers=("<|im_start|>", "<|im_end|>"),
    families=("llama",),
)

DEFAULTS = (GEMMA3, CHATML)


def default_chat(family: str, tokenizer) -> DefaultChat | None:
    """The built-in template for a vindex of ``family`` whose tokenizer has the template's tokens."""
    for d in DEFAULTS:
        if family in d.families and all(tokenizer.token_to_id(t) is not None for t in d.markers):
            return d
    return None
