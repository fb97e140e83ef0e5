"""The character tokenizer: round trips, special tokens, HF loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.models import CharTokenizer, TokenizerError, load_tokenizer

TEXT = "Q: 12 + 34 = ?\n\tA: 46 {ok} ~|`"


def test_roundtrip_printable_ascii() -> None:
    tok = CharTokenizer.build()
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT)  # one token per character
    assert tok.decode(ids) == TEXT


def test_special_tokens() -> None:
    tok = CharTokenizer.build()
    ids = tok.encode("hi", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>hi<eos>"
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    tool = tok.encode("<tool>x</tool>")
    assert tool == [tok.tool_start_id, tok.encode("x")[0], tok.tool_end_id]
    assert tok.encode("é") == [tok.unk_token_id]


def test_unknown_ids_are_refused() -> None:
    tok = CharTokenizer.build()
    with pytest.raises(TokenizerError, match="outside vocabulary"):
        tok.decode([tok.vocab_size])


def test_save_load_and_transformers(tmp_path: Path) -> None:
    tok = CharTokenizer.build()
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(TEXT) == tok.encode(TEXT)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf(TEXT, add_special_tokens=False).input_ids == tok.encode(TEXT)
    assert hf.decode(tok.encode(TEXT)) == TEXT
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path / "missing")
