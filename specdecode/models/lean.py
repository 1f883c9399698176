"""A lean forward for the draft: the decoder of a Llama- or Qwen2-style model (RMSNorm, rotary
positions, grouped-query attention, SiLU-gated MLP) written out as plain torch calls over the same
transformers cache, with an int4 draft's q|k|v and gate|up each fused into one layer.

Why: at one token per row a 0.5B draft's forward is mostly per-op overhead, not arithmetic. On 2
cores its int4 matmuls take 8.5 ms of the 19-20 ms that transformers' forward takes
(torch.profiler; docs/speed.md, "Why HumanEval stops near 2.8x"), and the draft runs about four forwards
per target call. Fusing the projections halves the matmul calls; writing the layers out drops the
module and keyword plumbing around each op.

Exactness does not depend on it: the verifier uses whatever q the draft computed (paper §2.3,
docs/exactness.md rule 1), so a draft forward that differs in rounding changes acceptance, never the
output distribution. tests/test_lean.py checks it against transformers' forward to float32
rounding, rows, masks, trees and rollback included, so that acceptance does not drop either.

Only drafts use it (HFCausalLM(lean=True)); a target keeps transformers' forward, which defines
the distribution the user asked for.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdecode.models.quant import Int4Linear

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def supports(model) -> bool:
    """True if `lean` reproduces this model's decoder: a Llama or Qwen2 with default rotary
    positions, SiLU MLPs and the usual module layout (anything else keeps transformers' forward)."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    if (config.model_type not in SUPPORTED_MODEL_TYPES or rope.get("rope_type", "default") != "default"
            or "rope_theta" not in rope or getattr(config, "hidden_act", None) != "silu"
            or getattr(config, "pretraining_tp", 1) != 1):
        return False
    decoder = model.get_decoder()
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    try:
        for layer in decoder.layers:
            for name in names:
                layer.get_submodule(name)
        decoder.norm, decoder.embed_tokens
    except AttributeError:
        return False
    return True


def _fuse(layers: list[torch.nn.Module]):
    """One int4 layer computing the concatenated outputs of int4 `layers` (same input), or None:
    float layers stay apart (a fused copy would add up to two thirds of a float draft's weights
    to memory; an int4 copy of the zoo draft's adds 0.26 GB), as do int8 layers and
    different group sizes."""
    if not all(isinstance(layer, Int4Linear) for layer in layers) or len({l.group_size for l in layers}) != 1:
        return None
    group_size = layers[0].group_size
    # The kernel's packed copies concatenate too where the layout allows it; repacking instead
    # took 0.4 s of the zoo draft's start (its packed copies come from the quantized-draft cache).
    packed = None
    if all(layer.out_features % _PACK_BLOCK == 0 for layer in layers[:-1]) and _packed_copies_concatenate(group_size):
        packed = torch.cat([layer.packed for layer in layers])
    # nibbles [out, in/2]; scale_zero [in/group, out, 2]: both concatenate along out
    return Int4Linear.from_buffers(torch.cat([layer.nibbles for layer in layers]),
                                   torch.cat([layer.scale_zero for layer in layers], 1),
                                   _cat_bias(layers, layers[0].scale_zero.dtype), group_size, packed)


_PACK_BLOCK = 64  # outputs; the int4 kernel packs its weight in blocks of at most this many rows


@functools.cache
def _packed_copies_concatenate(group_size: int) -> bool:
    """Whether the int4 kernel's packed copies of layers whose outputs are multiples of
    _PACK_BLOCK concatenate into the packed copy of the layers stacked. The layout is the
    kernel's own (kernel_layout()), so this checks it once, on small layers, instead of assuming."""
    weights = [torch.randn(rows, 2 * group_size, generator=torch.Generator().manual_seed(rows)) for rows in
               (_PACK_BLOCK, 2 * _PACK_BLOCK)]
    parts = [Int4Linear(w, None, group_size) for w in weights]
    whole = Int4Linear(torch.cat(weights), None, group_size)
    return torch.equal(whole.packed, torch.cat([part.packed for part in parts]))


