"""Rebuild ``tests/data/tokenizer``: the small tokenizer the tiny test models use.

A byte-level BPE (any text encodes, as with real models' tokenizers) with 1,024 tokens,
trained on the sample documents and the docs, plus ChatML's special tokens and chat template,
so the unit tests need no downloaded or converted model. Run from the repository root:
``python tests/data/make_tokenizer.py``. The committed files are what the tests use; a rebuild
after the docs change gives different merges, which no test depends on.
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "tokenizer"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def training_files() -> list[str]:
    files = sorted((ROOT / "ragblend" / "data" / "lowenmark").glob("*.md"))
    files += sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return [str(f) for f in files]


def main() -> None:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train(training_files(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(OUT)
    print(f"{len(tokenizer)} tokens -> {OUT}")


if __name__ == "__main__":
    main()
