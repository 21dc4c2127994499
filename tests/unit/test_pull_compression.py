"""Compressed pull without sockets: the server's PullEncoder and the worker's PullDecoder
(kvps/ps/compression.py) in both of their modes, with the error-feedback bounds of each codec."""

import numpy as np
import pytest

from kvps.errors import ProtocolError
from kvps.ps import compression
from kvps.ps.compression import PullDecoder, PullEncoder

CODECS = [{"type": "2bit", "threshold": 0.5}, {"type": "1bit", "threshold": 0.0}, {"type": "fp16"},
          {"type": "bf16"}, {"type": "topk", "ratio": 0.25}]
ids = [c["type"] for c in CODECS]


def _through(enc, dec, worker, slot, value, codec, delta, version):
    """What the worker ends with for one pull: the encoder's array, then the decoder."""
    sent = enc.encode(worker, slot, value, codec, delta, version)
    if sent.dtype == np.float32:                       # sent as it is
        if delta:
            dec.received(slot[0], slot[1], sent.reshape(-1))
        return sent.reshape(-1).copy()
    return dec.values(slot[0], slot[1], sent, value.size, codec, delta, "test").copy()


def test_check_keeps_pull_apart_from_the_wire_codec():
    spec = compression.check({"type": "2bit", "threshold": 0.25, "pull": True})
    assert spec == {"type": "2bit", "threshold": 0.25, "pull": True}
    assert compression.wire(spec) == compression.pulls(spec) == {"type": "2bit", "threshold": 0.25}
    assert compression.pulls(compression.check({"type": "fp16"})) is None
    with pytest.raises(ValueError, match="pull='yes' must be True or False"):
        compression.check({"type": "fp16", "pull": "yes"})


@pytest.mark.parametrize("codec", CODECS, ids=ids)
def test_update_mode_error_feedback_holds(codec):
    """A sync round's merged update, error-fed: what a worker received over the rounds sums to the
    true sums less the server's residual, which stays within the codec's bound."""
    rng = np.random.default_rng(1)
    enc, dec = PullEncoder(), PullDecoder()
    n, rounds = 1001, 40
    truth, got = np.zeros(n), np.zeros(n)
    for version in range(1, rounds + 1):
        value = (rng.standard_normal(n) * 0.2).astype(np.float32)     # |value| mostly below 2bit's t
        truth += value
        got += _through(enc, dec, 0, ("w", 0), value, codec, False, version)
    residual = enc.residual(0, ("w", 0)).astype(np.float64)
    np.testing.assert_allclose(got + residual, truth, atol=1e-4)       # nothing lost, only owed
    bound = {"2bit": 0.5 + 0.8, "1bit": 1 + 0.8, "fp16": 1e-3, "bf16": 1e-2, "topk": None}[codec["type"]]
    if bound is not None:
        assert np.abs(residual).max() <= bound, np.abs(residual).max()
    else:   # top-k sends the largest quarter each round: what is owed stays a few rounds' worth
        assert np.abs(truth - got).max() < 0.2 * 8


def test_update_mode_sends_the_init_value_as_it_is_and_a_round_once():
    enc, dec = PullEncoder(), PullDecoder()
    codec = {"type": "2bit", "threshold": 0.5}
    init = np.array([3.0, -2.0, 0.1], np.float32)
    assert enc.encode(0, ("w", 0), init, codec, False, 0) is init          # version 0: a weight
    value = np.array([0.7, -0.7, 0.2], np.float32)
    first = _through(enc, dec, 0, ("w", 0), value, codec, False, 1)
    again = _through(enc, dec, 0, ("w", 0), value, codec, False, 1)        # the same round pulled twice
    np.testing.assert_array_equal(first, [0.5, -0.5, 0])
    np.testing.assert_array_equal(again, first)
    np.testing.assert_allclose(enc.residual(0, ("w", 0)), [0.2, -0.2, 0.2], atol=1e-6)


@pytest.mark.parametrize("codec", CODECS, ids=ids)
def test_delta_mode_tracks_weights_without_drift(codec):
    """Weights (an optimizer on the server): the first pull is exact, then each pull's copy differs
    from the value by at most one compression of the change, and never drifts."""
    rng = np.random.default_rng(2)
    enc, dec = PullEncoder(), PullDecoder()
    n = 513
    value = rng.standard_normal(n).astype(np.float32)
    got = _through(enc, dec, 0, ("w", 1), value, codec, True, 0)
    np.testing.assert_array_equal(got, value)                         # first pull: as it is
    step = {"2bit": 0.5, "1bit": 1.0}.get(codec["type"], 0.05)
    worst = 0.0
    for version in range(1, 60):
        value = value - (step * 0.3 * rng.standard_normal(n)).astype(np.float32)   # an update
        got = _through(enc, dec, 0, ("w", 1), value, codec, True, version)
        worst = max(worst, float(np.abs(got - value).max()))
    # an error bounded by the codec (never growing with the number of pulls)
    assert worst < {"2bit": 1.5, "1bit": 2.0, "fp16": 1e-3, "bf16": 0.02, "topk": 0.5}[codec["type"]], worst
    if codec["type"] in ("fp16", "bf16", "topk"):
        for _ in range(12 if codec["type"] == "topk" else 2):         # the value at rest: pulls converge
            got = _through(enc, dec, 0, ("w", 1), value, codec, True, 99)
        np.testing.assert_allclose(got, value, atol=1e-6 if codec["type"] != "bf16" else 1e-4)


def test_workers_and_parts_are_apart_and_forget_starts_over():
    enc = PullEncoder()
    codec = {"type": "fp16"}
    value = np.full(4, 1.0 + 2 ** -12, np.float32)    # 1 in float16 and bfloat16: 2^-12 stays owed
    for worker in (0, 1):
        for part in (0, 1):
            enc.encode(worker, ("w", part), value, codec, False, 1)
    assert all(enc.residual(w, ("w", p)) is not None for w in (0, 1) for p in (0, 1))
    enc.forget(1)
    assert enc.residual(1, ("w", 0)) is None and enc.residual(0, ("w", 0)) is not None
    # a change of codec, or of the kind of value (an optimizer set later), starts over too
    enc.encode(0, ("w", 0), value, {"type": "bf16"}, False, 2)
    np.testing.assert_array_equal(enc.residual(0, ("w", 0)), np.full(4, 2 ** -12, np.float32))
    assert enc.encode(0, ("w", 0), value, codec, True, 3) is value


def test_a_change_without_a_copy_is_a_protocol_error():
    dec = PullDecoder()
    payload = np.zeros(4, np.float16)
    with pytest.raises(ProtocolError, match="holds no copy"):
        dec.values("w", 0, payload, 4, {"type": "fp16"}, True, "pull of 'w'")


def test_emulate_sync_takes_a_compression_spec(capsys):
    from kvps.tools.emulate.cli import sync_parser
    args = sync_parser().parse_args(["--compression", '{"type": "fp16", "pull": true}'])
    assert args.compression == {"type": "fp16", "pull": True}
    assert sync_parser().parse_args([]).compression is None
    for bad, why in (("fp16", "is not JSON"), ('{"type": "3bit"}', "unknown gradient compression type")):
        with pytest.raises(SystemExit):
            sync_parser().parse_args(["--compression", bad])
        assert why in capsys.readouterr().err
