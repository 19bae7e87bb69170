"""The built-in tiny model: a character tokenizer and a ~0.5M-parameter Qwen2, no downloads.

Design
------
Everything here is built from code, so tests, examples and the CPU pipeline run offline.
The tokenizer is a real ``tokenizers`` pipeline wrapped in ``PreTrainedTokenizerFast``,
and the model is a stock ``Qwen2ForCausalLM``; the rest of the framework therefore
talks to them through the same Hugging Face APIs it would use for a downloaded
checkpoint (``save_pretrained`` / ``AutoTokenizer.from_pretrained`` / ``generate``).

Invariants
----------
* Special ids are fixed: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3.
  Ordinary characters follow in ``CHARSET`` order, so the vocabulary (and every saved
  checkpoint) is identical across runs and machines.
* One id per character: encoding ``"12+34="`` yields exactly six ids, and characters
  outside ``CHARSET`` (e.g. uppercase) map to ``<unk>`` rather than being dropped.
* Encoding never adds special tokens, even with ``add_special_tokens=True``: there is no
  post-processor. Callers prepend ``bos_token_id`` (and append ``eos_token_id`` for
  training targets) explicitly, which keeps prompt/response token boundaries obvious.
* Decoding concatenates characters with no added spaces, so ``decode(encode(s)) == s``
  for any ``s`` over ``CHARSET``.
* ``build_tiny_model(tok, seed)`` is a pure function of its arguments: same seed and
  dims give bit-identical weights.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)

# Digits and arithmetic punctuation first, then lowercase letters: enough for addition,
# countdown ("(3+5)*2=16") and short word answers.
CHARSET: str = "0123456789+-*/=(),.?: " + string.ascii_lowercase


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Return the character-level tokenizer (vocab size 52, left padding).

    Example:
        >>> tok = build_char_tokenizer()
        >>> tok("12+34=").input_ids
        [5, 6, 14, 7, 8, 18]
        >>> tok.decode([1, 8, 10, 2], skip_special_tokens=True)
        '46'
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARSET))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # An empty pattern with "isolated" splits between every character, so WordLevel
    # sees single characters; the space character is kept as a token, not dropped.
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    # Fuse joins tokens with "" (the default WordLevel decoding would insert spaces).
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        # Left padding keeps the last prompt token at the same position for every row,
        # which batched generation relies on.
        padding_side="left",
    )


def _supported_attn_implementation() -> str:
    """'sdpa' where torch provides it (any torch >= 2.0), else 'eager'."""
    has_sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    return "sdpa" if has_sdpa else "eager"


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 128,
) -> Qwen2Config:
    """A small Qwen2 config whose vocabulary and special ids come from ``tokenizer``.

    Embeddings are tied with the LM head: at this size the embedding matrix is a large
    share of the parameters and tying also makes the tiny model learn faster.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Stored on the config as `_attn_implementation` and saved with it, so a
        # reloaded checkpoint uses the same kernel. (Accepted at run time; the typed
        # signature of transformers' config dataclass does not list it.)
        attn_implementation=_supported_attn_implementation(),  # type: ignore[call-arg]
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, **dims: int
) -> Qwen2ForCausalLM:
    """A freshly initialised tiny Qwen2 (~0.5M params at the default dims).

    ``dims`` are forwarded to :func:`tiny_config`. Initialisation is deterministic:
    the global torch RNG is seeded, then restored so callers' RNG streams are unaffected.
    """
    config = tiny_config(tokenizer, **dims)
    rng_state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_rng_state(rng_state)
    return model
