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
1.1-1.5 steps where the step itself is at the memory limit (docs/results/native_kernels_zen4.md).

It replaces transformers' forward for the models `lean.supports` accepts, on the CPU in bfloat16,
when the target kernel is "bfloat16-invariant" (specdecode.models.pair). q|k|v and gate|up are
fused into one weight each; on a model this process loaded, the layers' own weights become views
of the fused copies, so memory does not grow. A prepared draft's int4 layers (groups of 32) run on
the kernels' 4-bit product (the dequantized weights exactly, float32 accumulation): the draft
kernel "native", whose numbers only change acceptance, never the output's distribution (§2.3).
"""

from __future__ import annotations

import torch

from specdecode import native
from specdecode.models import memory
from specdecode.models.lean import supports
from specdecode.models.quant import Int4Linear


def _projections(model) -> list:
    decoder = model.get_decoder()
    return [p for layer in decoder.layers for p in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                    layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                                                    layer.mlp.up_proj, layer.mlp.down_proj)] + [model.get_output_embeddings()]


def _q4_ready(layer) -> bool:
    return isinstance(layer, Int4Linear) and layer.group_size == 32 and layer.nibbles.shape[1] % 32 == 0


def usable(model) -> bool:
    """Whether this forward can replace `model`'s: a supported decoder on the CPU whose products
    are bfloat16 layers or a prepared draft's int4 layers (groups of 32)."""
    first = next(model.parameters())
    if not supports(model) or first.dtype != torch.bfloat16 or first.device.type != "cpu":
        return False
    return all((type(p) is torch.nn.Linear and p.weight.dtype == torch.bfloat16) or _q4_ready(p)
               for p in _projections(model))


