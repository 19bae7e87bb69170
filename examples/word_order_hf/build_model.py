"""Build this example's model folder in code: a byte-level BPE tokenizer with a chat
template (``tokenizers``) and a small randomly initialised Qwen2 (``transformers``),
saved with ``save_pretrained`` into ./model. No download.

Run: python build_model.py  (a few seconds). The layout is what any Hugging Face causal
LM folder holds (config.json, model.safetensors, tokenizer.json, tokenizer_config.json),
so the same config trains a real checkpoint by pointing model.path at it.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from make_data import WORDS

HERE = Path(__file__).resolve().parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen's chat format: one user message, then the assistant's turn (add_generation_prompt).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(WORDS), "reverse: ", "user assistant", *(f"{a} {b}" for a in WORDS for b in WORDS)]
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, padding_side="left")


def main(out: Path = HERE / "model", seed: int = 0) -> None:
    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"saved to {out}: {sum(p.numel() for p in model.parameters()):,} parameters, vocabulary {len(tok)}")


if __name__ == "__main__":
    main()
