"""Gradient compression specs: what is refused, and by which kvstore."""

import pytest

from kvps.ps import compression


@pytest.mark.parametrize("spec,message", [
    ({"type": "3bit"}, "unknown gradient compression type '3bit'"),
    ({"type": "2bit", "threshold": 0}, "threshold=0 must be a finite number > 0"),
    ({"type": "topk", "ratio": 2}, "ratio=2 must lie in (0, 1]"),
    ({"type": "fp16", "threshold": 1}, "fp16 takes no parameters, not threshold"),
    ("2bit", "must be a dict"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        compression.check(spec)


def test_local_kvstore_refuses_compression():
    import kvps
    with pytest.raises(ValueError, match="needs a dist kvstore"):
        kvps.create("local").set_gradient_compression({"type": "2bit", "threshold": 0.5})
