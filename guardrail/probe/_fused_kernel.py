"""The Triton programs of ``guardrail.probe.fused_stats`` (imported only where Triton is)."""

# mypy: ignore-errors

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["span_stats", "span_stats_layers"]


# The per-step arguments (sizes, offsets, views into the step's tensors) are not specialised on
# value or alignment: one compiled program serves every step, none compiles mid-serving.
PER_STEP = ("out", "query", "token_rows", "lengths", "slots", "instruction", "data")


@triton.jit
def _row_head_stats(
    where_out,  # the 5 stats of this (row, head)
    q,  # [block_dim] float32: the head's query at the row's last prompt token
    keys,  # the layer's [blocks, block size, kv heads, dim] keys, any strides
    k_block_stride,
    k_offset_stride,
    k_head_stride,
    k_dim_stride,
    kv_head,
    n,  # prompt tokens of the row
    row_slots,  # the row's KV slot of each prompt position
    row_instruction,  # the row's instruction mask
    row_data,  # the row's data mask
    scale,
    softcap,
    block_size: tl.constexpr,
    dim: tl.constexpr,
    block_dim: tl.constexpr,
    block_tokens: tl.constexpr,
    use_softcap: tl.constexpr,
    eps: tl.constexpr,
):
    """One (row, head): an online softmax over the row's keys, read through the paged cache."""
    d = tl.arange(0, block_dim)
    on_dim = d < dim
    running_max = float("-inf")
    total = 0.0
    on_instruction = 0.0
    on_data = 0.0
    data_moment = 0.0  # sum over data of e_i * (l_i - running_max)
    data_max = float("-inf")
    data_count = 0.0
    sink = 0.0
    for start in range(0, n, block_tokens):
        t = start + tl.arange(0, block_tokens)
        inside = t < n
        slot = tl.load(row_slots + t, mask=inside, other=0)
        block = slot // block_size
        offset = slot % block_size
        where = (
            keys
            + block[:, None] * k_block_stride
            + offset[:, None] * k_offset_stride
            + kv_head * k_head_stride
            + d[None, :] * k_dim_stride
        )
        k = tl.load(where, mask=inside[:, None] & on_dim[None, :], other=0.0)
        logit = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        if use_softcap:  # softcap * tanh(logit / softcap), tanh through exp
            x = logit / softcap
            e2 = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e2) / (1.0 + e2)
            logit = softcap * tl.where(x < 0, -th, th)
        sink += tl.sum(tl.where(t == 0, logit, 0.0))
        logit = tl.where(inside, logit, float("-inf"))
        is_instruction = tl.load(row_instruction + t, mask=inside, other=0) != 0
        is_data = tl.load(row_data + t, mask=inside, other=0) != 0
        new_max = tl.maximum(running_max, tl.max(logit, axis=0))
        alpha = tl.exp(running_max - new_max)
        e = tl.exp(logit - new_max)
        shift = tl.where(on_data > 0, on_data * (running_max - new_max), 0.0)
        data_moment = alpha * (data_moment + shift)
        data_moment += tl.sum(tl.where(is_data, e * (logit - new_max), 0.0))
        total = total * alpha + tl.sum(e)
        on_instruction = on_instruction * alpha + tl.sum(tl.where(is_instruction, e, 0.0))
        on_data = on_data * alpha + tl.sum(tl.where(is_data, e, 0.0))
        data_max = tl.maximum(data_max, tl.max(tl.where(is_data, logit, float("-inf"))))
        data_count += tl.sum(is_data.to(tl.float32))
        running_max = new_max
    c = on_data + eps * total
    entropy = (on_data * tl.log(c) - data_moment) / c
    entropy = entropy / tl.log(tl.maximum(data_count, 2.0))
    largest = tl.where(data_count > 0, tl.exp(data_max - running_max) / total, 0.0)
    tl.store(where_out + 0, on_instruction / total)
    tl.store(where_out + 1, on_data / total)
    tl.store(where_out + 2, tl.exp(sink - running_max) / total)
    tl.store(where_out + 3, largest)
    tl.store(where_out + 4, entropy)


