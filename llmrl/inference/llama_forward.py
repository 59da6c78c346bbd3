"""The forward pass of Llama and Qwen2 in plain torch ops, on the model's own weights.

Used by `LlamaFamilyDecoder` (``llama_decoder.py``), which owns the KV cache. The weights are
read once into the layout this forward wants (`read_weights`): q/k/v and gate/up projections
concatenated into one matmul each, the attention scale folded into the query weights, q/k rows
reordered into pairs so that rotary embedding is one complex multiply. Those fused tensors are
new ones, the decoder's; every other weight is the model's own tensor. A new value of a q/k/v or
gate/up tensor goes into its rows of the fused tensors through the same transform
(`FusedRows.write`), at reading and at every weight update. The residual stream is
kept by columns, so that the weights are the left operand of each matmul (`_column_linear` says
why).

A decode step (`LlamaForward.step`) is one function of the weights, the caches and per-row index
tensors: it builds the masks and rotary rows, runs the forward pass, in which each row attends to
its cached positions and to the new token through that token's own key and value (one more score
column under the same softmax), and then writes every layer's new keys and values with one
indexed write each. A group whose prompt sits in the shared cache is attended by cascade
attention (`LlamaForward._cascade`): two score blocks under one softmax, the group's queries laid
out on a ``(groups, width)`` grid so one batched matmul reads the prompt's keys/values once for
all its rows. Grouped-query attention needs no repeated keys: the ``heads / kv_heads`` query
heads of a kv head are the query axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from llmrl.algorithms.varlen import attend_spans


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # (heads*D + 2*kv_heads*D, hidden): q, k and v stacked
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor  # (2*intermediate, hidden): gate then up
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


class LlamaWeights(NamedTuple):
    """The model's weights as the forward pass uses them (`read_weights`)."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    lm_head_bias: torch.Tensor | None
    layers: tuple[LayerWeights, ...]


class SharedPrompts(NamedTuple):
    """What cascade attention reads besides the rows' own caches (`LlamaForward._cascade`)."""

    keys: torch.Tensor  # shared_k: (layers, groups_cap, kv_heads, capacity, D)
    values: torch.Tensor
    positions: torch.Tensor  # (span,) 0, 1, ...: the prompt positions attended (span >= every prompt)
    lengths: torch.Tensor  # (B,): prompt positions of each row's group (0 for rows of inline groups)
    grid_rows: torch.Tensor  # (groups, width): the row at each cell of the query grid (0 where none)
    row_group: torch.Tensor  # (B,)
    row_slot: torch.Tensor  # (B,)


class RowCache(Protocol):
    """Where a decode step reads each row's cached keys and values and writes the new ones."""

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cached keys and values of the step's rows, (B, kv_heads, span, D) each."""
        ...

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Cache every layer's new keys and values, (B, layers, kv_heads, D) each, at each row's
        next position."""
        ...


class FusedRows(NamedTuple):
    """Where one q/k/v/gate/up weight or bias of the model sits in the fused tensors: rows
    ``start:stop`` of ``layers[layer].<field>``, its rows interleaved per head (`heads`, q and k)
    and times `scale` (q)."""

    layer: int
    field: str
    start: int
    stop: int
    heads: int | None = None
    scale: float | None = None

    def write(self, weights: LlamaWeights, value: torch.Tensor) -> None:
        """Copy the model tensor `value` into its rows of `weights`, in the forward's layout.

        Converted to the fused tensor's dtype first, then interleaved and scaled in that dtype: the
        rows hold what the model's own parameter of `value` would give.
        """
        target = self.rows(weights)
        target.copy_(self.in_layout(value.to(device=target.device, dtype=target.dtype)))

    def rows(self, weights: LlamaWeights) -> torch.Tensor:
        """The rows of the fused tensor this weight serves in (a view)."""
        return getattr(weights.layers[self.layer], self.field)[self.start : self.stop]

    def in_layout(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (a model tensor, or a delta to one) interleaved and scaled as the forward reads it."""
        if self.heads is not None:
            value = _interleave_pairs(value, self.heads)
        if self.scale is not None:
            value = value * self.scale
        return value


