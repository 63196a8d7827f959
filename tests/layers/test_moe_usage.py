"""ExpertUsage (the routed-token counts placement reads) against torch.bincount, over
steps of different sizes, with and without device-served assignments."""

import torch

from kt_cli.layers.moe import ExpertUsage


def test_counts_match_bincount_over_steps():
    usage, g = ExpertUsage(16), torch.Generator().manual_seed(0)
    seen, hits = [], 0
    for tokens in (1, 7, 3, 40, 1):
        ids = torch.randint(0, 16, (tokens, 4), generator=g)
        on = torch.rand(tokens, 4, generator=g) < 0.3 if tokens % 2 else None
        usage.count(ids, on)
        seen.append(ids.flatten())
        hits += 0 if on is None else int(on.sum())
    assert torch.equal(usage.routed, torch.bincount(torch.cat(seen), minlength=16))
    assert usage.assignments == sum(t.numel() for t in seen) and usage.device_hits == hits
    usage.reset()
    assert int(usage.routed.sum()) == 0 and usage.assignments == usage.device_hits == 0