class _Bfloat16:
    """A product on bfloat16 weights [N, K] (and a float32 bias)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor, out_float32: bool = False) -> torch.Tensor:
        return native.linear(x, self.weight, self.bias, out_float32)

    def first_rows(self, n: int) -> "_Bfloat16":
        return _Bfloat16(self.weight[:n], None if self.bias is None else self.bias[:n])


class _Int4:
    """A product on a prepared draft's int4 weights in rows.cpp's layout (native.linear_q4); calls
    whose rows hold WIDE_TOKENS tokens or more (a draft's prompt read, read alone) go to the layers'
    own torch kernel, whose tiled product is faster there. The draft's numbers are free, but a
    batch's steps stay on the row-invariant kernel, so that a row's drafts do not depend on the
    other rows (a seeded request's tokens depend on its drafts)."""

    WIDE_TOKENS = 16

    def __init__(self, codes, scales, corrections, bias, layers: list, rows: int | None = None):
        self.codes, self.scales, self.corrections, self.bias = codes, scales, corrections, bias
        self.layers, self.rows = layers, rows

    def __call__(self, x: torch.Tensor, out_float32: bool = False) -> torch.Tensor:
        if x.dim() > 1 and x.shape[-2] >= self.WIDE_TOKENS:
            out = torch.cat([layer(x) for layer in self.layers], dim=-1)[..., :self.rows]
            return out.float() if out_float32 else out
        return native.linear_q4(x, self.codes, self.scales, self.corrections, self.bias, out_float32)

    def first_rows(self, n: int) -> "_Int4":
        return _Int4(self.codes[:n], self.scales[:n], self.corrections[:n],
                     None if self.bias is None else self.bias[:n], self.layers, n)


def q4_layout(layer: Int4Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K/2] uint8 in rows.cpp's blocks of 64, scales and corrections [N, K/32] float32)
    of an Int4Linear with groups of 32: W = (c − 8)·s + z = c·s + (z − 8·s)."""
    nibbles = layer.nibbles
    codes = torch.stack([nibbles & 15, nibbles >> 4], -1).reshape(nibbles.shape[0], -1)  # [N, K], input order
    blocks = codes.view(codes.shape[0], -1, 2, 32)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(codes.shape[0], -1).contiguous()
    scale, zero = layer.scale_zero[..., 0].float().T, layer.scale_zero[..., 1].float().T
    return packed, scale.contiguous(), (zero - 8 * scale).contiguous()


def _fused(linears: list, share: bool):
    """One product computing the layers' outputs end to end (same input): _Bfloat16 or _Int4.
    share: make each bfloat16 layer's weight a view of the fused tensor (no second copy)."""
    bias = None
    if any(layer.bias is not None for layer in linears):
        bias = torch.cat([layer.bias.detach().float() if layer.bias is not None
                          else torch.zeros(layer.out_features) for layer in linears]).contiguous()
    if isinstance(linears[0], Int4Linear):
        parts = [q4_layout(layer) for layer in linears]
        return _Int4(*(torch.cat([part[i] for part in parts]).contiguous() for i in range(3)), bias, linears)
    if len(linears) == 1:  # nothing to fuse: the layer's own weight, no copy
        return _Bfloat16(linears[0].weight.detach().contiguous(), bias)
    weight = torch.cat([layer.weight.detach() for layer in linears]).contiguous()
    if share:
        start = 0
        for layer in linears:
            rows = layer.weight.shape[0]
            # a weight transformers mapped from a safetensors file: the pages the copy read go back
            memory.drop_file_pages(layer.weight.detach())
            layer.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
            start += rows
    return _Bfloat16(weight, bias)


class _Layer:
    """One decoder layer's products (fused q|k|v and gate|up), norms and their epsilons."""

    def __init__(self, qkv, o, gate_up, down, norm1, norm2, eps1: float, eps2: float):
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.norm1, self.norm2, self.eps1, self.eps2 = norm1, norm2, eps1, eps2

    @classmethod
    def of(cls, layer, share: bool) -> "_Layer":
        """A transformers layer's, on its own weights (see _fused)."""
        attn, mlp = layer.self_attn, layer.mlp
        return cls(_fused([attn.q_proj, attn.k_proj, attn.v_proj], share), _fused([attn.o_proj], False),
                   _fused([mlp.gate_proj, mlp.up_proj], share), _fused([mlp.down_proj], False),
                   layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                   layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon)


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
        vocab_limit: the head scores only the first vocab_limit ids (a draft's cheaper head).
    Raises:
        ValueError: a model `usable` rejects.  native.NativeUnavailable: no kernels here.
    """

    eager = False  # as LeanDecoder's attribute: attention here is the kernel's own

    def __init__(self, model, share: bool = False, vocab_limit: int | None = None):
        if not usable(model):
            raise ValueError("the batch-invariant forward runs bfloat16 Llama/Qwen2 decoders (bfloat16 or a "
                             "draft's int4 layers) on the CPU")
        head = model.get_output_embeddings()
        if head.bias is not None:
            raise ValueError("the batch-invariant forward needs a plain linear LM head")
        decoder = model.get_decoder()
        self._setup(model.config, decoder.embed_tokens, [_Layer.of(layer, share) for layer in decoder.layers],
                    decoder.norm.weight.detach(), decoder.norm.variance_epsilon, _fused([head], False), vocab_limit)

    @classmethod
    def of_parts(cls, config, embed, layers: list[_Layer], norm: torch.Tensor, eps: float, head,
                 vocab_limit: int | None = None) -> "InvariantDecoder":
        """A decoder from its parts (models.kquant builds one from a GGUF file's own blocks): embed
        maps ids [B, T] long to bfloat16 [B, T, hidden]; layers and head hold products (_Bfloat16,
        _Int4 or a kquant product: called as product(x, out_float32); the head's first_rows(n) where
        vocab_limit is given)."""
        decoder = cls.__new__(cls)
        decoder._setup(config, embed, layers, norm, eps, head, vocab_limit)
        return decoder

    def _setup(self, config, embed, layers, norm, eps, head, vocab_limit) -> None:
        if any(getattr(config, a, None) for a in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
            raise ValueError("the batch-invariant forward needs a plain linear LM head")
        native.load()
        self.embed, self.layers, self.norm, self.eps = embed, layers, norm, eps
        self._head = head if vocab_limit is None else head.first_rows(vocab_limit)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        # rotary cos/sin per position, computed once: a table makes a position's values independent
        # of the call that asks for them
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        self._inv_freq = inv_freq
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=torch.bfloat16)
        self._rope_table(getattr(config, "max_position_embeddings", None) or 4096)

    def _rope_table(self, length: int) -> None:
        if length <= self._cos.shape[0]:
            return
        freqs = torch.arange(length, dtype=torch.float64)[:, None] * self._inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(hidden, out_float32=True)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                 cache) -> torch.Tensor:
        batch, width = input_ids.shape
        x = self.embed(input_ids)
        self._rope_table(int(position_ids.max()) + 1)
        cos, sin = self._cos[position_ids], self._sin[position_ids]  # [B, T, D]
        # once per forward, in the bytes the kernel reads (every layer attends with the same mask)
        allowed = None if attention_mask is None else (attention_mask[:, 0] == 0).to(torch.uint8).contiguous()
        for index, layer in enumerate(self.layers):
            h = native.rms_norm(x, layer.norm1, layer.eps1)
            # q, k, v with the rotary embedding, rounded as transformers' bfloat16 arithmetic does
            q, k, v = native.rope_split(layer.qkv(h), cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
            k, v = cache.update(k, v, index)
            attended = native.attention(q, k, v, allowed, self.scaling)
            x = x + layer.o(attended.view(batch, width, -1))
            x = x + layer.down(native.silu_mul(layer.gate_up(native.rms_norm(x, layer.norm2, layer.eps2))))
        return native.rms_norm(x, self.norm, self.eps)
