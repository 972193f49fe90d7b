"""Chat templates: prompts for instruct checkpoints, formatted exactly as ``transformers`` does.

A checkpoint folder's tokenizer carries its chat template in ``tokenizer_config.json``
(``chat_template``) or in ``chat_template.jinja`` (which wins when both exist); both are read
by :func:`dlm_toolkit.tokenizer.find_tokenizer`. :func:`chat_ids` gives the ids that
``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` gives: the template is
rendered by transformers' own renderer and the text is encoded *without* the tokenizer's special
tokens (the template writes every control token itself; encoding with them would add a second
BOS on tokenizers that add one).

Whether a prompt goes through the template is a three-way choice (:data:`CHAT_MODES`):
``auto`` (the default) uses it when the tokenizer has one and encodes raw text otherwise (the
shipped testbeds have none, so their prompts are unchanged), ``true`` requires one, ``false``
never uses it.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from dlm_toolkit.config import ConfigError

__all__ = ["CHAT_MODES", "ChatMode", "chat_ids", "chat_text", "encode_prompt", "has_chat_template", "messages_for",
           "parse_chat_mode", "use_chat"]

ChatMode = Literal["auto", "true", "false"]
CHAT_MODES: tuple[str, ...] = ("auto", "true", "false")


def parse_chat_mode(value: Any, where: str = "chat") -> ChatMode:
    """``auto``/``true``/``false`` from a string or a bool (YAML reads ``chat: true`` as a bool)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in CHAT_MODES:
        return value.lower()  # type: ignore[return-value]
    raise ConfigError(f"{where}: must be one of auto, true, false (got {value!r})")


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (from ``tokenizer_config.json`` or
    ``chat_template.jinja``)."""
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat(tokenizer: Any, mode: ChatMode | str | bool, where: str = "chat") -> bool:
    """Resolve a chat mode against a tokenizer: ``auto`` follows the tokenizer.

    Raises:
        ConfigError: ``true`` asked of a tokenizer without a chat template.
    """
    mode = parse_chat_mode(mode, where)
    if mode == "false":
        return False
    present = tokenizer is not None and has_chat_template(tokenizer)
    if mode == "true" and not present:
        raise ConfigError(f"{where}: true, but the checkpoint's tokenizer has no chat template (neither "
                          "'chat_template' in tokenizer_config.json nor chat_template.jinja); use chat: auto or false")
    return present


def messages_for(user: str, system: str | None = None) -> list[dict[str, str]]:
    """``[{"role": "system", ...}, {"role": "user", ...}]``, the system turn only when given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


def chat_text(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """The template rendered for ``messages`` with the generation prompt (the assistant turn's
    opening) appended: the text the model is conditioned on."""
    if not has_chat_template(tokenizer):
        raise ConfigError("chat: the tokenizer has no chat template")
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2 raises TemplateError subclasses; a broken template is bad input
        raise ConfigError(f"chat template: cannot render ({type(e).__name__}: {e})") from None


def chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of :func:`chat_text`, encoded as ``apply_chat_template(..., tokenize=True)`` does:
    no special tokens added by the tokenizer (the template writes its own)."""
    return list(tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer: Any, text: str, chat: bool, system: str | None = None,
                  messages: Sequence[dict[str, str]] | None = None) -> list[int]:
    """A prompt's ids: through the chat template when ``chat`` (``messages`` if given, else one
    user turn holding ``text`` after the optional ``system`` turn), else ``text`` encoded raw."""
    if not chat:
        return list(tokenizer.encode(text, add_special_tokens=False))
    if messages is None:
        messages = messages_for(text, system)
    elif system is not None and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return chat_ids(tokenizer, messages)
