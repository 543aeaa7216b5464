"""Turn a task's text into prompt token ids: the model's own chat template when it has one, plain text otherwise.

The answer prefix goes *after* the generation prompt, inside the assistant turn, so the model continues the answer
(RULER's convention). Which template was used is returned so every result can state it.
"""

from __future__ import annotations


def build_prompt(tokenizer, user_text: str, answer_prefix: str = "", chat: bool | None = None) -> tuple[list[int], str]:
    """-> (token ids, template description)."""
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text + answer_prefix, add_special_tokens=False).input_ids
        return ids, "model chat template (apply_chat_template, add_generation_prompt=True) + answer prefix"
    # a prefix that starts with a space joins directly (RULER's `base` template); others go on a new line
    text = f"{user_text}{answer_prefix}" if answer_prefix[:1].isspace() else \
        f"{user_text}\n{answer_prefix}" if answer_prefix else user_text
    ids = tokenizer(text, add_special_tokens=True).input_ids
    return ids, "plain text (model has no chat template) + answer prefix"
