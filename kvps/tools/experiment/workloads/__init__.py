"""The training scripts `kvps experiment` runs, each a module run as `python -m` under `kvps launch`:
digits (an MLP or small CNN on scikit-learn's digits) and sparse_lr (sparse logistic regression)."""
