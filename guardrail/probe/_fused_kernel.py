"""The Triton program of ``guardrail.probe.fused_stats`` (imported only where Triton is)."""

# mypy: ignore-errors

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["span_stats"]


# The per-step arguments (sizes, offsets, views into the step's tensors) are not specialised on
# value or alignment: one compiled program serves every step, none compiles mid-serving.
PER_STEP = ("out", "query", "token_rows", "lengths", "slots", "instruction", "data")


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
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, block_dim)
    on_dim = d < dim
    token = tl.load(token_rows + row)
    q_head = tl.load(heads + head)
    kv_head = tl.load(kv_heads + head)
    n = tl.load(lengths + row)
    q = tl.load(query + token * q_token_stride + q_head * q_head_stride + d, mask=on_dim)
    q = q.to(tl.float32)
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
        slot = tl.load(slots + row * row_stride + t, mask=inside, other=0)
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
        is_instruction = tl.load(instruction + row * mask_stride + t, mask=inside, other=0) != 0
        is_data = tl.load(data + row * mask_stride + t, mask=inside, other=0) != 0
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
    base = out + (row * out_columns + column + head) * 5
    tl.store(base + 0, on_instruction / total)
    tl.store(base + 1, on_data / total)
    tl.store(base + 2, tl.exp(sink - running_max) / total)
    tl.store(base + 3, largest)
    tl.store(base + 4, entropy)
