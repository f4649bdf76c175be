"""DDTree (Diffusion Draft Tree): verify a tree of drafts in one target forward (docs/dflash.md §5).

One DFlash forward gives per-position distributions q_1..q_L for the L = block_size - 1 positions after the
block's first token (the "root", already committed). A draft tree holds token paths y_1..y_d (d <= L) scored
by the factorised surrogate prod_i q_i(y_i). Every factor is <= 1, so a path never outscores its prefix:
the B best paths form a prefix-closed tree, and a best-first search finds them lazily. Its frontier holds,
for every node already taken, its next-ranked sibling and its best child; popping in score order yields
nodes in non-increasing score. The tree is verified in ONE target forward over [root, node_1 .. node_B]:

    positions   root at ``start``, a node at ``start + depth``
    attention   each entry sees the whole committed prefix (the cache) and its own ancestors, itself included
    acceptance  from the root, follow the child whose token equals the target's choice at the current entry
                (argmax, or a sample at temperature T); the target's choice where no child matches is the
                next committed token

At temperature 0 every committed token is the target's greedy choice (lossless). At T > 0 the target's
token at each entry is drawn from its own distribution there, independently of the tree (the rule of the
released DDTree code, github.com/liranringel/ddtree): each committed token is a target sample given its
prefix, so the output is distributed exactly as the target's sampling.

After acceptance the target's KV cache holds the prefix and all tree entries; `keep_path` moves the
accepted entries' K/V to consecutive slots and crops the rest, using transformers' own `DynamicCache`
(``crop`` and its per-layer ``keys`` / ``values``; transformers has no call that gathers sequence rows).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """A prefix-closed draft tree; entry 0 is the root (the committed token), entries 1..n are drafts.

    Attributes:
        tokens: token of each entry (tokens[0] = root).
        parents: parent entry of each entry (parents[0] = -1); a parent always precedes its children.
        depths: depth of each entry (root 0).
        scores: log prod q of each entry's path (root 0.0).
        children: per entry, {token: child entry}.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]
    children: list[dict[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, entry: int) -> list[int]:
        """Entries from the root to ``entry`` (both included)."""
        out = []
        while entry >= 0:
            out.append(entry)
            entry = self.parents[entry]
        return out[::-1]


def build_tree(log_q: torch.Tensor, root: int, budget: int, top_k: int | None = None) -> DraftTree:
    """The ``budget`` best-scoring draft paths as a tree, best-first.

    Args:
        log_q: [L, V] log-probabilities of the drafter at the L positions after the root.
        root: the committed token the block starts with.
        budget: draft entries (the root is not counted); fewer if the tree cannot grow (L * top_k bound).
        top_k: candidates per position (default: min(budget, V)); 1 gives the greedy chain.

    Returns:
        The tree (entries in the order they were found, so scores are non-increasing after the root).

    Raises:
        ValueError: budget < 0 or top_k < 1.
    """
    if budget < 0:
        raise ValueError(f"tree budget must be >= 0, got {budget}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    depth_limit, vocab = int(log_q.shape[0]), int(log_q.shape[-1])
    k = min(top_k or budget, budget, vocab)
    tree = DraftTree([root], [-1], [0], [0.0], [{}])
    if budget == 0 or depth_limit == 0:
        return tree
    top_lp, top_ids = (t.tolist() for t in torch.topk(log_q.float(), k, dim=-1))  # only k per row leave the device
    # Frontier entries: (-score, tie-break counter, parent entry, depth, rank at that depth).
    frontier = [(-top_lp[0][0], 0, 0, 1, 0)]
    counter = 1
    while frontier and len(tree) - 1 < budget:
        neg, _, parent, depth, rank = heapq.heappop(frontier)
        score = -neg
        entry = len(tree)
        tok = top_ids[depth - 1][rank]
        tree.tokens.append(tok)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(score)
        tree.children.append({})
        tree.children[parent][tok] = entry
        if rank + 1 < k:  # next sibling: same parent, next-ranked token at this depth
            sib = score - top_lp[depth - 1][rank] + top_lp[depth - 1][rank + 1]
            heapq.heappush(frontier, (-sib, counter, parent, depth, rank + 1))
            counter += 1
        if depth < depth_limit:  # best child
            heapq.heappush(frontier, (-(score + top_lp[depth][0]), counter, entry, depth + 1, 0))
            counter += 1
    return tree


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[n, n] bool: entry i may attend to entry j iff j is i or one of its ancestors."""
    n = len(tree)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        p = tree.parents[i]
        if p >= 0:
            mask[i] = mask[p]  # parents precede children, so the parent's row is complete
        mask[i, i] = True
    return mask


def verify_inputs(
    tree: DraftTree, start: int, past_len: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, positions and attention mask of the one target forward that verifies ``tree``.

    Args:
        tree: the draft tree (root = the token at ``start``).
        start: position of the root.
        past_len: entries in the target's cache before the tree (the committed prefix, == start).
        device: where to build them.
        dtype: the target's compute dtype (of the mask).

    Returns:
        ids [1, n], position_ids [1, n], attention mask [1, 1, n, past_len + n]: additive, 0 where an entry
        may attend and the dtype's minimum elsewhere. Additive, not bool: transformers hands a 4-D mask to the
        attention function as given, and its eager attention adds it to the scores (a bool would add 1).
    """
    n = len(tree)
    ids = torch.tensor([tree.tokens], dtype=torch.long, device=device)
    pos = torch.tensor([tree.depths], dtype=torch.long, device=device) + start
    allowed = torch.cat([torch.ones(n, past_len, dtype=torch.bool), ancestor_mask(tree)], dim=1).to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return ids, pos, mask[None, None]


def walk(tree: DraftTree, choice: list[int]) -> tuple[list[int], int]:
    """Follow the target's choices down the tree.

    Args:
        tree: the verified tree.
        choice: the target's token after each entry (choice[i] for entry i).

    Returns:
        (accepted entries, root first; the next committed token).
    """
    accepted = [0]
    nxt = choice[0]
    while nxt in tree.children[accepted[-1]]:
        accepted.append(tree.children[accepted[-1]][nxt])
        nxt = choice[accepted[-1]]
    return accepted, nxt


def keep_path(cache, past_len: int, entries: list[int]) -> None:
    """Keep the prefix and the accepted ``entries`` of a verified tree in ``cache``, in path order.

    Entry ``entries[j]`` sat at cache slot ``past_len + entries[j]``; it moves to ``past_len + j`` (its
    position, past_len + depth, was applied by RoPE in the forward, and depth == j along a path). Then the
    cache is cropped to ``past_len + len(entries)``.

    Raises:
        TypeError: a cache without per-layer ``keys`` / ``values`` (transformers < 4.56 layout).
    """
    layers = getattr(cache, "layers", None)
    if layers is None or any(not hasattr(layer, "keys") for layer in layers):
        raise TypeError(
            f"{type(cache).__name__} has no per-layer keys/values: tree verification needs a transformers "
            ">= 4.56 DynamicCache"
        )
    m = len(entries)
    if entries != list(range(m)):  # a prefix of the tree in order is already in place
        for layer in layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            src = torch.tensor(entries, dtype=torch.long, device=layer.keys.device) + past_len
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[..., past_len : past_len + m, :] = t.index_select(-2, src)
    extra = int(cache.get_seq_length()) - (past_len + m)
    if extra > 0:
        cache.crop(-extra)  # the negative form means the same in transformers 4.57 and 5.x
