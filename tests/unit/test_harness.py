"""The lm-eval adapter's batching (shardwise/infer/harness.py): requests scored many per forward,
longest first and right-padded, give the scores and greedy flags of one request per forward --
continuations after contexts of many lengths, and whole texts longer than the model's context
(several windows each)."""

from __future__ import annotations

import random
from pathlib import Path

from shardwise.infer.generate import load_for_generation
from tests.helpers import require, tiny_qwen3


def test_batched_requests_score_as_one_request_per_forward(tmp_path: Path):
    require("lm_eval")
    from lm_eval.api.instance import Instance

    from shardwise.infer.harness import _adapter

    loaded = load_for_generation(hf=str(tiny_qwen3(tmp_path)), device="cpu", dtype="fp32")
    words = "and the earth was without form and void and darkness was upon the face of the deep".split()
    rng = random.Random(0)
    pairs = [Instance("loglikelihood", {}, (" ".join(rng.choices(words, k=rng.randint(0, 40))),
                                            " " + " ".join(rng.choices(words, k=rng.randint(1, 6)))), i)
             for i in range(40)]
    pairs.append(Instance("loglikelihood", {}, ("In the beginning ", "God"), 40))  # (trailing space)
    # the tiny model's context is 256 tokens: texts of 300-700 words take several windows each
    texts = [Instance("loglikelihood_rolling", {}, (" ".join(rng.choices(words, k=n)),), i)
             for i, n in enumerate([5, 300, 700, 40])]
    one, many = _adapter(loaded, batch_size=1), _adapter(loaded, batch_size=7)
    a, b = one.loglikelihood(pairs), many.loglikelihood(pairs)
    assert [g for _, g in a] == [g for _, g in b]
    assert max(abs(x - y) / max(1.0, abs(x)) for (x, _), (y, _) in zip(a, b, strict=True)) < 1e-5
    assert len({x for x, _ in a}) > 30  # (the requests differ: a check that compares something)
    ra, rb = one.loglikelihood_rolling(texts), many.loglikelihood_rolling(texts)
    assert max(abs(x - y) / abs(x) for x, y in zip(ra, rb, strict=True)) < 1e-5
