"""int8's and int4's algorithm in one process, written independently of hsgd.compression: the
simulation that the codec tests and DiLoCo's compressed outer step are checked against."""

import torch


def quantize(x, levels=127):
    scale = (x.abs().amax(dim=1) / levels).float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).to(x.dtype)
    q = torch.round(x / safe[:, None]).clamp(-levels, levels).to(torch.int8)
    return q.to(x.dtype) * scale.to(x.dtype)[:, None]


class Int8Simulation:
    """Every node's int8 sums of one part ``[lo, hi)`` of the (one) segment, with their errors;
    ``levels``: 127 (int8) or 7 (int4); values of ``dtype``."""

    def __init__(self, lay, lo, hi, block, chunk_blocks, parties, levels=127, dtype=torch.float32, tensor_blocks=True):
        self.block, self.parties, self.levels, self.dtype = block, parties, levels, dtype
        self.ranges, self.exact = [], []
        for e, ((_, off), n) in enumerate(zip(lay.places, lay.sizes)):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                (self.exact if e in lay.exact else self.ranges).append((e, a - off, b - off))
        self.starts, at = [], 0  # each range's first value in the flat blocks
        for _, a, b in self.ranges:
            self.starts.append(at)
            at += b - a
            if tensor_blocks:
                at = -(-at // block) * block
        self.blocks = -(-at // block)
        self.chunks = [(f, min(chunk_blocks, self.blocks - f)) for f in range(0, self.blocks, chunk_blocks)]
        self.errors = [torch.zeros(self.blocks, block, dtype=dtype) for _ in range(parties)]
        self.server = torch.zeros(self.blocks, block, dtype=dtype)  # every party's share, in place

    def run(self, sums):
        """``sums[i]``: node i's values per entry; returns the summed values per entry (in place)."""
        sent = []
        for i in range(self.parties):
            flat = torch.zeros(self.blocks, self.block, dtype=self.dtype)
            for (e, a, b), at in zip(self.ranges, self.starts):
                flat.view(-1)[at:at + b - a] = sums[i][e][a:b]
            flat += self.errors[i]
            sent.append(quantize(flat, self.levels))
            self.errors[i] = flat - sent[-1]
        total = torch.empty(self.blocks, self.block, dtype=self.dtype)
        for first, n in self.chunks:
            counts = [n // self.parties + (j < n % self.parties) for j in range(self.parties)]
            for j in range(self.parties):
                rows = slice(first + sum(counts[:j]), first + sum(counts[:j + 1]))
                s = self.server[rows].clone()
                for i in range(self.parties):
                    s += sent[i][rows]
                total[rows] = quantize(s, self.levels)
                self.server[rows] = s - total[rows]
        out = [t.clone() for t in sums[0]]
        for (e, a, b), at in zip(self.ranges, self.starts):
            out[e][a:b] = total.view(-1)[at:at + b - a]
        for e, a, b in self.exact:
            out[e][a:b] = sum(s[e][a:b] for s in sums)
        return out
