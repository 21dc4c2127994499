"""The gradient sets `kvps simulate` knows: tensor sizes in bytes, in forward (layer) order, and a
default compute time per step.

    tensors("resnet50")        # 161 float32 tensors, 102.2 MB (kvps/tools/bench/workloads.py's shapes)
    tensors("bert-large")      # 394 tensors, 1.34 GB (24 layers of 1024 hidden, 30522-word vocabulary)
    tensors("wide")            # the `wide` experiment workload's MLP: 104 KB
    tensors("64MB")            # one array of that many bytes
"""
import math

from kvps.errors import ConfigError

# Forward plus backward seconds of one worker's step, for scaling efficiency only (the validation
# times communication alone, as `kvps emulate sync` does). Assumptions, not measurements: a
# V100-class GPU at fp32, ResNet-50 at batch 64 (about 360 images/s) and BERT-large at sequence
# 128, batch 8 per GPU. --compute-ms overrides them.
COMPUTE_S = {"resnet50": 0.18, "bert-large": 0.30, "wide": 0.004}


def _bert_large(layers=24, hidden=1024, ffn=4096, vocab=30522, positions=512):
    emb = [vocab * hidden, positions * hidden, 2 * hidden, hidden, hidden]
    layer = [hidden * hidden, hidden, hidden * hidden, hidden, hidden * hidden, hidden,   # q, k, v
             hidden * hidden, hidden, hidden, hidden,                                    # out, layer norm
             hidden * ffn, ffn, ffn * hidden, hidden, hidden, hidden]                    # ffn, layer norm
    head = [hidden * hidden, hidden, hidden * hidden, hidden, hidden, hidden, vocab]
    return [4 * n for n in emb + layer * layers + head]


def tensors(name):
    """Tensor sizes in bytes, first layer first. Raises ConfigError for an unknown name."""
    if name == "resnet50":
        from kvps.tools.bench.workloads import resnet50_shapes
        return [4 * math.prod(s) for s in resnet50_shapes()]
    if name == "bert-large":
        return _bert_large()
    if name == "wide":
        h = 128
        return [4 * n for n in (64 * h, h, h * h, h, h * 10, 10)]
    from kvps.tools.bench.workloads import parse_size
    try:
        return [parse_size(name)]
    except ValueError:
        raise ConfigError(f"model {name!r} is not resnet50, bert-large, wide or a size like 64MB") from None


def compute_s(name):
    return COMPUTE_S.get(name, 0.0)
