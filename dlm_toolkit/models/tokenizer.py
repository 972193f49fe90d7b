"""Character-level tokenizer for the tiny testbed models.

One token per character, built with the Hugging Face ``tokenizers`` library (a ``WordLevel``
model over single characters, fed by a ``Split`` pre-tokenizer that isolates every character)
and wrapped in :class:`transformers.PreTrainedTokenizerFast`. :func:`save_tokenizer` writes a
real ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``, so both
``PreTrainedTokenizerFast(tokenizer_file=...)`` and ``AutoTokenizer.from_pretrained(dir)`` load
it without remote code.

Vocabulary (128 ids, in this order):

* ``<|endoftext|>`` -- EOS, also used as padding;
* ``<|mask|>`` -- the diffusion mask token;
* ``<|unk|>`` -- any character outside the table below (e.g. the two non-ASCII symbols that
  occur in a few HumanEval prompts);
* ``"\\n"`` and the 95 printable ASCII characters ``" "`` .. ``"~"``;
* ``<|unused_0|>`` .. ``<|unused_28|>`` padding the vocabulary to 128.

Never hard-code ids elsewhere: read them with :func:`special_ids`.

Encoding is an exact round trip for every string made of printable ASCII and newlines:
there is no normaliser, no whitespace stripping, no BOS/EOS added by ``encode`` and no
clean-up of spaces on ``decode`` (``decode(encode(s)) == s``).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "EOS_TOKEN",
    "MASK_TOKEN",
    "UNK_TOKEN",
    "VOCAB_SIZE",
    "build_char_tokenizer",
    "find_tokenizer",
    "load_tokenizer",
    "save_tokenizer",
    "special_ids",
]

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
UNK_TOKEN = "<|unk|>"
VOCAB_SIZE = 128

_SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, MASK_TOKEN, UNK_TOKEN)
# "\n" plus the 95 printable ASCII characters 0x20..0x7e.
_CHARS: tuple[str, ...] = ("\n",) + tuple(chr(c) for c in range(0x20, 0x7F))
_TOKENIZER_FILES = ("tokenizer.json",)

assert len(_CHARS) == 96 and set(string.printable) - set(_CHARS) == set("\t\r\x0b\x0c")


def _vocab() -> dict[str, int]:
    tokens = list(_SPECIAL_TOKENS) + list(_CHARS)
    n_unused = VOCAB_SIZE - len(tokens)
    tokens += [f"<|unused_{k}|>" for k in range(n_unused)]
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the 128-token character tokenizer described in the module docstring.

    Returns:
        A fast tokenizer with ``eos_token == pad_token == "<|endoftext|>"``,
        ``mask_token == "<|mask|>"``, ``unk_token == "<|unk|>"``, no BOS and
        ``clean_up_tokenization_spaces=False``.
    """
    backend = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=UNK_TOKEN))
    backend.normalizer = None
    # ``[\s\S]`` (rather than ``.``) so that newlines are isolated as well.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.post_processor = None
    backend.decoder = decoders.Fuse()  # concatenate tokens; WordLevel would join with spaces
    # Registering the specials as added tokens makes "<|mask|>" in text map to one id and lets
    # ``skip_special_tokens`` work; their ids are the ones already in the WordLevel vocab.
    backend.add_special_tokens(list(_SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    _check(tok)
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, directory: str | Path) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The files are written into a hidden staging folder inside ``directory`` and renamed into
    place together once complete (:func:`dlm_toolkit.util.files.atomic_write_many`): a kill or a full
    disk leaves the previous tokenizer files as they were.

    Args:
        tok: a tokenizer from :func:`build_char_tokenizer` (or :func:`load_tokenizer`).
        directory: target folder, created if missing.

    Returns:
        The folder as a :class:`~pathlib.Path`.
    """
    import shutil
    import tempfile

    from dlm_toolkit.util.files import atomic_write_many, is_disk_full, no_space

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer.tmp-", dir=out))
    try:
        try:
            tok.save_pretrained(str(staging))
            # transformers 5 records its internal class name ("TokenizersBackend"); the public alias
            # loads under both transformers 4 and 5.
            config_path = staging / "tokenizer_config.json"
            config = json.loads(config_path.read_text())
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            config_path.write_text(json.dumps(config, indent=2) + "\n")
            # transformers >= 5 no longer writes special_tokens_map.json; older loaders and our own
            # tooling still look for it, so make sure it exists.
            special_map = staging / "special_tokens_map.json"
            if not special_map.exists():
                special_map.write_text(json.dumps({"eos_token": tok.eos_token, "pad_token": tok.pad_token,
                                                   "mask_token": tok.mask_token, "unk_token": tok.unk_token},
                                                  indent=2) + "\n")
        except BaseException as err:
            if is_disk_full(err):
                raise no_space(out / "tokenizer.json", (out / "tokenizer.json").exists()) from None
            raise
        staged = sorted(p.name for p in staging.iterdir() if p.is_file())
        atomic_write_many(out, {name: (lambda tmp, name=name: (staging / name).replace(tmp)) for name in staged})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by :func:`save_tokenizer` (local files only, no remote code).

    Raises:
        FileNotFoundError: if ``directory`` does not exist or holds no ``tokenizer.json``.
    """
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(path)!r} does not exist")
    missing = [f for f in _TOKENIZER_FILES if not (path / f).is_file()]
    if missing:
        present = sorted(p.name for p in path.iterdir())
        raise FileNotFoundError(
            f"{str(path)!r} is not a tokenizer folder: missing {missing} "
            f"(found {present or 'nothing'}); create one with "
            "dlm_toolkit.models.tokenizer.save_tokenizer(build_char_tokenizer(), dir)"
        )
    tok = _from_folder(path)
    _check(tok)
    return tok


