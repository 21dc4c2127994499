"""Experiment workload: sparse logistic regression in the style of the OSDI 2014 ad-click experiment.

    kvps launch -n 3 -s 1 -- python -m kvps.tools.experiment.workloads.sparse_lr --kvstore dist_async --dim 65536 --keys 32
    kvps launch -n 4 -s 1 -- python -m kvps.tools.experiment.workloads.sparse_lr --kvstore dist_ssp:4 --dim 1048576 --keys 64

The problem is synthetic and fixed by --seed: D features; each sample has 20 to 50 active
binary features drawn from a Zipf-like distribution (a few features in most samples, a long
tail seen rarely), mapped through a fixed random permutation so the hot ones spread over the
keys; its label is 1 when x . w* + logistic noise > 0, for a hidden sparse w* (20% of the
features matter). The weight vector is split into --keys keys of D/keys rows each.

Each step a worker takes a minibatch of its shard (every W-th sample from its rank),
row_sparse_pulls only the rows the batch touches, computes the logistic-loss gradient and
pushes just those rows of it (a row-sparse push, MXNet's row_sparse gradient; every key's
servers still hear from every worker, so every key's clock advances each step). The servers
run SGD with rescale_grad = 1/W (1/(W - B) with B backup workers); under the ring
('allreduce') the same optimizer runs on every worker on the summed gradient. Rank 0 pulls the
whole vector to evaluate test log-loss, accuracy and AUC. Only numpy, no torch. It prints JSON
lines as kvps/tools/experiment/logbook.py says.
"""
import argparse

import numpy as np

import kvps
from kvps.tools.experiment.logbook import Logbook, gradient_scale

ZIPF = 1.1               # exponent of the feature-popularity law
ACTIVE = (20, 50)        # active features per sample, uniform in this range
RELEVANT = 0.2           # share of features with a non-zero true weight
WEIGHT_SCALE = 2.0       # true weights ~ N(0, WEIGHT_SCALE^2)


class Samples:
    """Sparse binary samples in CSR form: sample i's features are ids[indptr[i]:indptr[i + 1]]."""

    def __init__(self, indptr, ids, labels):
        self.indptr, self.ids, self.labels = indptr, ids, labels

    def __len__(self):
        return len(self.labels)

    def rows(self, picks):
        """(sample index within picks, feature id) of every active feature of the picked samples."""
        start, count = self.indptr[picks], np.diff(self.indptr)[picks]
        which = np.repeat(np.arange(len(picks)), count)
        offsets = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        return which, self.ids[np.repeat(start, count) + offsets]

    def shard(self, rank, workers):
        picks = np.arange(rank, len(self), workers)
        which, ids = self.rows(picks)
        indptr = np.searchsorted(which, np.arange(len(picks) + 1))
        return Samples(indptr, ids, self.labels[picks])