def _cat_bias(layers, dtype) -> torch.Tensor | None:
    """The layers' biases end to end (zeros for a layer without one), or None if none has one."""
    present = [layer.bias for layer in layers if layer.bias is not None]
    if not present:
        return None
    return torch.cat([layer.bias.to(dtype) if layer.bias is not None
                      else present[0].new_zeros(layer.out_features, dtype=dtype) for layer in layers])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm/Qwen2RMSNorm: normalize in float32, scale in x's dtype."""
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer:
    """One decoder layer's tensors and fused projections."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv = _fuse(self.projections)
        self.splits = [p.out_features for p in self.projections]
        self.o_proj = attn.o_proj
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon

    def qkv_states(self, h: torch.Tensor):
        if self.qkv is None:
            return [p(h) for p in self.projections]
        return self.qkv(h).split(self.splits, dim=-1)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = self.gate_proj(h), self.up_proj(h)
        else:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# Wider calls (a prompt read, a catch-up after accepted drafts) take SDPA even where the model
# chose eager: at 704 query rows over 704 keys (14 query heads, 2 key/value heads, bfloat16, 2
# cores, torch 2.13) eager attention took 25 ms against SDPA's 5.4 with native bfloat16 and 570 ms
# against 16 without (AVX2: its bfloat16 matmul is emulated), at 9 rows 0.41 against 0.21 and
# 5.7 against 0.35. (For one row the earlier Zen 4 measurement favoured eager.)
EAGER_MAX_WIDTH = 8


class LeanDecoder:
    """The decoder of a model `supports` accepts, as a callable with transformers' decoder
    arguments (the subset HFCausalLM uses).

    Call: (input_ids [B, T] long, attention_mask None or [B, 1, T, S] additive float in the model's
        dtype, position_ids [B, T] long, cache: a transformers DynamicCache holding S − T slots)
        → the final hidden states [B, T, hidden] in the model's dtype; the cache grows by T slots
        (cache.update, as transformers does). attention_mask None means every row dense: causal.
    """

    def __init__(self, model):
        config = model.config
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens
        self.layers = [_Layer(layer) for layer in decoder.layers]
        self.norm, self.eps = decoder.norm.weight, decoder.norm.variance_epsilon
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        # the model's own choice: prepare_draft picks eager for a draft (models/quant.py: SDPA's
        # CPU kernel was slow for one query row), for calls of up to EAGER_MAX_WIDTH tokens
        self.eager = getattr(config, "_attn_implementation", None) == "eager"
        base = config.rope_parameters["rope_theta"]
        device = self.embed.weight.device
        self.inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device)
                                        / self.head_dim))

    def _eager_attention(self, q, k, v, mask):
        """transformers' eager attention (scores in the model's dtype, softmax in float32), with
        each key/value head's group of query heads stacked along the query axis instead of
        repeating the keys: q [B, Hq, T, D], k and v [B, Hkv, S, D], mask None or additive
        [B or 1, 1, T, S] → [B, Hq, T, D]."""
        batch, _, width, dim = q.shape
        group = self.num_heads // self.num_kv_heads
        grouped = q.reshape(batch, self.num_kv_heads, group * width, dim)  # row g·T + t: head kv·G + g
        scores = torch.matmul(grouped, k.transpose(2, 3)) * self.scaling
        if mask is not None:
            scores = scores + mask.repeat(1, 1, group, 1)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v).reshape(batch, self.num_heads, width, dim)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                 cache) -> torch.Tensor:
        batch, width = input_ids.shape
        x = self.embed(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]  # [B, 1, T, D]
        mask = attention_mask
        gqa = self.num_heads != self.num_kv_heads
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.norm1, layer.eps1)
            q, k, v = layer.qkv_states(h)
            q = q.view(batch, width, self.num_heads, self.head_dim).transpose(1, 2)
            k = k.view(batch, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(batch, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k, v = cache.update(k, v, index)
            if mask is None and width > 1:  # dense rows: plain causal over the slots held before
                slots = k.shape[2]
                allowed = (torch.arange(slots, device=x.device)[None, :]
                           <= torch.arange(slots - width, slots, device=x.device)[:, None])
                mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(
                    ~allowed, torch.finfo(x.dtype).min)[None, None]
            if self.eager and width <= EAGER_MAX_WIDTH:
                attended = self._eager_attention(q, k, v, mask)
            else:
                attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                                          enable_gqa=gqa)
            x = x + layer.o_proj(attended.transpose(1, 2).reshape(batch, width, -1))
            x = x + layer.mlp(_rms_norm(x, layer.norm2, layer.eps2))
        return _rms_norm(x, self.norm, self.eps)
