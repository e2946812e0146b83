"""The one top-k (model/head.py): its tie rule, and every caller (forward.top_k, the batch engine's
LocalTopK, the embed server's /v1/logits helpers) giving the same ids and log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest

from larql_edge.model import ops
from larql_edge.model.batch import LocalTopK
from larql_edge.model.forward import top_k
from larql_edge.model.head import top_k_ids, top_k_logprobs


@pytest.mark.parametrize("n,k", [(10, 3), (4096, 7), (262_144, 5), (262_144, 40)])
def test_ties_go_to_the_lower_id(n, k):
    """Many values equal to the k-th (in the fast path's blocks too): the lower ids win, as a stable sort."""
    rng = np.random.default_rng(n + k)
    row = np.round(rng.standard_normal(n).astype(np.float32), 1)  # heavy ties everywhere
    row[rng.integers(0, n, 3 * k)] = row.max()  # and ties among the very largest
    want = np.argsort(-row, kind="stable")[:k]
    np.testing.assert_array_equal(top_k_ids(row, k), want)


def test_all_equal_row():
    row = np.zeros(262_144, np.float32)
    np.testing.assert_array_equal(top_k_ids(row, 4), [0, 1, 2, 3])


def test_every_caller_gives_the_same_top_k():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((2, 5000)).astype(np.float32) * 5
    ids, lps = top_k_logprobs(logits[0], 6)
    want_lp = ops.log_softmax(logits[0])[ids]
    np.testing.assert_allclose(lps, want_lp, atol=1e-5)
    assert [i for i, _ in top_k(logits[0], 6)] == ids.tolist()

    class Head:
        def logits(self, h):
            return logits

    rows = LocalTopK(Head()).top_k_rows(np.zeros((2, 4), np.float32), 6)
    assert rows[0][0].tolist() == ids.tolist() and np.allclose(rows[0][1], lps)
    assert rows[1][0].tolist() == top_k_ids(logits[1], 6).tolist()


def test_in_place_softcap_and_log_normaliser_equal_the_plain_arithmetic():
    """LocalHead.logits's softcap (in place, row by row) and log_normaliser (a reused buffer) are bit for
    bit ops.softcap over the product and the two-temporary formula."""
    from types import SimpleNamespace

    from larql_edge.model.backend import NumpyBackend
    from larql_edge.model.head import LocalHead, log_normaliser

    rng = np.random.default_rng(5)
    head = object.__new__(LocalHead)
    head.spec = SimpleNamespace(rms_norm_eps=1e-6, family=SimpleNamespace(norm_offset=1.0), final_logit_softcapping=30.0)
    head.norm = rng.standard_normal(64).astype(np.float32)
    head.backend = NumpyBackend()
    head.weight = (rng.standard_normal((70001, 64)) * 3).astype(np.float32)
    h = rng.standard_normal((3, 64)).astype(np.float32) * 4
    want = ops.softcap(head.backend.linear(ops.rms_norm(h, head.norm, 1e-6, 1.0), head.weight), 30.0)
    got = head.logits(h)
    np.testing.assert_array_equal(got, want)
    for row in list(got) + [got[0, :5], got[1].astype(np.float64)]:
        m = float(row.max())
        assert log_normaliser(row) == m + float(np.log(np.sum(np.exp(row - type(row[0])(m)), dtype=np.float64)))
