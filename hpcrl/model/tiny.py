"""A tiny Qwen3 model with a character tokenizer, built from scratch offline.

The tests, the CPU demo and the benchmarks need a real causal LM without any
download. ``build_tiny_model`` writes a randomly initialised (seeded)
``Qwen3ForCausalLM`` plus a character-level tokenizer into a folder that
``hpcrl.model.hf_io.load_model``/``load_tokenizer`` read back bit-identically.
Qwen3 (not qwen2) is used because transformers 5.x ``AutoTokenizer`` keeps a
custom ``tokenizer.json`` for it.

CLI: ``python -m hpcrl.model.tiny --out DIR [--hidden-size 128 ...]``.
"""

from __future__ import annotations

import argparse
import logging
import string
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from hpcrl.model.hf_io import save_model
from hpcrl.model.templates import PLAIN_CHAT_TEMPLATE

log = logging.getLogger(__name__)

CHARSET: str = (
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " +-*/=().,:?!\\{}$#_'\"<>%^&;[]|@~`\n"
)
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2


@dataclass
class TinyModelConfig:
    hidden_size: int = 128  # model width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 4  # key/value heads (GQA when < num_heads)
    head_dim: int = 32  # per-head dimension
    intermediate_size: int = 512  # MLP width
    max_position_embeddings: int = 512  # longest sequence
    seed: int = 0  # seed of the random initialisation

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: must divide num_heads={self.num_heads}, got {self.num_kv_heads}"
            )


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of CHARSET; <pad>=0, <eos>=1, <unk>=2.

    No normalizer, every character (spaces included) is its own token and the
    decoder concatenates, so ``decode(encode(s)) == s`` for text over CHARSET.
    Its chat template is :data:`hpcrl.model.templates.PLAIN_CHAT_TEMPLATE`
    (``user: 1+2=<eos>\nassistant: ``).
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"(.|\n)"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        chat_template=PLAIN_CHAT_TEMPLATE,
    )


def _qwen3_config(cfg: TinyModelConfig, tok: PreTrainedTokenizerFast) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig = TinyModelConfig()) -> Path:
    """Write a seeded random tiny Qwen3 + char tokenizer to the new folder ``out_dir``."""
    tok = build_char_tokenizer()
    config = _qwen3_config(cfg, tok)
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    try:
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    n_params = sum(p.numel() for p in model.parameters())
    log.info("tiny Qwen3: %d parameters, %s", n_params, asdict(cfg))
    return save_model(model, tok, out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="new folder to write the model into")
    defaults = TinyModelConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args(argv)
    cfg = TinyModelConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    path = build_tiny_model(args.out, cfg)
    config = Qwen3Config.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    print(f"{n_params} parameters -> {path}")


if __name__ == "__main__":
    main()
