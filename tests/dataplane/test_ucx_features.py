"""This process's UCX context (a client's; the daemon builds its own through
the same ``rpcbuf.dataplane.ucx``) has tagged messages, wakeup and streams on, and
nothing a peer could use to reach its memory."""

from __future__ import annotations

import pytest

from rpcbuf.dataplane import ucx


def test_context_has_only_what_rpcbuf_uses() -> None:
    assert sorted(ucx.features()) == sorted(ucx.FEATURES)


def test_a_context_with_rma_is_refused() -> None:
    import ucxx._lib.libucxx as ucx_api

    ucx.ucxx()
    risky = ucx_api.UCXContext({}, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.RMA))
    with pytest.raises(ucx.UnsafeContext, match="RMA"):
        ucx.check_features(risky)


def test_tcp_put_is_off_whatever_the_environment_says() -> None:
    env = {"UCX_TCP_PUT_ENABLE": "y"}
    ucx.apply_defaults(env, cuda=False)
    assert env["UCX_TCP_PUT_ENABLE"] == "n"