@triton.jit(
    do_not_specialize=["row_stride", "mask_stride", "column"],
    do_not_specialize_on_alignment=list(PER_STEP),
)
def span_stats(
    out,  # [rows, columns, 5] float32, contiguous
    query,  # [tokens, query heads, dim]
    q_token_stride,
    q_head_stride,
    keys,  # [blocks, block size, kv heads, dim], any strides
    k_block_stride,
    k_offset_stride,
    k_head_stride,
    k_dim_stride,
    token_rows,  # [rows] the row's last prompt token in the step's batch
    lengths,  # [rows] prompt tokens of the row
    slots,  # [rows, row_stride] KV slot of each prompt position
    instruction,  # [rows, mask_stride] bool
    data,  # [rows, mask_stride] bool
    heads,  # [heads] local query head
    kv_heads,  # [heads] its kv head
    row_stride,
    mask_stride,
    column,
    out_columns,
    scale,
    softcap,
    block_size: tl.constexpr,
    dim: tl.constexpr,
    block_dim: tl.constexpr,
    block_tokens: tl.constexpr,
    use_softcap: tl.constexpr,
    eps: tl.constexpr,
):
    """One layer: program (row, head) of ``heads``, into column ``column + head``."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, block_dim)
    token = tl.load(token_rows + row)
    q_head = tl.load(heads + head)
    q = tl.load(query + token * q_token_stride + q_head * q_head_stride + d, mask=d < dim)
    _row_head_stats(
        out + (row * out_columns + column + head) * 5,
        q.to(tl.float32),
        keys,
        k_block_stride,
        k_offset_stride,
        k_head_stride,
        k_dim_stride,
        tl.load(kv_heads + head),
        tl.load(lengths + row),
        slots + row * row_stride,
        instruction + row * mask_stride,
        data + row * mask_stride,
        scale,
        softcap,
        block_size,
        dim,
        block_dim,
        block_tokens,
        use_softcap,
        eps,
    )


@triton.jit(
    do_not_specialize=["row_stride", "mask_stride", "stash_layer_stride"],
    do_not_specialize_on_alignment=["out", "stash", "lengths", "slots", "instruction", "data"],
)
def span_stats_layers(
    out,  # [rows, out_columns, 5] float32, contiguous
    stash,  # [layers, rows, query heads, dim]: each layer's queries of the rows
    stash_layer_stride,
    stash_row_stride,
    q_head_stride,
    columns,  # [4, count] int64: stash layer, query head, kv head, out column of each column
    count,
    offsets,  # [layers] int64: each layer's keys, in elements from ``keys``
    keys,  # the first layer's [blocks, block size, kv heads, dim], any strides
    k_block_stride,
    k_offset_stride,
    k_head_stride,
    k_dim_stride,
    lengths,  # [rows] prompt tokens of the row
    slots,  # [rows, row_stride] KV slot of each prompt position
    instruction,  # [rows, mask_stride] bool
    data,  # [rows, mask_stride] bool
    row_stride,
    mask_stride,
    out_columns,
    scale,
    softcap,
    block_size: tl.constexpr,
    dim: tl.constexpr,
    block_dim: tl.constexpr,
    block_tokens: tl.constexpr,
    use_softcap: tl.constexpr,
    eps: tl.constexpr,
):
    """Every layer at once: program (row, column), the column's layer read from ``columns``."""
    row = tl.program_id(0)
    column = tl.program_id(1)
    layer = tl.load(columns + column)
    q_head = tl.load(columns + count + column)
    kv_head = tl.load(columns + 2 * count + column)
    out_column = tl.load(columns + 3 * count + column)
    d = tl.arange(0, block_dim)
    where_q = stash + layer * stash_layer_stride + row * stash_row_stride + q_head * q_head_stride
    q = tl.load(where_q + d, mask=d < dim)
    _row_head_stats(
        out + (row * out_columns + out_column) * 5,
        q.to(tl.float32),
        keys + tl.load(offsets + layer),
        k_block_stride,
        k_offset_stride,
        k_head_stride,
        k_dim_stride,
        kv_head,
        tl.load(lengths + row),
        slots + row * row_stride,
        instruction + row * mask_stride,
        data + row * mask_stride,
        scale,
        softcap,
        block_size,
        dim,
        block_dim,
        block_tokens,
        use_softcap,
        eps,
    )
