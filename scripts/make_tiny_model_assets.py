"""Writes the built-in tiny Qwen3 model assets (config + byte-level tokenizer + chat template).

Why byte-level: the demo task reverses text, which is learnable by a tiny model only
when every character is its own token. The chat template is a ChatML template in the
style of Qwen3 (reasoning dropped from assistant turns before the last user query,
tool calls in <tool_call> tags), written for lit-rl. Run once; the output is committed.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (Path(__file__).parent / "tiny_chat_template.jinja").read_text()


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.add_tokens(ADDED)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    vocab_size = 320  # 256 bytes + 9 specials, padded to a multiple of 64
    assert len(fast) <= vocab_size, len(fast)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # vLLM's CPU attention needs head_dim >= 32
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(out)
    gen = {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    print("wrote", out, "vocab", len(fast))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lit_rl/assets/tiny_qwen3")
