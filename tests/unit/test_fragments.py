"""Streaming DiLoCo's fragments (hsgd.hierarchical.outer.fragment_groups): consecutive
parameters, every one in exactly one fragment, of about equal size."""

import pytest

from hsgd.hierarchical.outer import fragment_groups


@pytest.mark.parametrize("numels,fragments,want", [
    ([10] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    ([1, 2, 3, 4, 5, 6], 3, [(0, 3), (3, 5), (5, 6)]),   # sizes 6, 9, 6 of 21
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),                # one large tensor is a fragment of its own
    ([1, 1, 1, 100], 2, [(0, 3), (3, 4)]),
    ([5, 5], 2, [(0, 1), (1, 2)]),
    ([7], 1, [(0, 1)]),
    ([1] * 10, 3, [(0, 3), (3, 7), (7, 10)]),
])
def test_fragments_cut_at_the_nearest_boundary(numels, fragments, want):
    assert fragment_groups(numels, fragments) == want


@pytest.mark.parametrize("fragments", [1, 2, 3, 5, 8])
def test_every_parameter_in_one_nonempty_fragment(fragments):
    numels = [64, 8, 4096, 64, 4096, 64, 640, 10]
    groups = fragment_groups(numels, fragments)
    assert len(groups) == fragments
    assert groups[0][0] == 0 and groups[-1][1] == len(numels)
    assert all(a < b for a, b in groups) and all(b == c for (_, b), (c, _) in zip(groups, groups[1:]))
