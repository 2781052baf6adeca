"""A random model of a real model's shape, built locally from transformers' config class (nothing downloaded),
saved in bf16 safetensors with the embedded model's tokenizer, for measuring speed and memory at real sizes.

    python tools/make_shape_model.py tinyllama-1.1b /tmp/shapes/tinyllama     # 22 layers, hidden 2048, 32/4 heads
    python tools/make_shape_model.py qwen2.5-0.5b /tmp/shapes/qwen05           # 24 layers, hidden 896, 14/2 heads, q/k/v bias

The text such a model writes is noise; its matrices have the real model's sizes, which is what speed and memory
depend on. The vocabulary is the embedded tokenizer's (49,152), not the real model's.
"""
import argparse, sys
from pathlib import Path
import torch

SHAPES = {   # the fields of each real model's config.json that set its size
    "tinyllama-1.1b": ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                                     num_key_value_heads=4, max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True)),
}


def make_shape_model(shape: str, out, seed=0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    from llm_engine.model import load_tokenizer, resolve_model
    out = Path(out)
    if (out / "config.json").exists(): return out
    family, kw = SHAPES[shape]
    tok = load_tokenizer(resolve_model(None))
    cfg = AutoConfig.for_model(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                               initializer_range=0.02, torch_dtype="bfloat16", **kw)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)     # build in bf16: a 1.1B model in fp32 would be 4.4 GB more to hold
    try: m = AutoModelForCausalLM.from_config(cfg)
    finally: torch.set_default_dtype(torch.float32)
    m.save_pretrained(out, max_shard_size="1GB")     # sharded, as real checkpoints of this size are
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES)); p.add_argument("out"); p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(make_shape_model(a.shape, a.out, a.seed))
