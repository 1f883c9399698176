"""A batch-invariant forward for a bfloat16 Llama/Qwen2 target: every token's keys, values and
logits come out bit for bit the same whether it is read alone (a plain step), among the k tokens
of a verify, in a prompt read, or beside other requests' rows.

Why. Paper §2.3 makes speculative sampling return the target's distribution; with a forward whose
rounding depends on how many tokens a call holds, "the target" is a slightly different function in
a verify than in a plain step, and greedy speculative output can leave plain greedy output at a
near-tie. Here every product, norm, activation and attention row runs on specdecode.native's
kernels, which compute each row in a fixed order (rows.cpp), and the rest is elementwise torch
arithmetic that rounds each element alone (residual adds, rotary products, the embedding lookup).
The same kernels read each weight once for all rows of a call, so a 9-token verify costs about
one step's memory traffic (docs/results/native_kernels.md).

It replaces transformers' forward for the models `lean.supports` accepts, on the CPU in bfloat16,
when the target kernel is "bfloat16-invariant" (specdecode.models.pair). q|k|v and gate|up are
fused into one weight each; on a model this process loaded, the layers' own weights become views
of the fused copies, so memory does not grow.
"""

from __future__ import annotations

import torch

from specdecode import native
from specdecode.models.lean import supports


def usable(model) -> bool:
    """Whether this forward can replace `model`'s: a supported decoder in bfloat16 on the CPU."""
    first = next(model.parameters())
    return supports(model) and first.dtype == torch.bfloat16 and first.device.type == "cpu"


def _fused(linears: list[torch.nn.Linear], share: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weights concatenated [ΣN, K] bfloat16, biases [ΣN] float32 or None). share: make each
    layer's weight a view of the fused tensor (no second copy)."""
    weight = torch.cat([layer.weight.detach() for layer in linears]).contiguous()
    if share:
        start = 0
        for layer in linears:
            rows = layer.weight.shape[0]
            layer.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
            start += rows
    if all(layer.bias is None for layer in linears):
        return weight, None
    return weight, torch.cat([layer.bias.detach().float() if layer.bias is not None
                              else torch.zeros(layer.out_features) for layer in linears]).contiguous()


class _Layer:
    def __init__(self, layer, share: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv, self.qkv_bias = _fused([attn.q_proj, attn.k_proj, attn.v_proj], share)
        self.splits = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.o, self.o_bias = _fused([attn.o_proj], False)
        self.gate_up, _ = _fused([mlp.gate_proj, mlp.up_proj], share)
        self.down, _ = _fused([mlp.down_proj], False)
        self.norm1, self.eps1 = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
        self.norm2 = layer.post_attention_layernorm.weight.detach()
        self.eps2 = layer.post_attention_layernorm.variance_epsilon


class InvariantDecoder:
    """The decoder and LM head of a model `usable` accepts, on batch-invariant kernels.

    Call: (input_ids [B, T] long, attention_mask None or [B, 1, T, S] additive float (0: visible),
        position_ids [B, T] long, cache: a transformers DynamicCache holding S − T slots) → the
        final hidden states [B, T, hidden] bfloat16; the cache grows by T slots. Same contract
        as models.lean.LeanDecoder.
    head(hidden [..., hidden] bfloat16) → logits [..., V] float32 (the products accumulate in
        float32 and are not rounded to bfloat16).
    Args:
        model: the transformers model.  share: the model's q/k/v and gate/up weights become views
            of the fused copies (a model this process loaded; never a user's object).
    Raises:
        ValueError: a model `usable` rejects.  native.NativeUnavailable: no kernels here.
    """

    eager = False  # as LeanDecoder's attribute: attention here is the kernel's own

    def __init__(self, model, share: bool = False):
        if not usable(model):
            raise ValueError("the batch-invariant forward runs bfloat16 Llama/Qwen2 decoders on the CPU")
        native.load()
        config = model.config
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens
        self.layers = [_Layer(layer, share) for layer in decoder.layers]
        self.norm, self.eps = decoder.norm.weight.detach(), decoder.norm.variance_epsilon
        head = model.get_output_embeddings()
        if head.bias is not None or any(getattr(config, a, None) for a in
                                        ("final_logit_softcapping", "logit_scale", "logits_scaling")):
            raise ValueError("the batch-invariant forward needs a plain linear LM head")
        self.head_weight = head.weight.detach().contiguous()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        # rotary cos/sin per position, computed once: a table makes a position's values independent
        # of the call that asks for them
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        self._rope_base, self._inv_freq = base, inv_freq
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=torch.bfloat16)
        self._rope_table(getattr(config, "max_position_embeddings", None) or 4096)

    def _rope_table(self, length: int) -> None:
        if length <= self._cos.shape[0]:
            return
        freqs = torch.arange(length, dtype=torch.float64)[:, None] * self._inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return native.linear(hidden, self.head_weight, out_float32=True)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                 cache) -> torch.Tensor:
        batch, width = input_ids.shape
        x = self.embed(input_ids)
        self._rope_table(int(position_ids.max()) + 1)
        cos, sin = self._cos[position_ids][:, :, None], self._sin[position_ids][:, :, None]  # [B, T, 1, D]
        allowed = None if attention_mask is None else attention_mask[:, 0] == 0
        dim = self.head_dim
        for index, layer in enumerate(self.layers):
            h = native.rms_norm(x, layer.norm1, layer.eps1)
            q, k, v = native.linear(h, layer.qkv, layer.qkv_bias).split(layer.splits, dim=-1)
            q = self._rotate(q.view(batch, width, self.num_heads, dim), cos, sin)
            k = self._rotate(k.view(batch, width, self.num_kv_heads, dim), cos, sin)
            k = k.transpose(1, 2).contiguous()
            v = v.reshape(batch, width, self.num_kv_heads, dim).transpose(1, 2).contiguous()
            k, v = cache.update(k, v, index)
            attended = native.attention(q, k, v, allowed, self.scaling)
            x = x + native.linear(attended.view(batch, width, -1), layer.o, layer.o_bias)
            x = x + native.linear(native.silu_mul(native.linear(native.rms_norm(x, layer.norm2, layer.eps2),
                                                                layer.gate_up)), layer.down)
        return native.rms_norm(x, self.norm, self.eps)
