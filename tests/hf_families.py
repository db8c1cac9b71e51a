"""Every causal-LM family of the installed Transformers that ships a tensor-parallel plan, each built
from a tiny config (random weights, nothing downloaded): `families()` and `tiny_config(...)`.

Generic rules do most of it: small sizes wherever a config has the attribute, one layer of each
kind the family mixes (attention / linear attention / mamba, dense / MoE), MLA's latent sizes.
FAMILY holds what only one family needs, each with its reason.
"""

from __future__ import annotations

import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

TINY = dict(
    # core dims
    vocab_size=128,
    unpadded_vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    n_embd=32,
    n_head=4,
    n_positions=64,
    n_inner=64,
    rotary_dim=4,
    d_model=32,
    ffn_hidden_size=64,
    intermediate_size_mlp=64,
    dense_intermediate_size=64,
    sliding_window=8,
    attention_chunk_size=8,
    # MoE
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    moe_num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    zero_expert_num=2,
    shared_expert_intermediate_size=32,
    shared_experts_intermediate_size=32,
    shared_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    first_k_dense_replace=1,
    num_dense_layers=1,
    attn_layer_period=2,
    attn_layer_offset=1,
    expert_layer_period=2,
    expert_layer_offset=1,
    # MLA / sparse-attention indexers / compressed attention
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    index_head_dim=8,
    index_n_heads=2,
    index_topk=8,
    index_block_size=4,
    index_topk_blocks=2,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    indexer_budget=8,
    indexer_compress_ratio=2,
    o_groups=2,
    o_lora_rank=16,
    hc_lowrank=8,
    # separate sliding-window attention dims, relative position bias, looping
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=8,
    d_rel=4,
    rel_extent=16,
    loop_gate_rank=8,
    # mamba / linear attention
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_chunk_size=16,
    mamba_dt_rank=8,
    mamba_d_ssm=64,
    mamba_num_heads=4,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_head_dim=8,
    linear_num_heads=4,
    # gemma3n-style per-layer inputs
    vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=8,
    num_kv_shared_layers=0,
    per_layer_config={},
)

# per-family extras (config model_type -> kwargs) for what the generic rules can't derive; also applies to sub-configs
FAMILY = {
    # default rope_parameters is empty but the rotary embedding needs one entry per layer type (mrope: sections sum to
    # head_dim/2)
    "cohere_compass_text": dict(
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])}
    ),
    # default HCA compress rate 128 would compress nothing at seq 16; small rates exercise both compressors
    "deepseek_v4": dict(compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8}),
    # layers split into input/recurrent/output sections (defaults 8 + rest + 8 must sum to num_hidden_layers): one each
    "dory": dict(
        num_hidden_layers=3,
        n_input_layers=1,
        n_output_layers=1,
        n_recurrent_layers=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # sliding layers take MLA dims from init-only swa_* kwargs (defaults full size); MLA needs kv heads == heads
    "dots3_note_text": dict(
        swa_num_attention_heads=4,
        swa_num_key_value_heads=4,
        swa_q_lora_rank=16,
        swa_kv_lora_rank=16,
        swa_head_dim=8,
        swa_qk_nope_head_dim=4,
        swa_v_head_dim=8,
    ),
    # full-attention layers get head_dim from the init-only kwarg global_head_dim (default 512) via per_layer_config
    "gemma4_text": dict(global_head_dim=16),
    "gemma4_unified_text": dict(global_head_dim=16),
    # default loop covers layers 6..18 (absent at 2 layers); loop bounds must be multiples of the attn-res block size
    "inkling2_loop_text": dict(
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid"] * 2,
        n_layers_per_attn_res_block=2,
        loop_layer_index_start=2,
        loop_layer_index_end=4,
        loop_num_passes=2,
    ),
    # default layer_types is None (checkpoints always list them) but the model indexes it: one conv + one attention
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # audio tower: conformer depth is num_blocks, conv channel widths default to 1024, 2000 relative-bias buckets
    "phi4_multimodal_audio": dict(
        num_blocks=2,
        ext_pw_out_channel=32,
        depthwise_separable_out_channel=32,
        nemo_conv_channels=8,
        bias_max_distance=16,
    ),
    # vision tower: 448px crops = 1024 position embeddings; 56px keeps an even 4x4 patch grid
    "phi4_multimodal_vision": dict(image_size=56, crop_size=56),
    # per-layer n-gram embeddings (PLE, in the TP plan) are off by default: enable on layer id 1 (1-based, must be
    # linear-attention) with a small n-gram vocab
    "qwen4_exp_text": dict(
        ple_layer_ids=[1],
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=64,
        make_ngram_vocab_size_divisible_by=4,
    ),
}

