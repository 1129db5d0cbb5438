"""Text workloads for `splitserve bench --sharegpt`, written here since none can be downloaded.

    python -m bench.text_workloads copy results/copy.json [--n 40] [--model smollm2]
    python -m bench.text_workloads open results/open.json [--model smollm2]

copy  extractive: a passage, then the instruction to repeat it; the reply is the passage, so a
      model that follows the instruction writes text its prompt already holds -- where n-gram
      speculative decoding (prompt lookup) should accept most drafts.
open  open-ended: a short question asking for new text of about the same length, where prompt
      lookup finds little to propose.

Passages are synthetic English-like prose (splitserve/tiny_tokenizer.py `synth_corpus`); the
files are ShareGPT-shaped ({"id", "conversations": [human, gpt]}), the gpt turn only giving the
reply's length. `splitserve bench --sharegpt` sends the human turn as plain text; with --model,
it is written already rendered as one user turn by that model's chat template, so an instruct
model reads it as a request.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from splitserve.tiny_tokenizer import synth_corpus

_TOPICS = ("a lighthouse keeper", "the history of bread", "a city under the sea", "winter birds",
           "a clockmaker's apprentice", "the first train across a desert", "a garden on Mars",
           "an old library", "river trade", "a mountain village festival")


def conversations(kind: str, n: int, seed: int = 0, model: str | None = None) -> list[dict]:
    chat = _chat(model) if model else None
    rng = random.Random(seed)
    prose = [ln for ln in synth_corpus(seed + 7, num_lines=4000) if ln[:1].isalpha()]
    out = []
    for i in range(n):
        passage = " ".join(rng.sample(prose, rng.randint(4, 8)))
        if kind == "copy":
            human = (f"Here is a passage.\n\n{passage}\n\nRepeat the passage above exactly, "
                     f"word for word.")
        elif kind == "open":
            human = f"Write a short story about {rng.choice(_TOPICS)}."
        else:
            raise ValueError(f"kind must be copy or open, got {kind!r}")
        if chat is not None:
            human = chat.render([("user", human)])
        out.append({"id": f"{kind}-{i}", "conversations": [
            {"from": "human", "value": human}, {"from": "gpt", "value": passage}]})
    return out


def _chat(model: str):
    from router.chat import ChatTemplate
    from router.text import RouterTokenizer
    from splitserve.models import resolve_model

    tok = RouterTokenizer(resolve_model(model))
    if not tok.chat_template:
        raise SystemExit(f"{model} has no chat template")
    return ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["copy", "open"])
    ap.add_argument("path", type=Path)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="render prompts with its chat template")
    a = ap.parse_args()
    a.path.parent.mkdir(parents=True, exist_ok=True)
    a.path.write_text(json.dumps(conversations(a.kind, a.n, a.seed, a.model), indent=1) + "\n")
    print(f"wrote {a.n} {a.kind} conversations to {a.path}")


if __name__ == "__main__":
    main()
