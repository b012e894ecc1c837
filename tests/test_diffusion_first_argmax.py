"""first_argmax (the greedy sampler's CPU argmax) returns torch.argmax's indices: ties to the first, NaN first."""
from __future__ import annotations

import pytest
import torch

from tandem.engine.diffusion.unmasking import first_argmax, sample_tokens


@pytest.mark.parametrize("vocab", [32768, 1000, 256, 7])
@pytest.mark.parametrize("kind", ["randn", "ties", "nan", "neg_inf"])
def test_first_argmax_equals_argmax(vocab: int, kind: str) -> None:
    g = torch.Generator().manual_seed(vocab)
    for rows in (0, 1, 5, 33):
        x = torch.randn(rows, vocab, generator=g)
        if kind == "ties":                                   # many equal maxima in a row: the first wins
            x = torch.randint(0, 3, (rows, vocab), generator=g).float()
        elif kind == "nan" and rows:
            x[0, vocab // 2] = float("nan")
            x[-1, 3 % vocab] = x[-1, vocab - 1] = float("nan")
        elif kind == "neg_inf":
            x[:] = float("-inf")
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))


def test_greedy_sample_tokens_takes_first_argmax() -> None:
    x = torch.zeros(2, 512)
    x[0, [300, 7]] = 5.0
    x[1, 511] = 1.0
    tokens, conf = sample_tokens(x)
    assert tokens.tolist() == [7, 511]
    assert torch.equal(conf, torch.softmax(x, dim=-1).gather(-1, tokens[:, None])[:, 0])
