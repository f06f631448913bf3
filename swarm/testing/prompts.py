"""The benchmarks' prompt, as token ids: one chat turn through the model's own template."""

from __future__ import annotations

from swarm.models.loading import ModelSource

QUESTION = "Tell me about the history of Paris in a few sentences."


def chat_prompt_ids(source: ModelSource, question: str = QUESTION) -> list[int]:
    """Token ids of `question` as a user turn; the tiny model has no tokenizer, so any fixed ids do there."""
    tokenizer = source.tokenizer()
    if tokenizer is None:
        return [(7 * i + 3) % source.spec.vocab_size for i in range(32)]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
