"""Horovod's hvd.SyncBatchNorm: batch normalization over the batches of every worker, for models
whose per-worker batch is too small for statistics of its own (detection, segmentation).

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8), torch.nn.ReLU())
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)      # or swap a model's BatchNorm layers

In training each forward sums, over every worker, each channel's sum, sum of squares and count
(one allreduce of 2C+1 float64 numbers), normalizes with the mean and variance of the whole batch
and updates the running statistics with them; backward sums each channel's sum of the output
gradient and of its product with the normalized input (one allreduce of 2C), as torch's
SyncBatchNorm does. The weight and bias gradients stay this worker's, for DistributedOptimizer to
average like any other. In eval, or with one worker, it is torch's BatchNorm. Every worker must run
the same layers in the same order (each layer's allreduces are named after its place among the
SyncBatchNorm layers the process made).
"""
import itertools

import torch

from kvps.torch import horovod

_LAYERS = itertools.count()


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, name):
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        stats = torch.cat([x.sum(dims, dtype=torch.float64), x.square().sum(dims, dtype=torch.float64),
                           torch.tensor([x.numel() // channels], dtype=torch.float64)])
        horovod.allreduce_(stats, name=f"{name}/forward", op=horovod.Sum)
        count = stats[-1]
        mean = stats[:channels] / count
        var = (stats[channels:2 * channels] / count - mean * mean).clamp_(min=0)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_((momentum * mean).to(running_mean.dtype))
                unbiased = var * count / max(float(count) - 1, 1.0)
                running_var.mul_(1 - momentum).add_((momentum * unbiased).to(running_var.dtype))
        invstd = (var + eps).rsqrt()
        x_hat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        y = x_hat if weight is None else x_hat * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(x_hat, invstd.to(x.dtype), weight)
        ctx.count, ctx.name, ctx.dims, ctx.shape = float(count), name, dims, shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x_hat, invstd, weight = ctx.saved_tensors
        dims, shape, channels = ctx.dims, ctx.shape, x_hat.shape[1]
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * x_hat).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xhat]).double()
        horovod.allreduce_(both, name=f"{ctx.name}/backward", op=horovod.Sum)
        mean_dy = (both[:channels] / ctx.count).to(dy.dtype).view(shape)
        mean_dy_xhat = (both[channels:] / ctx.count).to(dy.dtype).view(shape)
        scale = invstd.view(shape) if weight is None else invstd.view(shape) * weight.view(shape)
        dx = (dy - mean_dy - x_hat * mean_dy_xhat) * scale
        dweight = None if weight is None else sum_dy_xhat
        dbias = None if weight is None else sum_dy
        return dx, dweight, dbias, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """torch's BatchNorm (any number of dimensions from 2), with the statistics of every worker's
    batch in training (Horovod's hvd.SyncBatchNorm; arguments as torch.nn.BatchNorm2d's)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.kvps_name = f"kvps.torch/syncbn/{next(_LAYERS)}"

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm takes input of at least 2 dimensions (batch, channels, ...), "
                             f"not {input.dim()}")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training or horovod.size() == 1:
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:       # a cumulative moving average, as torch's
                momentum = 1.0 / float(self.num_batches_tracked)
        tracked = self.track_running_stats
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean if tracked else None,
                                    self.running_var if tracked else None, self.eps, momentum, self.kvps_name)

    @classmethod
    def convert_sync_batchnorm(cls, module):
        """`module` with every BatchNorm layer (1d, 2d, 3d) replaced by a SyncBatchNorm holding its
        parameters and running statistics (torch.nn.SyncBatchNorm.convert_sync_batchnorm's)."""
        out = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out
