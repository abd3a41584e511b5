"""Pipeline stage construction: the layer split and what each stage keeps."""

from __future__ import annotations

import pytest
import torch

from shardwise.models.transformer import build_model, init_weights
from shardwise.parallel.pipeline import split_stage
from shardwise.parallel.stages import stage_layers
from tests.helpers import TINY_MODEL


@pytest.mark.parametrize("n_layers,n_stages,want", [
    (6, 2, [[0, 1, 2], [3, 4, 5]]), (7, 3, [[0, 1, 2], [3, 4], [5, 6]]), (2, 2, [[0], [1]]),
])
def test_stage_layers(n_layers: int, n_stages: int, want: list[list[int]]):
    assert stage_layers(n_layers, n_stages) == want


def test_stages_keep_their_modules_and_names():
    model = build_model(TINY_MODEL)  # 2 layers on meta
    first, last = split_stage(model, 0, 2), split_stage(model, 1, 2)
    assert first.tok_embeddings is not None and first.norm is None and first.output is None
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    assert list(first.layers) == ["0"] and list(last.layers) == ["1"]
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}  # full-model names, nothing lost


def test_stages_chained_equal_the_whole_model():
    whole = build_model(TINY_MODEL)
    whole.to_empty(device="cpu")
    init_weights(whole, 5)
    stages = []
    for i in range(2):
        s = split_stage(build_model(TINY_MODEL), i, 2)
        s.to_empty(device="cpu")
        init_weights(s, 5)  # seeded by parameter name: the same weights as the whole model's
        stages.append(s)
    tokens = torch.randint(0, TINY_MODEL.vocab_size, (2, 12))
    torch.testing.assert_close(stages[1](stages[0](tokens)), whole(tokens))
