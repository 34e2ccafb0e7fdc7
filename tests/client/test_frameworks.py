"""The framework forms' failures, with or without torch installed:
``check_framework`` (what load_tensors, view.tensors and attach_model call
first) refuses an unknown framework and says what to install for torch;
``host_array`` passes NumPy through untouched."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import rpcbuf
from rpcbuf.control.client.arrays import check_framework, host_array


def test_an_unknown_framework_is_a_bad_request() -> None:
    for bad in ("jax", "", "Torch", None, 3):
        with pytest.raises(rpcbuf.BadRequest, match="framework must be one of"):
            check_framework(bad)  # type: ignore[arg-type]
    check_framework("numpy")


def test_the_torch_form_without_torch_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(rpcbuf.BadRequest, match="needs PyTorch"):
        check_framework("torch")


def test_host_array_passes_numpy_through_and_views_buffers() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    got, source = host_array(a)
    assert got is a and source is None
    got, source = host_array(bytearray(b"abcd"))
    assert got.dtype == np.uint8 and got.tobytes() == b"abcd" and source is None
