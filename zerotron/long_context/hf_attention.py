"""Ulysses for Hugging Face models (ALST, DeepSpeed's `UlyssesSPAttentionHF`): the model is left as
it is; the attention function Transformers dispatches to (`ALL_ATTENTION_FUNCTIONS[name]`) is
replaced by one that trades q, k and v from a sequence split to a head split, runs the original
function over the full sequence for heads/sp heads, and trades the output back.

Transformers hands attention functions [batch, heads, seq, head_dim] tensors and takes back
[batch, seq, heads, head_dim]. The causal mask is the function's own (`attention_mask` is dropped:
a 4-D mask over the full sequence is what long context cannot afford), so "eager", which only
masks through `attention_mask`, is refused. With more sequence ranks than key/value heads, each
key/value head is repeated so every rank gets one (the query heads a rank holds all read it).
"""

from __future__ import annotations

import torch

from ..comm import comm_for
from .ring import ring_attention
from .ulysses import seq_all_to_all

_NEEDS_MASK = ("eager", "paged|eager")


class _FewerKVGroups:
    """The attention module as the attention function sees it when key/value heads were repeated:
    every attribute the module's, but `num_key_value_groups` the local query/key-value ratio."""

    def __init__(self, module, groups: int):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "num_key_value_groups", groups)

    def __getattr__(self, name):
        return getattr(self._module, name)