def fused_rows(model: torch.nn.Module, heads: int, kv_heads: int, head_dim: int) -> dict[str, FusedRows]:
    """Each q/k/v/gate/up weight and bias of `model`, by state-dict name, and its rows in the fused
    tensors."""
    names = {module: name for name, module in model.named_modules()}
    # Queries carry the attention scale (1/sqrt(D)), so scores need no scaling op.
    scale = head_dim**-0.5
    rows: dict[str, FusedRows] = {}
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for fused, parts in (
            ("qkv", ((attn.q_proj, heads, scale), (attn.k_proj, kv_heads, None), (attn.v_proj, None, None))),
            ("gate_up", ((mlp.gate_proj, None, None), (mlp.up_proj, None, None))),
        ):
            start = 0
            for linear, interleaved_heads, part_scale in parts:
                stop = start + linear.out_features
                for kind in ("weight", "bias"):
                    if getattr(linear, kind) is not None:
                        rows[f"{names[linear]}.{kind}"] = FusedRows(
                            index, f"{fused}_{kind}", start, stop, interleaved_heads, part_scale
                        )
                start = stop
    return rows


def read_weights(model: torch.nn.Module, fused: dict[str, FusedRows]) -> LlamaWeights:
    """`model`'s parameters in the forward's layout (module docstring): its own tensors, and new
    fused q/k/v and gate/up tensors filled from the parameters `fused` (`fused_rows`) names."""
    inner = model.model
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv_weight=_fused_weight(attn.q_proj, attn.k_proj, attn.v_proj),
                qkv_bias=_fused_bias(attn.q_proj, attn.k_proj, attn.v_proj),
                o_weight=attn.o_proj.weight,
                o_bias=attn.o_proj.bias,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up_weight=_fused_weight(mlp.gate_proj, mlp.up_proj),
                gate_up_bias=_fused_bias(mlp.gate_proj, mlp.up_proj),
                down_weight=mlp.down_proj.weight,
                down_bias=mlp.down_proj.bias,
            )
        )
    weights = LlamaWeights(
        inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight, model.lm_head.bias, tuple(layers)
    )
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, rows in fused.items():
            rows.write(weights, parameters[name])
    return weights


