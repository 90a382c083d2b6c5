"""The radix tree of a job's sorted prompts (their LCP intervals) and the choice of the nodes whose
prefixes become groups (grouping.py says what the choice maximises and why).

Node v covers the sorted positions lb[v]..rb[v], which share its first depth[v] blocks; node 0 is
the root (depth 0). A prompt belongs to its deepest chosen ancestor's group, or to none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PrefixTree:
    depth: list[int]  # shared prefix of the node, in blocks
    lb: list[int]
    rb: list[int]
    children: list[list[int]]
    postorder: list[int]  # children before parents; node 0 is the root (depth 0)
    parent: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, lcp: list[int], n: int) -> PrefixTree:
        """The tree of n sorted prompts from the common blocks of each pair of neighbours."""
        tree = cls([0], [0], [max(n - 1, 0)], [[]], [])
        stack = [0]
        for i in range(n):
            cur = lcp[i] if i < n - 1 else 0
            left, last = i, -1
            while cur < tree.depth[stack[-1]]:
                v = stack.pop()
                tree.rb[v] = i
                tree.postorder.append(v)
                left, last = tree.lb[v], v
                if cur <= tree.depth[stack[-1]]:
                    tree.children[stack[-1]].append(v)
                    last = -1
            if cur > tree.depth[stack[-1]]:
                stack.append(tree._add(cur, left, [last] if last >= 0 else []))
        tree.postorder.append(0)
        tree.parent = [0] * len(tree.depth)
        for v in tree.postorder:
            for c in tree.children[v]:
                tree.parent[c] = v
        return tree

    def _add(self, depth: int, lb: int, children: list[int]) -> int:
        self.depth.append(depth)
        self.lb.append(lb)
        self.rb.append(lb)
        self.children.append(children)
        return len(self.depth) - 1

    def size(self, v: int) -> int:
        return self.rb[v] - self.lb[v] + 1

    def choose(self, block_size: int, min_prefix_len: int, min_group_size: int,
               decode_weight: float) -> list[bool]:  # fmt: skip
        """The nodes whose groups maximise grouping.py's value, exactly where groups of two
        suffice (the size caps apply after). Dynamic programming over the tree, bottom up, then
        the choices top down; ties go to fewer groups."""
        lam = decode_weight
        choosable = [
            self.depth[v] * block_size >= min_prefix_len and self.size(v) >= min_group_size
            for v in range(len(self.depth))
        ]
        # chain[v]: the prefixes (tokens) a prompt under v can be grouped on: 0 (none), then
        # the choosable ancestors of v, shallowest first
        chain = [np.zeros(1)] * len(self.depth)
        for v in reversed(self.postorder):
            below = np.append(chain[v], self.depth[v] * block_size) if choosable[v] else chain[v]
            for c in self.children[v]:
                chain[c] = below
        some, take_wins = self._values(block_size, lam, choosable, chain)
        return self._choices(block_size, lam, chain, some, take_wins)

    def _values(self, bs: int, lam: float, choosable: list[bool],
                chain: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:  # fmt: skip
        """some[v][i]: the best value of v's subtree holding a chosen node (v's edge in the
        prefix trie paid), the deepest chosen ancestor being chain[v][i]; take_wins[v][i]:
        whether that best has v chosen."""
        some: list[np.ndarray] = [np.zeros(0)] * len(self.depth)
        take_wins: list[np.ndarray] = [np.zeros(0, bool)] * len(self.depth)
        for v in self.postorder[:-1]:  # the root last, and it is never a group
            depth, k = self.depth[v] * bs, len(chain[v])
            owners = np.append(chain[v], depth) if choosable[v] else chain[v]
            per_prompt = depth + lam * owners  # v in the trie: its cached prefix, then decode
            leaves = self.size(v)
            best = np.zeros(owners.size)
            gap = np.full(owners.size, np.inf)  # the least a child loses forced to hold a choice
            for c in self.children[v]:
                leaves -= self.size(c)
                kept = np.maximum(some[c], self.size(c) * per_prompt)
                best += kept
                gap = np.minimum(gap, kept - some[c])
            best += leaves * per_prompt
            edge = (self.depth[v] - self.depth[self.parent[v]]) * bs
            skip = best[:k] - gap[:k] - edge
            take = best[k] - lam * depth - edge if choosable[v] else -np.inf
            take_wins[v] = take > skip
            some[v] = np.maximum(skip, take)
        return some, take_wins

    def _choices(self, bs: int, lam: float, chain: list[np.ndarray], some: list[np.ndarray],
                 take_wins: list[np.ndarray]) -> list[bool]:  # fmt: skip
        """Top down: a node holding a choice is chosen where taking it wins, and passes its
        children the deepest chosen prefix; a child holds a choice where that is worth more than
        none, and where its unchosen parent's value counted a choice below it that no child is
        worth more with, the child that loses least by it holds it."""
        chosen = [False] * len(self.depth)
        at = [-1] * len(self.depth)  # a node holding a choice: its chain index; -1: none below
        at[0] = 0
        for v in reversed(self.postorder):
            i = at[v]
            if i < 0 or not self.children[v]:
                chosen[v] = i >= 0 and v != 0 and bool(take_wins[v][i])
                continue
            chosen[v] = v != 0 and bool(take_wins[v][i])
            j = len(chain[v]) if chosen[v] else i
            per_prompt = self.depth[v] * bs + lam * chain[self.children[v][0]][j]
            loss = {c: self.size(c) * per_prompt - some[c][j] for c in self.children[v]}
            holding = [c for c, lost in loss.items() if lost < 0]
            if not holding and v != 0 and not chosen[v]:
                holding = [min(loss, key=loss.__getitem__)]
            for c in holding:
                at[c] = j
        return chosen

    def assign(self, chosen: list[bool], original: np.ndarray) -> dict[int, list[int]]:
        """Each sorted position goes to its deepest chosen node; members in input order."""
        owner = np.full(len(original), -1, dtype=np.int64)
        for v in reversed(self.postorder):
            if chosen[v]:
                owner[self.lb[v] : self.rb[v] + 1] = v
        taken = owner >= 0
        owners, indices = owner[taken], original[taken]
        by_owner = np.lexsort((indices, owners))
        owners, indices = owners[by_owner], indices[by_owner]
        cuts = np.flatnonzero(np.diff(owners)) + 1
        return {
            int(part_owner[0]): part.tolist()
            for part_owner, part in zip(
                np.split(owners, cuts), np.split(indices, cuts), strict=True
            )
            if len(part)
        }

    def distinct_blocks(self, nodes: list[int]) -> int:
        """The blocks of these nodes' prefixes, each counted once however many share it: what
        the prefix cache computes of them on one engine."""
        seen = [False] * len(self.depth)
        seen[0] = True
        total = 0
        for v in nodes:
            while not seen[v]:
                seen[v] = True
                total += self.depth[v] - self.depth[self.parent[v]]
                v = self.parent[v]
        return total
