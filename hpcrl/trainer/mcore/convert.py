"""HuggingFace Qwen3/Llama <-> megatron-core GPTModel: the config and the weights, per parallel rank.

:func:`transformer_config` and :func:`model_kwargs` describe the HF model to
megatron-core (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention,
Qwen3's per-head q/k norms, no biases, tied or untied output layer).

Weights: :func:`hf_to_mcore` gives the state dict of one (TP rank, PP stage)
of a GPTModel built with the local layer spec; :func:`mcore_to_hf` merges the
state dicts of every TP rank of every stage back into HuggingFace names. Both
are pure functions of tensors (no process group), so a round trip is exact by
construction and testable on one process; the engine gathers the shards.

Layouts (``G`` query groups = KV heads, ``D`` head dim, ``F`` FFN width):

- ``linear_qkv``: per query group, its query heads then its key then its
  value rows; TP splits it by whole groups (``G`` divisible by TP).
- ``linear_fc1``: ``[gate; up]`` on each TP rank, each half that rank's
  slice of ``F``.
- ``linear_proj`` / ``linear_fc2``: split along the input dimension.
- word embeddings and an untied output layer: split along the vocabulary,
  padded to a multiple of ``pad_vocab_to`` rows (zeros; the padded logits are
  masked by the engine and dropped by :func:`mcore_to_hf`).
- norms: replicated on every TP rank. Pipeline stage ``p`` of ``P`` holds
  layers ``[p*L/P, (p+1)*L/P)`` under local indices; the embedding lives on
  the first stage, the final norm and the output layer on the last (a tied
  output layer reads the first stage's embedding, kept on the last stage as
  ``output_layer.weight``, the copy megatron-core keeps in sync).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

Tensor = torch.Tensor


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default) if not isinstance(cfg, Mapping) else cfg.get(name, default)


def rope_theta(hf_config: Any) -> float:
    params = _get(hf_config, "rope_parameters") or _get(hf_config, "rope_scaling") or {}
    if params and params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"rope scaling {params.get('rope_type')!r}: only plain rotary embeddings are supported")
    return float(params.get("rope_theta") or _get(hf_config, "rope_theta", 10000.0))


def check_supported(hf_config: Any) -> None:
    kind = _get(hf_config, "model_type")
    if kind not in ("qwen3", "llama", "qwen2"):
        raise ValueError(f"trainer.engine=megatron: model_type {kind!r} is not supported (qwen3, qwen2, llama)")
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {_get(hf_config, 'hidden_act')!r}: only SwiGLU (silu) MLPs are supported")
    if _get(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the megatron engine")


def head_dim(hf_config: Any) -> int:
    return int(_get(hf_config, "head_dim") or _get(hf_config, "hidden_size") // _get(hf_config, "num_attention_heads"))


def has_qk_norm(hf_config: Any) -> bool:
    return _get(hf_config, "model_type") == "qwen3"


def has_qkv_bias(hf_config: Any) -> bool:
    return _get(hf_config, "model_type") == "qwen2" or bool(_get(hf_config, "attention_bias", False))


def transformer_config(hf_config: Any, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32, **extra: Any):
    """megatron-core's TransformerConfig for this HF model on TP x PP ranks."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported(hf_config)
    if has_qkv_bias(hf_config):
        raise ValueError("attention biases (qwen2, attention_bias=true) are not supported by the megatron engine yet")
    heads, groups = int(_get(hf_config, "num_attention_heads")), int(_get(hf_config, "num_key_value_heads") or
                                                                      _get(hf_config, "num_attention_heads"))
    layers = int(_get(hf_config, "num_hidden_layers"))
    if groups % tp:
        raise ValueError(f"trainer.megatron.tensor_parallel={tp}: must divide the {groups} key/value heads")
    if layers % pp:
        raise ValueError(f"trainer.megatron.pipeline_parallel={pp}: must divide the {layers} layers")
    return TransformerConfig(
        num_layers=layers, hidden_size=int(_get(hf_config, "hidden_size")), num_attention_heads=heads,
        num_query_groups=groups, kv_channels=head_dim(hf_config),
        ffn_hidden_size=int(_get(hf_config, "intermediate_size")), normalization="RMSNorm",
        layernorm_epsilon=float(_get(hf_config, "rms_norm_eps", 1e-6)), gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
        sequence_parallel=False, **extra)