class UlyssesSPAttentionHF(torch.nn.Module):
    """DeepSpeed's `UlyssesSPAttentionHF(attn, batch_size, attn_head_count, attn_head_size,
    kv_head_count, num_hidden_layers, process_group, seq_length_is_variable=False,
    local_seq_length=None, global_seq_length=None, disable_in_eval=False)`: called as a Transformers
    attention function, `(module, query, key, value, attention_mask, **kwargs) -> (output, weights)`.
    With `seq_length_is_variable=False` every batch must have `global_seq_length` tokens."""

    def __init__(
        self,
        attn,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ):
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.comm = comm_for(process_group, "sp")
        self.world_size, self.sp_rank = self.comm.size, self.comm.rank
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = (
            attn_head_count,
            attn_head_size,
            kv_head_count,
        )
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation = None
        sp = self.world_size
        if attn_head_count % sp:
            raise ValueError(
                f"{attn_head_count} attention heads cannot be dealt out to sequence_parallel_size {sp}: Ulysses gives "
                "each rank whole heads; use a sequence_parallel_size that divides the number of attention heads"
            )
        if kv_head_count % sp and sp % kv_head_count:
            raise ValueError(
                f"{kv_head_count} key/value heads and sequence_parallel_size {sp}: one must divide the other (each "
                "rank gets whole key/value heads, or one repeated head when sp is larger); use a "
                "sequence_parallel_size that divides the key/value heads or is a multiple of them"
            )
        self.kv_replication_factor = max(1, sp // kv_head_count)
        self.local_q_head_count = attn_head_count // sp
        self.local_kv_head_count = max(1, kv_head_count // sp)
        if not seq_length_is_variable and (local_seq_length is None or global_seq_length is None):
            raise ValueError(
                "seq_length_is_variable=False needs local_seq_length and global_seq_length (the fixed lengths); "
                "or pass seq_length_is_variable=True"
            )

    def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_length(query)
        if self.kv_replication_factor > 1:
            key, value = (t.repeat_interleave(self.kv_replication_factor, dim=1) for t in (key, value))
        q, k, v = (seq_all_to_all(t, self.process_group, 1, 2) for t in (query, key, value))
        if "position_ids" in kwargs and kwargs["position_ids"] is not None:
            kwargs["position_ids"] = torch.cat(self.comm.all_gather_list(kwargs["position_ids"]), dim=-1)
        if self.kv_replication_factor > 1:
            module = _FewerKVGroups(module, q.shape[1] // k.shape[1])
        context, weights = self.attn(module, q, k, v, None, *args, **kwargs)
        context = seq_all_to_all(context, self.process_group, 1, 2)  # [b, s, h/sp, d] -> [b, s/sp, h, d]
        return context.reshape(*context.shape[:2], -1), weights

    def _check_length(self, query):
        if self.seq_length_is_variable:
            return
        if query.shape[2] != self.local_seq_length:
            raise ValueError(
                f"this batch has {query.shape[2] * self.world_size} tokens per sequence, not the fixed "
                f"seq_length {self.global_seq_length}: pass seq_length_is_variable=True (accelerate: "
                "sp_seq_length_is_variable) or batches of that length"
            )

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation,
        sequence_parallel_size,
        micro_batch_size,
        seq_length=None,
        seq_length_is_variable=True,
        disable_in_eval=False,
        max_length=None,
    ):
        """Make Transformers' `core_attn_implementation` (e.g. "sdpa") attention run under Ulysses
        over `sequence_parallel_size` ranks; returns the sequence-parallel mpu
        (`deepspeed.runtime.sequence_parallel.parallel_state_sp`) to hand `initialize(mpu=...)`, or
        None when the size is 1. Registering again replaces the earlier registration."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("seq_length_is_variable=False needs seq_length, the length of every batch's sequences")
        from transformers import AutoConfig, PreTrainedModel

        from . import mpu

        mpu.initialize_sequence_parallel(sequence_parallel_size)
        loaded = isinstance(model_name_or_path, PreTrainedModel) or hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        chosen = getattr(config, "_attn_implementation", None) if loaded else None
        if chosen is not None and chosen != core_attn_implementation:
            raise ValueError(
                f"core_attn_implementation {core_attn_implementation!r} is not the model's attn_implementation "
                f"{chosen!r}: Ulysses wraps the function the model calls, so load the model with "
                f"attn_implementation={core_attn_implementation!r} or pass {chosen!r}"
            )
        wrap_attention(
            config,
            core_attn_implementation,
            mpu.get_sequence_parallel_group(),
            micro_batch_size,
            None if seq_length_is_variable else seq_length,
            disable_in_eval,
        )
        return mpu


def _ring_function(group):
    """Ring attention over `group` as a Transformers attention function (causal; the batch laid out
    in load-balanced halves: shard_batch with cp_size)."""

    def ring(module, query, key, value, attention_mask, *args, dropout=0.0, scaling=None, **kwargs):
        if dropout:
            raise ValueError(
                f"ring attention has no attention dropout: set the model's attention_dropout to 0 ({dropout})"
            )
        return ring_attention(query, key, value, group, causal=True, scale=scaling).transpose(1, 2), None

    return ring


class _Alone:
    """Ring attention without Ulysses around it, stepping aside in eval like Ulysses' wrapper."""

    def __init__(self, attn, original, disable_in_eval):
        self.attn, self.original, self.disable_in_eval = attn, original, disable_in_eval

    def __call__(self, module, *args, **kwargs):
        return (self.original if self.disable_in_eval and not module.training else self.attn)(module, *args, **kwargs)


def wrap_attention(
    config, implementation, group, micro_batch_size=1, seq_length=None, disable_in_eval=False, ring_group=None
):
    """Replace Transformers' attention function `implementation` by its sequence-parallel form for
    models with `config`'s heads: Ulysses over `group` (None or one rank: none), around ring
    attention over `ring_group` when given (`seq_length` None: any length). Wrapping again replaces
    the earlier wrapper rather than wrapping it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in _NEEDS_MASK:
        raise ValueError(
            f"attn_implementation {implementation!r} masks only through a 4-D attention mask over the whole "
            "sequence, which Ulysses does not build: use 'sdpa' or a flash-attention implementation"
        )
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"{implementation!r} is not a Transformers attention implementation; choose one of "
            f"{sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}"
        )
    text = config.get_text_config()
    sp = 1 if group is None else comm_for(group, "sp").size
    if seq_length is not None and seq_length % sp:
        raise ValueError(f"seq_length {seq_length} is not a multiple of sequence_parallel_size {sp}")
    original = ALL_ATTENTION_FUNCTIONS[implementation]
    original = getattr(original, "ulysses_core", original)
    core = original if ring_group is None else _ring_function(ring_group)
    if sp == 1:
        _install(implementation, original, _Alone(core, original, disable_in_eval), (None, ring_group))
        return
    uattn = UlyssesSPAttentionHF(
        attn=core,
        batch_size=micro_batch_size,
        attn_head_count=text.num_attention_heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        kv_head_count=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=seq_length is None,
        local_seq_length=None if seq_length is None else seq_length // sp,
        global_seq_length=seq_length,
        disable_in_eval=disable_in_eval,
    )
    uattn.core_attn_implementation = implementation
    _install(implementation, original, uattn, (group, ring_group))


def _install(implementation, original, attend, groups):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def sequence_parallel_attention(module, query, key, value, attention_mask, *args, **kwargs):
        return attend(module, query, key, value, attention_mask, *args, **kwargs)

    sequence_parallel_attention.ulysses_core, sequence_parallel_attention.groups = original, groups
    ALL_ATTENTION_FUNCTIONS[implementation] = sequence_parallel_attention


def wrapped_groups(implementation: str):
    """(Ulysses group, ring group) Transformers' attention `implementation` runs over (None where
    there is none), or None when it is not wrapped."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return getattr(ALL_ATTENTION_FUNCTIONS.get(implementation), "groups", None)


def unregister_from_transformers(core_attn_implementation: str) -> None:
    """Put back the attention function `register_with_transformers` wrapped (zerotron's addition)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
    if hasattr(current, "ulysses_core"):
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = current.ulysses_core
