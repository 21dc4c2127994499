"""Ring all-reduce's tensor fusion: how arrays are grouped into buffers."""

from kvps.collective.ring import fuse


def test_fusion_groups_by_dtype_and_threshold():
    import numpy as np
    arrays = [np.zeros(10, np.float32), np.zeros(10, np.float32), np.zeros(100, np.float32),
              np.zeros(10, np.float16), np.zeros(5, np.float16)]
    assert fuse(arrays, 120) == [[0, 1], [2], [3, 4]]
    assert fuse(arrays, 1 << 20) == [[0, 1, 2], [3, 4]]
    assert fuse(arrays, 1) == [[0], [1], [2], [3], [4]]
