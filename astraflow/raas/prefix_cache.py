"""Reuse of attention keys and values across ``generate`` calls (automatic prefix caching).

Multi-turn workflows send the engine prompts that begin with an earlier call's prompt and
completion: the blind verifier's second turn is its first turn plus ``73?``; a retry is
the first try plus the verdict and the problem again. Prefilling those prefixes again is
the largest part of such a rollout on the tiny models. ``PrefixCache`` keeps, per weight
version, the keys and values of every row an engine generated, in a token trie, and hands
back the longest stored prefix of a new prompt.

Only tokens that were fed through the model have keys and values: a row's prompt and every
generated token but its last. A stored row is usable for any prompt that shares a prefix
with it (keys at position ``t`` depend on tokens ``0..t`` only).

The cache holds whole blocks (the rows of one ``generate`` call) and drops the oldest block
first once it holds more than ``max_bytes``. The engine clears it when its weights change.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

# per layer: keys and values, each [rows, heads, tokens, head_dim]
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PrefixHit:
    """``length`` leading tokens of a prompt whose keys/values are row ``row`` of ``block``."""

    length: int
    block: int
    row: int


class _Node:
    __slots__ = ("children", "ref")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.ref: tuple[int, int] | None = None  # (block, row) of the newest row through here


class PrefixCache:
    """Keys/values of generated rows, found by the longest common token prefix."""

    def __init__(self, max_bytes: int, version: int | None = None):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.version = version  # of the weights whose keys/values it holds
        self._blocks: OrderedDict[int, tuple[list[LayerKV], list[list[int]], int]] = (
            OrderedDict())
        self._root = _Node()
        self._next = 0
        self.bytes = 0
        self.hits = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self, version: int | None = None) -> None:
        """Forget everything; what is added next belongs to weight ``version``."""
        self._blocks.clear()
        self._root = _Node()
        self.bytes = 0
        self.version = version

    def add(self, layers: list[LayerKV], rows: list[list[int]]) -> None:
        """Store a block: row ``i``'s keys/values are ``layers[l][*][i, :, :len(rows[i])]``
        for the tokens ``rows[i]``."""
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in layers)
        if size > self.max_bytes:
            return
        evicted = False
        while self._blocks and self.bytes + size > self.max_bytes:
            _, (_, _, old) = self._blocks.popitem(last=False)
            self.bytes -= old
            evicted = True
        if evicted:
            self._rebuild()
        block = self._next
        self._next += 1
        self._blocks[block] = (layers, rows, size)
        self.bytes += size
        for row, tokens in enumerate(rows):
            self._insert(tokens, (block, row))

    def lookup(self, prompt: list[int]) -> PrefixHit | None:
        """The longest stored prefix of ``prompt``, at most ``len(prompt) - 1`` tokens long
        (the last prompt token must go through the model for the next token's logits)."""
        node, best = self._root, None
        for depth, tok in enumerate(prompt[:-1], start=1):
            node = node.children.get(tok)  # type: ignore[assignment]
            if node is None:
                break
            if node.ref is not None:  # the trie is rebuilt on eviction: refs are live
                best = PrefixHit(depth, *node.ref)
        if best is not None:
            self.hits += 1
            self.tokens_reused += best.length
        return best

    def gather(self, hits: list[PrefixHit | None], width: int) -> list[LayerKV]:
        """Keys/values for a batch, right-aligned in ``width`` columns: row ``i`` holds its
        hit's ``length`` positions in its last columns (the rest, masked out by the caller,
        are copies)."""
        used = [(i, h) for i, h in enumerate(hits) if h is not None]
        device = self._blocks[used[0][1].block][0][0][0].device
        plan = []  # per block: its layers, the rows it gives, where they go, which columns
        for block in {h.block for _, h in used}:
            mine = [(i, h) for i, h in used if h.block == block]
            rows = torch.tensor([h.row for _, h in mine], device=device)
            dest = torch.tensor([i for i, _ in mine], device=device)
            # column c of row i reads source column c - (width - length), clamped at 0
            shift = torch.tensor([width - h.length for _, h in mine], device=device)
            cols = (torch.arange(width, device=device)[None, :] - shift[:, None]).clamp(min=0)
            plan.append((self._blocks[block][0], rows, dest, cols[:, None, :, None]))
        out = []
        for layer, (k0, _) in enumerate(plan[0][0]):
            k = k0.new_zeros((len(hits), k0.shape[1], width, k0.shape[3]))
            v = torch.zeros_like(k)
            for layers, rows, dest, cols in plan:
                bk, bv = layers[layer]
                idx = cols.expand(-1, bk.shape[1], -1, bk.shape[3])
                k[dest] = torch.gather(bk[rows], 2, idx)
                v[dest] = torch.gather(bv[rows], 2, idx)
            out.append((k, v))
        return out

    def _insert(self, tokens: list[int], ref: tuple[int, int]) -> None:
        node = self._root
        for tok in tokens:
            nxt = node.children.get(tok)
            if nxt is None:
                nxt = node.children[tok] = _Node()
            nxt.ref = ref
            node = nxt

    def _rebuild(self) -> None:
        self._root = _Node()
        for block, (_, rows, _) in self._blocks.items():
            for row, tokens in enumerate(rows):
                self._insert(tokens, (block, row))


__all__ = ["PrefixCache", "PrefixHit"]