# Families whose training-mode forward samples (beyond dropout, which the tiny configs turn off):
# a data-parallel split draws other numbers for the same rows, so they are compared in eval mode.
SAMPLES_IN_TRAINING = {"phimoe": "sparsemixer routing samples the experts"}


def families() -> list[tuple[str, str]]:
    """(family, causal-LM class name) of each family with a base_model_tp_plan, one per class, named
    by the class's own config (several model types may share a class: LlamaForCausalLM)."""
    out, seen = [], set()
    for mt, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if mt not in CONFIG_MAPPING or not getattr(CONFIG_MAPPING[mt], "base_model_tp_plan", None):
            continue
        if cls_name in seen or not hasattr(transformers, cls_name):
            continue
        seen.add(cls_name)
        out.append((getattr(transformers, cls_name).config_class.model_type or mt, cls_name))
    return sorted(out)


def _kinds(types):
    seen = []
    for t in types:
        if t not in seen:
            seen.append(t)
    return seen


def _is_property(config_cls, k):
    k = getattr(config_cls, "attribute_map", {}).get(k, k)
    return isinstance(getattr(config_cls, k, None), property)


def _tiny_kwargs(config_cls, extra: dict | None = None):
    """Tiny constructor kwargs for config_cls: TINY where settable, derived dims, FAMILY extras; sub-configs recurse."""
    default = config_cls()  # a config only (no weights); sub-configs are made tiny below
    fields = default.to_dict()

    def has(k):
        try:
            return k in fields or hasattr(default, k)
        except Exception:  # e.g. heterogeneous configs refuse global access to per-layer attributes
            return True

    def get(k):
        try:
            return getattr(default, k, None)
        except Exception:
            return fields.get(k)

    def settable(k):
        return has(k) and not _is_property(config_cls, k)

    amap = getattr(config_cls, "attribute_map", {})
    # skip an alias when TINY sets its target directly (e.g. intermediate_size -> moe_intermediate_size)
    kw = {k: v for k, v in TINY.items() if settable(k) and amap.get(k) not in TINY}
    lists = {k: _kinds(get(k)) for k in ("layer_types", "mlp_layer_types") if settable(k) and isinstance(get(k), list)}
    if lists.get("layer_types") == ["linear_attention"]:
        # hybrid whose default is all-mamba (real checkpoints mix in attention): keep one attention layer too
        lists["layer_types"] = ["linear_attention", "full_attention"]
    n = max([2] + [len(v) for v in lists.values()])
    for k, v in lists.items():
        kw[k] = v + [v[-1]] * (n - len(v))
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if settable(k):  # not a derived property (longcat: num_hidden_layers = 2 * num_layers)
            kw[k] = n
    if settable("attn_layer_indices"):
        # hybrid layer pattern given by indices (layer_types is a derived property): layer 0 mamba, last attention
        kw["attn_layer_indices"] = [n - 1]
    if has("qk_rope_head_dim") and get("head_dim") == get("qk_rope_head_dim"):
        # MLA family whose head_dim is the rope dim (rotary embedding sizes from head_dim)
        kw.pop("head_dim", None)
        if "head_dim" not in amap and "qk_rope_head_dim" in kw:
            kw["head_dim"] = kw["qk_rope_head_dim"]
    if has("kv_lora_rank") and "num_key_value_heads" in kw:
        # MLA: keys/values are expanded per query head from the latent, so kv heads == query heads
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    for key, sub_cls in (getattr(config_cls, "sub_configs", None) or {}).items():
        # composite config (e.g. vision/audio towers inside a causal LM): never build the full-size default towers
        kw[key] = sub_cls(**_tiny_kwargs(sub_cls, extra))
    kw.update(FAMILY.get(config_cls.model_type, {}))
    kw.update((extra or {}).get(config_cls.model_type, {}))
    return kw


def tiny_config(cls_name: str, extra: dict | None = None):
    """(model class, tiny config) for a causal-LM class name; every dropout off (the comparisons
    are exact). `extra`: model type -> kwargs over FAMILY's, for one sweep's needs."""
    model_cls = getattr(transformers, cls_name)
    config = model_cls.config_class(**_tiny_kwargs(model_cls.config_class, extra))
    _no_dropout(config)
    return model_cls, config


def _no_dropout(config):
    for k, v in list(config.to_dict().items()):
        if isinstance(v, float) and v > 0 and ("dropout" in k or "pdrop" in k):
            setattr(config, k, 0.0)
    for key in getattr(type(config), "sub_configs", None) or {}:
        if getattr(config, key, None) is not None:
            _no_dropout(getattr(config, key))
