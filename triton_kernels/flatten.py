"""Fused flatten/unflatten: copy many tensors into (or out of) one flat buffer in ONE launch.

Where zero-ref needs it: the model's parameters become views of the engine's flat buffers and
their gradients views of its gradient buckets, so no step copies between them. What is left is
copying (and casting) every parameter into its group's flat buffer when the engine is built, and
again when stages 0-2 repack their buckets after the first backward: `flatten_`, one launch per
group where torch needs one copy kernel per tensor (hundreds for a transformer). `unflatten_` is
its inverse, for code that keeps tensors apart (a flat buffer scattered back into a model's
tensors); the engine itself does not call it.

How: an offset table. The work is cut into blocks of at most ``BLOCK`` elements, never crossing
a tensor boundary, and the host writes one row per block into a small int64 device tensor::

    [byte address of the block's first element, its index in flat, element count, dtype kind]

Program ``i`` reads row ``i``, turns the address into a typed pointer (``int -> pointer`` cast),
and copies its elements, converting through fp32 with the exact rounding of ``common``. Because
the dtype kind is a runtime value, tensors of mixed dtypes share the launch (the program branches
on it). We chose this over concatenating the tensors first (one more full copy) and over a grid
of (tensor, block) pairs (idle programs whenever sizes differ, which they do: embeddings next to
biases). Building a table costs O(#blocks) host work and one small host-to-device copy; tables
are cached by the addresses, sizes, dtypes and offsets they describe, so copying the same tensors
again builds no new table.

The raw addresses are why interpreted kernels need CPU tensors (the interpreter reads process
memory) and compiled ones CUDA tensors (device memory); ``common.check_device`` enforces it.
"""

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from . import reference
from .common import (check_device, device_context, dtype_kind, is_interpreted, kernel_view,
                     load_fp32, pick_block, store_fp32)

_ROW = 4  # int64 columns per table row: address, flat index, count, kind
_TABLE_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_TABLE_CACHE_SIZE = 64


@triton.jit
def _copy_blocks_kernel(table_ptr, flat_ptr, FLAT_KIND: tl.constexpr, TO_FLAT: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Copy one table row's block between a tensor and ``flat`` (direction: ``TO_FLAT``).

    Each branch turns the row's address into a pointer of the right element type and calls the
    shared load/store helpers with that kind as a compile-time constant, so the element
    conversion inside each branch is the same code the AdamW kernel uses.
    """
    row = table_ptr + tl.program_id(0).to(tl.int64) * 4
    addr = tl.load(row)
    flat_start = tl.load(row + 1)
    count = tl.load(row + 2)
    kind = tl.load(row + 3)
    idx = tl.arange(0, BLOCK)
    mask = idx < count
    flat_offs = flat_start + idx
    if TO_FLAT:
        if kind == 1:
            x = load_fp32(addr.to(tl.pointer_type(tl.int16)), idx, mask, 1)
        elif kind == 2:
            x = load_fp32(addr.to(tl.pointer_type(tl.float16)), idx, mask, 2)
        else:
            x = load_fp32(addr.to(tl.pointer_type(tl.float32)), idx, mask, 0)
        store_fp32(flat_ptr, flat_offs, x, mask, FLAT_KIND)
    else:
        x = load_fp32(flat_ptr, flat_offs, mask, FLAT_KIND)
        if kind == 1:
            store_fp32(addr.to(tl.pointer_type(tl.int16)), idx, x, mask, 1)
        elif kind == 2:
            store_fp32(addr.to(tl.pointer_type(tl.float16)), idx, x, mask, 2)
        else:
            store_fp32(addr.to(tl.pointer_type(tl.float32)), idx, x, mask, 0)


def _build_table(addrs, numels, itemsizes, kinds, offsets, block: int,
                 device: torch.device) -> torch.Tensor:
    """Cut each tensor into blocks and return the ``[num_blocks, 4]`` int64 table on ``device``.

    Vectorised with torch on the host, so a model with thousands of tensors and a large number
    of blocks costs a few small tensor operations, not a Python loop over blocks.
    """
    numels = torch.tensor(numels, dtype=torch.int64)
    blocks = (numels + block - 1) // block
    owner = torch.repeat_interleave(torch.arange(len(numels)), blocks)
    first_block = torch.cumsum(blocks, 0) - blocks
    start = (torch.arange(int(blocks.sum())) - first_block[owner]) * block
    addr = torch.tensor(addrs, dtype=torch.int64)[owner]
    addr += start * torch.tensor(itemsizes, dtype=torch.int64)[owner]
    flat_start = torch.tensor(offsets, dtype=torch.int64)[owner] + start
    count = torch.clamp(numels[owner] - start, max=block)
    kind = torch.tensor(kinds, dtype=torch.int64)[owner]
    table = torch.stack([addr, flat_start, count, kind], dim=1).contiguous()
    return table.to(device)


def _table_for(tensors, offsets, block: int, device: torch.device) -> torch.Tensor | None:
    """Return the (cached) block table for these tensors, or None when there is nothing to copy.

    Zero-element tensors are dropped. The cache key holds every number the table is made of,
    so a hit is always a correct table, even if a tensor was freed and its memory reused.
    """
    live = [(t, o, i) for i, (t, o) in enumerate(zip(tensors, offsets)) if t.numel() > 0]
    if not live:
        return None
    addrs = [t.data_ptr() for t, _, _ in live]
    numels = [t.numel() for t, _, _ in live]
    itemsizes = [t.element_size() for t, _, _ in live]
    kinds = [dtype_kind(t.dtype, f"tensors[{i}]") for t, _, i in live]
    offs = [o for _, o, _ in live]
    key = (str(device), block, tuple(addrs), tuple(numels), tuple(kinds), tuple(offs))
    table = _TABLE_CACHE.get(key)
    if table is None:
        table = _build_table(addrs, numels, itemsizes, kinds, offs, block, device)
        _TABLE_CACHE[key] = table
        if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    else:
        _TABLE_CACHE.move_to_end(key)
    return table


def _launch(tensors, flat, offsets, to_flat: bool) -> None:
    """Validate, build or fetch the table, and launch the copy kernel once."""
    tensors = list(tensors)
    offsets = reference.check_flatten_args(tensors, flat, offsets)
    interpreted = is_interpreted(_copy_blocks_kernel)
    check_device(flat, "flat", interpreted)
    flat_kind = dtype_kind(flat.dtype, "flat")
    largest = max((t.numel() for t in tensors), default=0)
    block, warps = pick_block("flatten", largest, interpreted)
    table = _table_for(tensors, offsets, block, flat.device)
    if table is None:
        return
    if table.is_cuda:  # a cached table may serve launches on several streams
        table.record_stream(torch.cuda.current_stream(table.device))
    with device_context(flat):
        _copy_blocks_kernel[(table.shape[0],)](
            table, kernel_view(flat), FLAT_KIND=flat_kind, TO_FLAT=to_flat, BLOCK=block,
            num_warps=warps,
        )


def flatten_(tensors, flat, offsets) -> None:
    """Copy each tensor into ``flat[offsets[i] : offsets[i] + numel]``, casting to flat's dtype.

    Same contract as ``reference.flatten_``; tensors may mix fp32, bf16 and fp16. One launch.
    """
    _launch(tensors, flat, offsets, to_flat=True)


def unflatten_(flat, tensors, offsets) -> None:
    """Copy ``flat[offsets[i] : offsets[i] + numel]`` into each tensor, casting to its dtype.

    Same contract as ``reference.unflatten_``. One launch.
    """
    _launch(tensors, flat, offsets, to_flat=False)