def problem(dim, seed):
    """The hidden truth: (feature permutation, true weights)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(dim).astype(np.int64)
    truth = np.where(rng.random(dim) < RELEVANT, rng.normal(0.0, WEIGHT_SCALE, dim), 0.0)
    return perm, truth


def draw(n, dim, perm, truth, seed):
    rng = np.random.default_rng(seed)
    active = rng.integers(ACTIVE[0], ACTIVE[1] + 1, n)
    rows = np.repeat(np.arange(n, dtype=np.int64), active)
    ids = perm[(rng.zipf(ZIPF, active.sum()) - 1) % dim]
    pairs = np.sort(rows * dim + ids)                       # binary features: drop repeats within a sample
    pairs = pairs[np.r_[True, pairs[1:] != pairs[:-1]]]
    rows, ids = pairs // dim, pairs % dim
    indptr = np.searchsorted(rows, np.arange(n + 1))
    margin = np.add.reduceat(truth[ids], indptr[:-1]) if len(ids) else np.zeros(n)
    labels = (margin + rng.logistic(size=n) > 0).astype(np.float64)
    return Samples(indptr, ids, labels)


def unique_sorted(ids):
    ordered = np.sort(ids)
    return ordered[np.r_[True, ordered[1:] != ordered[:-1]]] if len(ordered) else ordered


def score(weights, test):
    which, ids = test.rows(np.arange(len(test)))
    margin = np.bincount(which, weights=weights[ids], minlength=len(test))
    y = test.labels
    log_loss = float(np.mean(np.logaddexp(0.0, margin) - y * margin))    # -log p(y | x), stably
    accuracy = float(np.mean((margin > 0) == (y > 0.5)))
    return log_loss, accuracy, auc(margin, y)


def auc(score, y):
    """Area under the ROC curve by ranks (ties share their mean rank)."""
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    sorted_scores = score[order]
    starts = np.r_[True, sorted_scores[1:] != sorted_scores[:-1]]
    group = np.cumsum(starts) - 1
    mean_rank = np.bincount(group, weights=ranks[order]) / np.bincount(group)
    ranks[order] = mean_rank[group]
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if not n_pos or not n_neg:
        return 0.5
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvstore", default="dist_sync")
    p.add_argument("--dim", type=int, default=1 << 16, help="features D (the full experiment: 1048576)")
    p.add_argument("--keys", type=int, default=32, help="keys the weight vector is split into; divides --dim")
    p.add_argument("--train", type=int, default=60000, help="training samples (all workers together)")
    p.add_argument("--test", type=int, default=10000)
    p.add_argument("--steps", type=int, default=1000, help="training steps of each worker (at most)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this much training time")
    p.add_argument("--batch", type=int, default=256, help="minibatch of each worker")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--eval-every", default="0.2s", help="seconds of training ('0.2s') or steps ('50')")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.dim % args.keys:
        p.error(f"--keys {args.keys} does not divide --dim {args.dim}")

    kv = kvps.create(args.kvstore)
    rank, workers = kv.rank, kv.num_workers
    perm, truth = problem(args.dim, args.seed)
    train = draw(args.train, args.dim, perm, truth, args.seed + 1).shard(rank, workers)
    test = draw(args.test, args.dim, perm, truth, args.seed + 2) if rank == 0 else None
    rows = args.dim // args.keys
    keys = [f"w{k}" for k in range(args.keys)]
    weights = np.zeros(args.dim, np.float32)            # this worker's copy: only the pulled rows are current
    grad = np.zeros(args.dim, np.float32)
    parts = [weights[k * rows:(k + 1) * rows] for k in range(args.keys)]
    grads = [grad[k * rows:(k + 1) * rows] for k in range(args.keys)]
    kv.init(keys, [np.zeros(rows, np.float32) for _ in keys])
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=args.lr, rescale_grad=gradient_scale(kv)))
    rng = np.random.default_rng(1000 * args.seed + rank)
    bounds = np.arange(args.keys + 1) * rows
    book = Logbook(kv, nkeys=len(keys), eval_every=args.eval_every)

    def evaluate():
        # The pull counts as training time: under SSP it waits for the slowest worker, as the next
        # step's pull would have.
        kv.pull(keys, out=parts)
        with book.evaluating():
            log_loss, accuracy, area = score(weights, test)
        book.point(loss=log_loss, accuracy=accuracy, auc=area)

    kv.barrier()
    book.start()
    while book.training(args.steps, args.seconds):
        picks = rng.integers(0, len(train), args.batch)
        which, ids = train.rows(picks)
        touched = unique_sorted(ids)
        cut = np.searchsorted(touched, bounds)
        local = [touched[cut[k]:cut[k + 1]] - k * rows for k in range(args.keys)]
        kv.row_sparse_pull(keys, out=parts, row_ids=local)
        margin = np.bincount(which, weights=weights[ids], minlength=args.batch)
        residual = 1.0 / (1.0 + np.exp(-margin)) - train.labels[picks]         # d loss / d margin
        grad[:] = np.bincount(ids, weights=residual[which], minlength=args.dim) / args.batch
        kv.push(keys, [g[ids_k] for g, ids_k in zip(grads, local)], row_ids=local)
        book.after_step(evaluate)
    book.finish(evaluate)              # rank 0 evaluates the final weights; every worker joins
    kv.close()


if __name__ == "__main__":
    main()
