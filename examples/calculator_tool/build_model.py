"""Build this example's model folder in code: the built-in character tokenizer with the four
tool-call tags as tokens and a chat template that renders tools (asyncflow.agents.chat), and a
small Qwen2, saved with ``save_pretrained`` into ./model. No download.

Run: python build_model.py (a few seconds).
"""

from pathlib import Path

from asyncflow.agents.chat import TOOL_TEMPLATE, add_tool_tokens
from asyncflow.engines.tiny import build_char_tokenizer, build_tiny_model

HERE = Path(__file__).resolve().parent


def main(out: Path = HERE / "model", seed: int = 0) -> None:
    tok = build_char_tokenizer()
    add_tool_tokens(tok)  # <tool_call> </tool_call> <tool_response> </tool_response>: one token each
    tok.chat_template = TOOL_TEMPLATE  # "calc:123*456=" then <tool_call>calc(123*456)</tool_call> ...
    model = build_tiny_model(tok, seed=seed)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"saved to {out}: {sum(p.numel() for p in model.parameters()):,} parameters, vocabulary {len(tok)}")


if __name__ == "__main__":
    main()
