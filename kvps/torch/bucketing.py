"""How gradients are grouped into buckets, as torch DDP groups them: each bucket travels as one
pushpull. Pure: no kvstore, no sockets."""

BUCKET_BYTES = 25 << 20          # torch DDP's bucket_cap_mb
FIRST_BUCKET_BYTES = 1 << 20     # DDP's first bucket: the last layers' gradients start travelling early


def buckets(params, limit=BUCKET_BYTES, first=FIRST_BUCKET_BYTES):
    """Group parameters as DDP does: [[indices into params]], in reverse order (the order backward
    completes their gradients). A bucket ends where the dtype or device changes or the next
    gradient would take it past `limit` bytes (the first bucket past min(limit, first)); a gradient
    bigger than that is a bucket of its own. limit=0: one bucket per parameter."""
    groups, current, size, kind = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        cap = limit if groups else min(limit, first)
        if current and ((p.dtype, p.device) != kind or size + nbytes > cap):
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        kind = (p.dtype, p.device)
    if current:
        groups.append(current)
    return groups
