import torch

from core.tree import ancestor_mask, graft, lookup_continuation, make_tree, rerank, subtree


def test_rerank_keeps_parents_even_on_ties():
    # candidates 0, 1 at depth 1; 2 child of 0 with an equal score (log-prob 0); 3 child of 2
    scores = torch.tensor([-1.0, -2.0, -1.0, -1.5])
    parents = [-1, -1, 0, 2]
    for keep in range(1, 5):
        chosen = rerank(scores, parents, keep)
        assert len(chosen) == keep
        assert all(parents[i] == -1 or parents[i] in chosen for i in chosen)
    assert rerank(scores, parents, 2) == [0, 2]


def test_rerank_random_trees_stay_trees():
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        count = int(torch.randint(1, 30, (), generator=generator))
        parents, scores = [], []
        for i in range(count):
            parent = int(torch.randint(-1, i, (), generator=generator)) if i else -1
            step = -float(torch.rand((), generator=generator)) * float(torch.randint(0, 2, (), generator=generator))
            parents.append(parent)
            scores.append((scores[parent] if parent >= 0 else 0.0) + step)
        keep = int(torch.randint(1, count + 1, (), generator=generator))
        chosen = rerank(torch.tensor(scores), parents, keep)
        tokens, new_parents = subtree(list(range(count)), parents, chosen)
        tree = make_tree(99, tokens, new_parents)
        assert tree.size == keep + 1
        mask = ancestor_mask(tree.parents)
        assert torch.equal(mask.sum(1) - 1, tree.depths)


def test_graft_shares_matching_nodes():
    tokens, parents = [5, 6, 7], [-1, -1, 0]  # root -> 5 -> 7, root -> 6
    new_tokens, new_parents = graft(tokens, parents, [5, 7, 8, 9])
    assert new_tokens == [5, 6, 7, 8, 9] and new_parents == [-1, -1, 0, 2, 3]
    assert graft(tokens, parents, []) == (tokens, parents)
    assert graft(tokens, parents, [4]) == ([5, 6, 7, 4], [-1, -1, 0, -1])


def test_lookup_takes_the_latest_longest_match():
    context = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 0, 2, 3]
    assert lookup_continuation(context, 3) == [5, 6, 0]  # "2 3" last seen before "5 6 0"
    assert lookup_continuation([1, 2, 3, 1, 2], 2) == [3, 1]
    assert lookup_continuation([1, 2, 3], 4) == []


def test_the_context_index_looks_up_what_a_scan_of_the_conversation_finds():
    """The fixed tree's copied continuation, from the bigrams' kept positions
    (a scan of the whole conversation at every step took tens of ms in long chats)."""
    import random

    from core.lookup import ContextIndex

    for seed in range(200):
        rng = random.Random(seed)
        context = [rng.randrange(1 + seed % 6) for _ in range(rng.randrange(0, 80))]
        index = ContextIndex()
        index.extend(context)
        for count in (1, 3, 8):
            assert index.continuation(count) == lookup_continuation(context, count), (seed, count)
