"""A byte-level BPE tokenizer trained here, on text generated here.

The generated test model needs no download, so it brings its own tokenizer. The training
text is synthesised from a fixed word list by a seeded generator (no stdlib docs or files whose
content varies between Python builds), so the same seed gives the same `tokenizer.json` on every
machine. The text mixes ASCII prose, code, digits and multi-byte UTF-8 so that incremental
detokenisation is exercised on tokens that split characters.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

# A ChatML-like template in plain text markers; ends every turn with EOS so that a chat model
# trained on it would stop there. `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + ':\\n' + message['content'] + '\\n' }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)

_WORDS = """
the a an of to and in is it that for on with as by at from this be are was were or not but
have has had do does did will would can could should may might must shall into over under
request token prefill decode cache block layer head batch queue worker router model engine
stream latency throughput transfer memory bandwidth compute prompt output input sequence
server client cluster node process group channel lease timeout error retry cancel deadline
time first last next each every many few more less fast slow large small long short high low
river mountain garden window kitchen letter music number colour morning evening winter summer
bright quiet gentle heavy simple careful honest patient curious ready able clear strong warm
run read write send receive open close start stop wait move build test measure count keep
people system design value state order place point world water light sound paper table line
""".split()

_UNICODE = [
    "café", "naïve", "über", "façade", "Grüße", "señor", "smørbrød", "žluťoučký",
    "日本語", "東京", "中文", "한국어", "Ελληνικά", "русский", "עברית", "العربية",
    "🙂", "🚀", "✨", "👍🏽", "→", "≤", "∑", "°C", "€", "£", "½",
]

_CODE = [
    "def {w}(x):\n    return x + {n}\n",
    "for i in range({n}):\n    print(i)\n",
    "{w} = [{n}, {m}, {k}]\n",
    "if {w} >= {n}:\n    {w} -= 1\n",
    "{{\"{w}\": {n}, \"ok\": true}}\n",
    "SELECT {w} FROM t WHERE id = {n};\n",
]


def synth_corpus(seed: int, num_lines: int = 6000) -> list[str]:
    """Deterministic training text: prose, numbers, code and multilingual snippets."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(num_lines):
        kind = rng.random()
        if kind < 0.6:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
            words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice([".", ".", ",", "?", "!", ":"]))
        elif kind < 0.75:
            n, m, k = (rng.randint(0, 99999) for _ in range(3))
            tmpl = rng.choice(_CODE)
            lines.append(tmpl.format(w=rng.choice(_WORDS), n=n, m=m, k=k))
        elif kind < 0.9:
            parts = [rng.choice(_UNICODE + _WORDS) for _ in range(rng.randint(3, 10))]
            lines.append(" ".join(parts))
        else:
            lines.append(" ".join(str(rng.randint(0, 10**rng.randint(1, 9))) for _ in range(5)))
    return lines


def train_tokenizer(seed: int, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 bytes up front: any text encodes, nothing maps to <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synth_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # BOS is added by the tokenizer itself so vLLM, transformers and the router (plain
    # `tokenizers`) all produce the same ids for the same prompt.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def write_tokenizer(out_dir: Path, seed: int, vocab_size: int, max_len: int) -> int:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json; return vocab size."""
    tok = train_tokenizer(seed, vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,  # the post-processor already adds it
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    _write_json(out_dir / "special_tokens_map.json", special)
    return tok.get_vocab_size()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