def padded_vocab(vocab: int, tp: int, pad_vocab_to: int = 1) -> int:
    step = tp * max(pad_vocab_to, 1)
    return -(-vocab // step) * step


def model_kwargs(hf_config: Any, tp: int = 1, pad_vocab_to: int = 1) -> dict[str, Any]:
    """GPTModel's arguments besides the config and the layer spec."""
    return {"vocab_size": padded_vocab(int(_get(hf_config, "vocab_size")), tp, pad_vocab_to),
            "max_sequence_length": int(_get(hf_config, "max_position_embeddings")),
            "position_embedding_type": "rope", "rotary_base": int(rope_theta(hf_config)),
            "share_embeddings_and_output_weights": bool(_get(hf_config, "tie_word_embeddings", False))}


def _chunk(t: Tensor, tp: int, rank: int, dim: int = 0) -> Tensor:
    return torch.chunk(t, tp, dim=dim)[rank].clone()


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def _groups(hf_config: Any) -> tuple[int, int, int]:
    """Query heads, query groups (key/value heads) and head dimension."""
    heads = int(_get(hf_config, "num_attention_heads"))
    return heads, int(_get(hf_config, "num_key_value_heads") or heads), head_dim(hf_config)


def layer_to_mcore(hf: Mapping[str, Tensor], hf_config: Any, tp: int = 1, tp_rank: int = 0) -> dict[str, Tensor]:
    """One decoder layer: its HF tensors (names after ``model.layers.<i>.``) as TP rank ``tp_rank``'s slices
    (names after ``decoder.layers.<local i>.``)."""
    heads, groups, d = _groups(hf_config)
    per_group = heads // groups
    q = hf["self_attn.q_proj.weight"].view(groups, per_group * d, -1)
    k = hf["self_attn.k_proj.weight"].view(groups, d, -1)
    v = hf["self_attn.v_proj.weight"].view(groups, d, -1)
    qkv = torch.cat([q, k, v], dim=1).reshape((heads + 2 * groups) * d, -1)
    out = {"self_attention.linear_qkv.weight": _chunk(qkv, tp, tp_rank),
           "self_attention.linear_proj.weight": _chunk(hf["self_attn.o_proj.weight"], tp, tp_rank, 1)}
    if has_qk_norm(hf_config):
        out["self_attention.q_layernorm.weight"] = hf["self_attn.q_norm.weight"].clone()
        out["self_attention.k_layernorm.weight"] = hf["self_attn.k_norm.weight"].clone()
    out["input_layernorm.weight"] = hf["input_layernorm.weight"].clone()
    out["pre_mlp_layernorm.weight"] = hf["post_attention_layernorm.weight"].clone()
    gate = _chunk(hf["mlp.gate_proj.weight"], tp, tp_rank)
    out["mlp.linear_fc1.weight"] = torch.cat([gate, _chunk(hf["mlp.up_proj.weight"], tp, tp_rank)])
    out["mlp.linear_fc2.weight"] = _chunk(hf["mlp.down_proj.weight"], tp, tp_rank, 1)
    return out


def layer_to_hf(slices: list[Mapping[str, Tensor]], hf_config: Any) -> dict[str, Tensor]:
    """One decoder layer's HF tensors from every TP rank's slices (:func:`layer_to_mcore`'s names)."""
    heads, groups, d = _groups(hf_config)
    per_group = heads // groups

    def cat(key: str, dim: int = 0) -> Tensor:
        return torch.cat([s[key] for s in slices], dim=dim)

    qkv = cat("self_attention.linear_qkv.weight")
    q, k, v = torch.split(qkv.view(groups, (per_group + 2) * d, qkv.shape[-1]), [per_group * d, d, d], dim=1)
    first = slices[0]
    out = {"self_attn.q_proj.weight": q.reshape(heads * d, -1), "self_attn.k_proj.weight": k.reshape(groups * d, -1),
           "self_attn.v_proj.weight": v.reshape(groups * d, -1),
           "self_attn.o_proj.weight": cat("self_attention.linear_proj.weight", 1)}
    if has_qk_norm(hf_config):
        out["self_attn.q_norm.weight"] = first["self_attention.q_layernorm.weight"]
        out["self_attn.k_norm.weight"] = first["self_attention.k_layernorm.weight"]
    out["input_layernorm.weight"] = first["input_layernorm.weight"]
    out["post_attention_layernorm.weight"] = first["pre_mlp_layernorm.weight"]
    halves = [torch.chunk(s["mlp.linear_fc1.weight"], 2) for s in slices]
    out["mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
    out["mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
    out["mlp.down_proj.weight"] = cat("mlp.linear_fc2.weight", 1)
    return out


def vocab_to_mcore(t: Tensor, hf_config: Any, tp: int = 1, tp_rank: int = 0, pad_vocab_to: int = 1) -> Tensor:
    """The word embeddings or the output layer (``[vocab, hidden]``): TP rank ``tp_rank``'s rows of it padded."""
    return _chunk(_pad_rows(t, padded_vocab(int(_get(hf_config, "vocab_size")), tp, pad_vocab_to)), tp, tp_rank)


def vocab_to_hf(slices: list[Tensor], hf_config: Any) -> Tensor:
    """:func:`vocab_to_mcore`'s slices of every TP rank merged, the padding dropped."""
    return torch.cat(slices)[: int(_get(hf_config, "vocab_size"))]


def hf_to_mcore(hf: Mapping[str, Tensor], hf_config: Any, tp: int = 1, tp_rank: int = 0, pp: int = 1,
                stage: int = 0, pad_vocab_to: int = 1) -> dict[str, Tensor]:
    """The GPTModel state dict of TP rank ``tp_rank`` in pipeline stage ``stage`` (no ``_extra_state`` keys)."""
    layers = int(_get(hf_config, "num_hidden_layers"))
    tied = bool(_get(hf_config, "tie_word_embeddings", False))
    out: dict[str, Tensor] = {}
    if stage == 0:
        out["embedding.word_embeddings.weight"] = vocab_to_mcore(hf["model.embed_tokens.weight"], hf_config, tp,
                                                                 tp_rank, pad_vocab_to)
    for local, i in enumerate(stage_layers(layers, pp, stage)):
        src = f"model.layers.{i}."
        mine = layer_to_mcore({k[len(src):]: v for k, v in hf.items() if k.startswith(src)}, hf_config, tp, tp_rank)
        out.update({f"decoder.layers.{local}.{k}": v for k, v in mine.items()})
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not tied or pp > 1:
            head = hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"]
            out["output_layer.weight"] = vocab_to_mcore(head, hf_config, tp, tp_rank, pad_vocab_to)
    return out


def mcore_to_hf(shards: list[list[Mapping[str, Tensor]]], hf_config: Any) -> dict[str, Tensor]:
    """HuggingFace weights from ``shards[stage][tp_rank]`` (every stage's every TP rank, as from
    :func:`hf_to_mcore` or a GPTModel's ``state_dict()``); tied models get ``lm_head.weight`` too, the same
    tensor as the embedding, as HF's ``state_dict()`` has it."""
    layers = int(_get(hf_config, "num_hidden_layers"))
    tied = bool(_get(hf_config, "tie_word_embeddings", False))
    pp = len(shards)
    out = {"model.embed_tokens.weight": vocab_to_hf([s["embedding.word_embeddings.weight"] for s in shards[0]],
                                                    hf_config)}
    for stage in range(pp):
        for local, i in enumerate(stage_layers(layers, pp, stage)):
            src = f"decoder.layers.{local}."
            slices = [{k[len(src):]: v for k, v in s.items() if k.startswith(src)} for s in shards[stage]]
            out.update({f"model.layers.{i}.{k}": v for k, v in layer_to_hf(slices, hf_config).items()})
    out["model.norm.weight"] = shards[-1][0]["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = (out["model.embed_tokens.weight"] if tied
                             else vocab_to_hf([s["output_layer.weight"] for s in shards[-1]], hf_config))
    return {k: v.contiguous() for k, v in out.items()}