# the files ``from_pretrained`` reads from a folder: each must lie inside it (``chat_template.jinja``
# holds the chat template and wins over ``chat_template`` in tokenizer_config.json, as in transformers)
_READ_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "chat_template.jinja", "chat_template.json", "additional_chat_templates")


_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _check_token_roles(path: Path) -> None:
    """Each special-token role in ``tokenizer_config.json`` / ``special_tokens_map.json`` is null, a
    token string or an AddedToken object (``{"content": "..."}``): a number, a list or another
    object is one line naming the file and the key (transformers would raise a TypeError)."""
    from dlm_toolkit.models.validate import CheckpointError, read_json_object

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if not (path / name).exists():
            continue
        data = read_json_object(path / name, "tokenizer")
        for role in _TOKEN_ROLES:
            value = data.get(role)
            if value is None or isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str)):
                continue
            shown = json.dumps(value)
            raise CheckpointError(f"{path / name}: {role} must be a token string or an AddedToken object with a "
                                  f"'content' string, got {type(value).__name__} {shown[:60]}")


def _from_folder(path: Path) -> PreTrainedTokenizerFast:
    from dlm_toolkit.models.validate import MAX_JSON_BYTES, CheckpointError, inside, regular

    for name in _READ_FILES:
        if (path / name).exists():  # inside the folder, and a regular file of bounded size (a FIFO never hangs)
            regular(inside(path, name, "tokenizer file"), MAX_JSON_BYTES["tokenizer"], "a tokenizer file")
    _check_token_roles(path)
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # tokenizers/transformers raise plain Exception, ValueError, OSError...
        raise CheckpointError(f"{path / 'tokenizer.json'}: not a readable tokenizer ({type(e).__name__}: {e})") from None


def find_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast | None:
    """The tokenizer stored in a checkpoint folder, or None when it has no ``tokenizer.json``.

    Any ``tokenizers``-format tokenizer loads (our character one or a real model's BPE); no
    remote code is ever run. Its ``chat_template`` is the folder's chat template when it has one
    (``chat_template.jinja``, else ``chat_template`` in ``tokenizer_config.json``; see
    :mod:`dlm_toolkit.models.chat`), else None.
    """
    path = Path(directory)
    if not (path / "tokenizer.json").exists():
        return None
    return _from_folder(path)


def special_ids(tok: PreTrainedTokenizerFast) -> tuple[int, int]:
    """Return ``(mask_id, eos_id)`` as stored in ``tok``.

    Uses the tokenizer's ``mask_token``/``eos_token`` roles; a tokenizer built from the bare
    ``tokenizer.json`` (``PreTrainedTokenizerFast(tokenizer_file=...)``, which carries no roles)
    falls back to looking up ``"<|mask|>"``/``"<|endoftext|>"`` in its vocabulary.

    Raises:
        ValueError: if no mask or no EOS token can be found.
    """
    vocab = tok.get_vocab()

    def lookup(role_id: int | None, default_token: str) -> int | None:
        if role_id is not None:
            return int(role_id)
        return vocab.get(default_token)

    mask_id = lookup(tok.mask_token_id, MASK_TOKEN)
    eos_id = lookup(tok.eos_token_id, EOS_TOKEN)
    if mask_id is None or eos_id is None:
        raise ValueError(
            f"tokenizer lacks a mask token (got {tok.mask_token!r}) or an EOS token "
            f"(got {tok.eos_token!r})"
        )
    return mask_id, eos_id


def _check(tok: PreTrainedTokenizerFast) -> None:
    """Guard against silent behaviour changes (e.g. a library upgrade adding a BOS)."""
    probe = " a\n  b~ "
    ids = tok.encode(probe, add_special_tokens=True)
    if len(ids) != len(probe) or tok.decode(ids) != probe:
        raise RuntimeError(
            "character tokenizer is not an exact round trip: "
            f"{probe!r} -> {ids} -> {tok.decode(ids)!r}"
        )
