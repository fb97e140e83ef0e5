"""Character-level tokenizer built with ``tokenizers`` and saved in Hugging Face format.

One token per printable ASCII character (plus newline and tab) keeps the vocabulary tiny, so
small models train fast on CPU, while ``tokenizer.json`` + ``tokenizer_config.json`` load
unchanged in transformers (``AutoTokenizer``) and vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>", "<tool>", "</tool>")
CHARACTERS: tuple[str, ...] = ("\n", "\t", *(chr(c) for c in range(32, 127)))


class TokenizerError(ValueError):
    """Token ids or a tokenizer directory that cannot be used."""


class CharTokenizer:
    """A wrapper over a ``tokenizers.Tokenizer`` with the ids dora needs by name."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None and t in ("<pad>", "<bos>", "<eos>")]
        if missing:
            raise TokenizerError(f"tokenizer lacks special tokens {missing}")
        self.pad_token_id: int = int(ids["<pad>"])  # type: ignore[arg-type]
        self.bos_token_id: int = int(ids["<bos>"])  # type: ignore[arg-type]
        self.eos_token_id: int = int(ids["<eos>"])  # type: ignore[arg-type]
        self.unk_token_id: int | None = ids["<unk>"]
        self.tool_start_id: int | None = ids["<tool>"]
        self.tool_end_id: int | None = ids["</tool>"]
        self.special_ids: frozenset[int] = frozenset(i for i in ids.values() if i is not None)

    @classmethod
    def build(cls) -> CharTokenizer:
        """The standard dora character vocabulary: special tokens first, then characters."""
        vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        return cls(tok)

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``; characters outside the vocabulary become ``<unk>``."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            ids = [self.bos_token_id, *ids]
        if add_eos:
            ids = [*ids, self.eos_token_id]
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """Token ids of several texts at once."""
        return [self.encode(t, add_bos=add_bos) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; raise on ids outside the vocabulary."""
        ids = list(ids)
        self.check_ids(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_ids(self, ids: Iterable[int]) -> None:
        """Raise TokenizerError naming the first id outside ``[0, vocab_size)``."""
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} outside vocabulary [0, {self.vocab_size})")

    def __len__(self) -> int:
        return self.vocab_size

    def save(self, directory: Path, model_max_length: int = 4096) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / TOKENIZER_FILE))
        extra = [t for t in ("<tool>", "</tool>") if self._tok.token_to_id(t) is not None]
        special = {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "additional_special_tokens": extra,
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "add_eos_token": False,
            "padding_side": "left",
            **special,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        """Load ``tokenizer.json`` from a checkpoint directory."""
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"no {TOKENIZER_FILE} in {directory}")
        return cls(Tokenizer.from_file(str(path)))


def load_tokenizer(directory: Path) -> CharTokenizer:
    """The tokenizer saved in a checkpoint directory."""
    return CharTokenizer.load(directory)
