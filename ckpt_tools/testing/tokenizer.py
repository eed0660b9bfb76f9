"""A tokenizer for tiny test checkpoints, so that llama.cpp's converter (convert_hf_to_gguf.py) takes them and
llama.cpp tokenizes and prints their ids one byte each (issue 41).

A `tokenizers` byte-level BPE of ``vocab_size`` ids, written as tokenizer.json + tokenizer_config.json:

- id 0: the one merge ("1" + "2" -> "12"). llama.cpp's BPE loader needs a merges list; its "default"
  pre-tokenizer splits digits one by one, so llama.cpp never forms this token from text, and the tiny models
  (trained on ids >= 3) never emit it.
- ids 1, 2: ``[gMASK]`` (bos) and ``<|endoftext|>`` (eos), the tiny configs' bos_token_id 1 / eos_token_id 2.
- the last two ids: ``<|user|>`` and ``<|observation|>``. GLM's converter looks up all four special tokens
  (bos, eot, unk, eom); llama.cpp counts the GGUF's eos / eot / eom and ``<|endoftext|>`` as end of
  generation, which ``--ignore-eos`` bars: ``eog_ids`` says which ids a reference must bar to compare with it.
- every other id: one byte (ASCII without NUL and CR, printable first), as GPT-2's byte-level alphabet spells it.
  The text of a prompt of such ids is its bytes, and llama.cpp prints each generated id as its byte.
"""

from __future__ import annotations

import json
from pathlib import Path

MERGED = 0
SPECIALS = {1: "[gMASK]", 2: "<|endoftext|>"}
TAIL_SPECIALS = ("<|user|>", "<|observation|>")  # the last two ids
# llama.cpp b11434 counts as end of generation (its vocabulary loader) the GGUF's eos / eot / eom ids (GLM's
# converter sets eot <|user|> and eom <|observation|>; DeepSeek's neither) and tokens so named: of ours, <|endoftext|>
NAMED_EOG = ("<|endoftext|>",)
EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# the bytes single-byte ids stand for: printable ASCII, space, tab / newline / VT / FF, then the other controls
# (no NUL: llama.cpp prints pieces as C strings; no CR)
BYTES = ([*range(0x21, 0x7F), 0x20, 0x09, 0x0A, 0x0B, 0x0C, *range(0x01, 0x09), *range(0x0E, 0x20), 0x7F])
MAX_VOCAB = len(BYTES) + 1 + len(SPECIALS) + len(TAIL_SPECIALS)


def byte_level(b: int) -> str:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes as themselves, the others shifted past 255."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return chr(b) if b in printable else chr(256 + [x for x in range(256) if x not in printable].index(b))


def pieces(vocab_size: int) -> list[bytes]:
    """What each id prints as in llama.cpp (a special token: its text)."""
    if not len(SPECIALS) + len(TAIL_SPECIALS) + 3 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size}: the byte-level test tokenizer has 7 to {MAX_VOCAB} ids")
    single = vocab_size - 1 - len(SPECIALS) - len(TAIL_SPECIALS)
    out = [b"12", *(SPECIALS[i].encode() for i in sorted(SPECIALS)), *(bytes([b]) for b in BYTES[:single]),
           *(s.encode() for s in TAIL_SPECIALS)]
    if not {b"1", b"2"} <= set(out):
        raise ValueError(f"vocab_size {vocab_size}: too small for the merge's parts '1' and '2'")
    return out


def special_ids(vocab_size: int) -> dict[str, int]:
    return {**{s: i for i, s in SPECIALS.items()},
            **{s: vocab_size - len(TAIL_SPECIALS) + k for k, s in enumerate(TAIL_SPECIALS)}}


def eog_ids(vocab_size: int, kv: dict) -> list[int]:
    """The ids llama.cpp bars under ``--ignore-eos`` for a GGUF converted with this tokenizer, whose ``kv`` holds the
    EOG_KEYS the converter wrote (key -> id)."""
    ids = special_ids(vocab_size)
    return sorted({int(kv[k]) for k in EOG_KEYS if kv.get(k) is not None} | {ids[n] for n in NAMED_EOG})


def text_of(ids: list[int], vocab_size: int) -> bytes:
    """The bytes llama.cpp reads (a prompt) or prints (a generation) for ``ids``."""
    table = pieces(vocab_size)
    return b"".join(table[i] for i in ids)


def write_tokenizer(directory: str | Path, vocab_size: int, add_bos: bool = False) -> None:
    """tokenizer.json and tokenizer_config.json for ``vocab_size`` ids in ``directory`` (a tiny checkpoint's);
    ``add_bos`` as DeepSeek's releases say (llama.cpp's DeepSeek-V3.2 converter asserts it), with their tokenizer
    class, which reads it (transformers 4.57's PreTrainedTokenizerFast has no add_bos_token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = pieces(vocab_size)
    specials = special_ids(vocab_size)
    names = {i: s for s, i in specials.items()}
    vocab = {names[i] if i in names else "".join(byte_level(b) for b in piece): i for i, piece in enumerate(table)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    d = Path(directory)
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
              "bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "model_max_length": 1 << 20}
    if add_bos:  # no unk, or that class adds one past the vocabulary
        config.update(tokenizer_class="LlamaTokenizerFast", unk_token=None)
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