def rotation_table(model: torch.nn.Module, length: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """Rotary rotations of positions ``0 .. length - 1`` in pair order, complex (length, D/2).

    From the model's own rotary module (any static rope scaling, attention factor included); its
    cos/sin repeat over the two halves, so the first half holds one value per pair.
    """
    probe = torch.empty(0, device=device, dtype=torch.float32)
    cos, sin = model.model.rotary_emb(probe, torch.arange(length, device=device)[None])
    return torch.complex(cos[0, :, : head_dim // 2].float(), sin[0, :, : head_dim // 2].float())


def _fused_weight(*linears: torch.nn.Linear) -> torch.Tensor:
    """Room for the weights of `linears` stacked by rows (filled by `FusedRows.write`)."""
    first = linears[0].weight
    return first.new_empty(sum(lin.out_features for lin in linears), first.shape[1])


def _fused_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    """Room for the biases of `linears` stacked, zeros where one has none; None when none has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return linears[0].weight.new_zeros(sum(lin.out_features for lin in linears))


def _interleave_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's output dims from halves (x_i, x_{i+D/2}) to pairs (x_{2i}, x_{2i+1}).

    Rotary embedding rotates dim i with dim i + D/2 (Llama's ``rotate_half``); with the q and k
    projections' rows reordered so that those dims sit side by side, the rotation is one complex
    multiply. q.k products are unchanged: both sides carry the same permutation.
    """
    dim = weight.shape[0] // heads
    order = (
        torch.arange(dim, device=weight.device).view(2, dim // 2).t().reshape(dim)
    )  # 0, D/2, 1, D/2+1, ...
    return weight.reshape(heads, dim, *weight.shape[1:])[:, order].reshape(weight.shape)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` (..., D) in pair order, by complex `rotation` (positions, ..., D/2)
    broadcastable to the pairs of `x`: one complex multiply."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def prompt_mask(lengths: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(N, 1, P, P) attention mask of right-padded prompts: causal, and no key beyond a prompt's end."""
    return ((positions[None, :] <= positions[:, None]) & (positions < lengths[:, None, None]))[:, None]


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere."""
    return torch.zeros(allowed.shape, device=allowed.device, dtype=dtype).masked_fill_(
        ~allowed, float("-inf")
    )


class LlamaForward:
    """The layers' arithmetic, shared by prefill and decode; holds only the architecture's constants."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, *, eps: float, act_fn: torch.nn.Module):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.eps = eps
        self.act_fn = act_fn
        self.silu = isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each column of `x` (features, tokens); Llama/Qwen2 normalise in float32 and
        scale in the model dtype."""
        x32 = x.float()
        return weight[:, None] * (x32 * torch.rsqrt(x32.pow(2).mean(0, keepdim=True) + self.eps)).to(x.dtype)

    def qkv(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """The attention's queries, keys and values by token, (tokens, (H + 2 Hkv) D)."""
        return F.linear(self.rms_norm(x, layer.input_norm).t(), layer.qkv_weight, layer.qkv_bias)

    def rotated_qkv(
        self, x: torch.Tensor, layer: LayerWeights, rotation: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (tokens, H, D), keys and values (tokens, Hkv, D) of the columns of `x`, queries and
        keys rotated by `rotation` (tokens, 1, D/2)."""
        tokens, heads, kv_heads, dim = x.shape[1], self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(x, layer)
        qk = _rotate(qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim), rotation)
        return qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)

    def attention_mlp_residual(
        self, x: torch.Tensor, attn: torch.Tensor, layer: LayerWeights
    ) -> torch.Tensor:
        """The layer's output stream: ``x + o(attn)``, then plus the gated MLP of its norm (gate
        and up in one matmul). `attn` is by token, (tokens, H D)."""
        x = _column_linear(attn.t(), layer.o_weight, layer.o_bias, residual=x)
        gate, up = _column_linear(
            self.rms_norm(x, layer.post_norm), layer.gate_up_weight, layer.gate_up_bias
        ).chunk(2)
        activated = F.silu(gate) if self.silu else self.act_fn(gate)
        return _column_linear(activated * up, layer.down_weight, layer.down_bias, residual=x)

    def logits(self, x: torch.Tensor, weights: LlamaWeights) -> torch.Tensor:
        """Next-token logits by token, (tokens, V), of the columns of `x`."""
        return (
            _column_linear(self.rms_norm(x, weights.final_norm), weights.lm_head, weights.lm_head_bias)
            .t()
            .contiguous()
        )

    def prefill(
        self,
        weights: LlamaWeights,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        rotation: torch.Tensor,
        mask: torch.Tensor | None,
        write: Callable[[int, torch.Tensor, torch.Tensor], None],
    ) -> torch.Tensor:
        """Forward of right-padded prompts `ids` (N, P): logits at each prompt's last position (N, V).

        `write(layer, keys, values)` stores each layer's (N, Hkv, P, D) keys and values; `mask`
        (N, 1, P, P) hides padding (None: prompts of one length, plain causal attention, the
        fastest kernel); `rotation` holds the positions' rotary rows, broadcastable over heads.
        """
        num_prompts, width = ids.shape
        x = self.residual(weights, ids, rotation, mask, write)
        return self.logits(x[:, torch.arange(num_prompts, device=ids.device) * width + lengths - 1], weights)

    def packed_prefill(
        self,
        weights: LlamaWeights,
        ids: torch.Tensor,
        cu: torch.Tensor,
        longest: int,
        rotation: torch.Tensor,
        write: Callable[[int, torch.Tensor, torch.Tensor], None],
    ) -> torch.Tensor:
        """Forward of prompts packed end to end, `ids` (T,), prompt i the span ``cu[i]:cu[i + 1]``
        (`cu` int32): logits at each prompt's last position (N, V). Attention runs within the spans
        (`attend_spans`: no padding, no mask); `rotation` (T, 1, D/2) holds each token's rotary row;
        `write(layer, keys, values)` stores each layer's (T, kv_heads, D) keys and values."""
        x = F.embedding(ids, weights.embed).t()  # (hidden, T)
        for index, layer in enumerate(weights.layers):
            query, key, value = self.rotated_qkv(x, layer, rotation)
            write(index, key, value)
            attn = attend_spans(query, key, value, cu, longest, scale=1.0)
            x = self.attention_mlp_residual(x, attn.flatten(1), layer)
        return self.logits(x[:, cu[1:].long() - 1], weights)

    def residual(
        self,
        weights: LlamaWeights,
        ids: torch.Tensor,
        rotation: torch.Tensor,
        mask: torch.Tensor | None,
        write: Callable[[int, torch.Tensor, torch.Tensor], None],
    ) -> torch.Tensor:
        """The residual stream after the last layer, (hidden, N P) by columns, of prompts `ids` (N, P);
        the other arguments as for `prefill`."""
        num_prompts, width = ids.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids.flatten(), weights.embed).t()  # (hidden, N P): the residual stream by columns
        for index, layer in enumerate(weights.layers):
            qkv = self.qkv(x, layer).view(num_prompts, width, -1)  # (N, P, (H + 2 Hkv) D)
            qk = qkv[..., : (heads + kv_heads) * dim].view(num_prompts, width, heads + kv_heads, dim)
            qk = _rotate(qk, rotation).transpose(1, 2)  # (N, H + Hkv, P, D)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[..., (heads + kv_heads) * dim :].view(num_prompts, width, kv_heads, dim).transpose(1, 2)
            write(index, k, v)
            attn = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=1.0, enable_gqa=heads != kv_heads
            )
            x = self.attention_mlp_residual(
                x, attn.transpose(1, 2).reshape(num_prompts * width, heads * dim), layer
            )
        return x

    def step(
        self,
        weights: LlamaWeights,
        tokens: torch.Tensor,
        cached: torch.Tensor,
        positions: torch.Tensor,
        rotation_table: torch.Tensor,
        cache: RowCache,
        shared: SharedPrompts | None,
    ) -> torch.Tensor:
        """One decode step of every row: next-token logits (B, V), and each row's new key and value
        handed to ``cache.write`` for its position ``cached[row]``.

        Rows attend to their cache's first ``span`` positions (`positions`: 0, 1, ..., ``span - 1``,
        every ``cached[row] <= span``), masked from ``cached[row]`` on. The masks and the rotary
        rows (from `rotation_table`, complex rows by position) are built here from the per-row
        index tensors.
        """
        row_bias = _additive_mask(positions < cached[:, None], weights.embed.dtype)
        rotation = rotation_table[cached if shared is None else shared.lengths + cached].unsqueeze(
            -2
        )  # over the heads
        logits, keys, values = self.decode(weights, tokens, rotation, row_bias, cache.read, shared)
        cache.write(keys, values)
        return logits

    def decode(
        self,
        weights: LlamaWeights,
        tokens: torch.Tensor,
        rotation: torch.Tensor,
        row_bias: torch.Tensor,
        read_cache: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        shared: SharedPrompts | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per row: (logits (B, V), new keys and values (B, layers, kv_heads, D)).

        `read_cache(layer)` gives the rows' cached keys and values, (B, kv_heads, span, D) each,
        whose positions `row_bias` (B, span) masks; the new token attends to itself through its
        own key and value, which the caller then caches.
        """
        rows, heads, kv_heads, dim = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        bias = row_bias[:, None, None, :]  # (B, 1, 1, span)
        keys, values = [], []
        x = F.embedding(tokens, weights.embed).t()  # (hidden, B): the residual stream by columns
        for index, layer in enumerate(weights.layers):
            query, key, value = self.rotated_qkv(x, layer, rotation)
            keys.append(key)
            values.append(value)
            # Query heads grouped by their kv head, (B, Hkv, G, D): no repeated keys for GQA.
            q = query.view(rows, kv_heads, heads // kv_heads, dim)
            own = read_cache(index)
            if shared is None:
                attn = self._attention(q, own, bias, key, value)
            else:
                attn = self._cascade(q, index, shared, own, bias, key, value)
            x = self.attention_mlp_residual(x, attn.reshape(rows, heads * dim), layer)
        return self.logits(x, weights), torch.stack(keys, 1), torch.stack(values, 1)

    def _attention(
        self,
        q: torch.Tensor,
        cached: tuple[torch.Tensor, torch.Tensor],
        bias: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """Attention over each row's cached positions and its new token, (B, Hkv, G, D).

        Written out rather than ``scaled_dot_product_attention``: with one query position its CPU
        kernel is slower. Computed in float32 whatever the model's dtype (`_float32`).
        """
        dtype = q.dtype
        q, key, value, *cached = _float32(q, key, value, *cached)
        scores = torch.cat(self._own_scores(q, cached, bias, key), dim=-1)  # (B, Hkv, G, span + 1)
        return self._own_output(torch.softmax(scores, dim=-1), cached, value).to(dtype)

    @staticmethod
    def _own_scores(
        q: torch.Tensor, cached: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor, key: torch.Tensor
    ) -> list[torch.Tensor]:
        """Scores of each row's cached positions (B, Hkv, G, span) and of its new token (B, Hkv, G, 1)."""
        return [
            torch.matmul(q, cached[0].transpose(-1, -2)) + bias,
            (q * key[:, :, None]).sum(-1, keepdim=True),
        ]

    @staticmethod
    def _own_output(
        probs: torch.Tensor, cached: tuple[torch.Tensor, torch.Tensor], value: torch.Tensor
    ) -> torch.Tensor:
        """Attention output over each row's cached positions and new token, whose probabilities end
        `probs` (``[..., -span - 1 :]``)."""
        span = cached[1].shape[-2]
        cached_output = torch.matmul(probs[..., -span - 1 : -1], cached[1])
        return cached_output + probs[..., -1:] * value[:, :, None]

    def _cascade(
        self,
        q: torch.Tensor,
        index: int,
        shared: SharedPrompts,
        cached: tuple[torch.Tensor, torch.Tensor],
        bias: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        """Attention over a group's shared prompt, the row's own cache and its new token, one softmax.

        The queries of a group's rows sit on a (groups, width) grid, so one batched matmul per
        group reads its prompt's keys/values once for all its rows; rows of inline groups have a
        shared length of 0, so their grid scores are all masked. Computed in float32 (`_float32`).
        """
        dtype = q.dtype
        q, key, value, *cached = _float32(q, key, value, *cached)
        groups, width = shared.grid_rows.shape
        rows, kv_heads, per_kv, dim = q.shape
        prompt = shared.positions.shape[0]
        prompt_bias = _additive_mask(shared.positions < shared.lengths[:, None], q.dtype)
        prompt_keys, prompt_values = _float32(
            shared.keys[index, :groups, :, :prompt], shared.values[index, :groups, :, :prompt]
        )  # (groups, Hkv, P, D)
        query_grid = q[shared.grid_rows].permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, width * per_kv, dim)
        prompt_scores = torch.matmul(query_grid, prompt_keys.transpose(-1, -2)).view(
            groups, kv_heads, width, per_kv, prompt
        )
        prompt_scores = prompt_scores[shared.row_group, :, shared.row_slot] + prompt_bias[:, None, None, :]
        scores = torch.cat(
            [prompt_scores, *self._own_scores(q, cached, bias, key)], dim=-1
        )  # (B, Hkv, G, P + span + 1)
        probs = torch.softmax(scores, dim=-1)
        prob_grid = (
            probs[..., :prompt][shared.grid_rows]
            .permute(0, 2, 1, 3, 4)
            .reshape(groups, kv_heads, width * per_kv, prompt)
        )
        attn = torch.matmul(prob_grid, prompt_values)
        attn = attn.view(groups, kv_heads, width, per_kv, dim)[
            shared.row_group, :, shared.row_slot
        ]  # (B, Hkv, G, D)
        return (attn + self._own_output(probs, cached, value)).to(dtype)


def _float32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """`tensors` in float32 (the same tensors when they already are), for a decode step's attention.

    Hugging Face's forward and the prefill's ``scaled_dot_product_attention`` keep scores,
    softmax and the weighted sum in float32 inside the kernel, from bfloat16 inputs. Written out
    in bfloat16, decode attention rounded every score and probability to 8 bits of mantissa: over
    5 random bfloat16 Llamas (peaked logits) its logprobs differed from a float32 forward by 0.108
    nats on average at worst per sequence, and from the bfloat16 forward the trainer runs by
    0.102; in float32, 0.103 and 0.072 (HF's bfloat16 forward itself: 0.114 from float32).
    """
    return [t.float() for t in tensors]


def _column_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight @ x (+ bias) (+ residual)``: a linear layer on the columns of `x` (in_features,
    tokens), the result (out_features, tokens).

    Why the residual stream is kept by columns: MKL splits a matmul over its threads by the rows
    of its left operand and has each thread pack the whole right one. With tokens on the left (a
    decode step's rows) each thread would pack the whole weight matrix, a large share of the
    matmuls' time; with the weights on the left, each thread reads its half of them and packs only
    the tokens. The q/k/v projection stays by token, as attention reads it.
    """
    out = torch.mm(weight, x) if residual is None else torch.addmm(residual, weight, x)
    return out if bias is None else out + bias[:, None]
