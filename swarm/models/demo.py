"""Stream an answer from the default model split into three block ranges in this process.

python -m swarm.models.demo ["your question"] [--model default] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import logging
import sys

from swarm.models.loading import resolve_model
from swarm.models.local import LocalPipeline


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("--model", default="default", help="default | path to an HF checkpoint dir")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    source = resolve_model(args.model)
    tokenizer = source.tokenizer()
    if tokenizer is None:
        parser.error(f"model {args.model} has no tokenizer; the demo needs one")
    n = source.spec.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    blocks = [source.load_blocks(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    pipeline = LocalPipeline(source.load_head(), blocks)
    print(f"[{source.spec.name} split as {', '.join(str(b.range) for b in blocks)}]", file=sys.stderr)

    messages = [{"role": "user", "content": args.question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    print(f"> {args.question}")
    tokens: list[int] = []
    shown = ""
    for token in pipeline.generate(
        list(prompt), args.max_new_tokens, stop_token_ids=[tokenizer.eos_token_id]
    ):
        tokens.append(token)
        # decode the whole answer each time: a piece may end inside a multi-byte character
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            print(text[len(shown) :], end="", flush=True)
            shown = text
    print()


if __name__ == "__main__":
    main()
