"""The worker side of checkpoints (docs/checkpoint.md): kv.save (any worker's in dist_sync, a
collective elsewhere) and kv.load (a collective), a resume at every kv.init (KVPS_RESUME), and
periodic checkpoints (KVPS_CHECKPOINT_DIR with KVPS_CHECKPOINT_EVERY). The servers write and read
the files; one worker sends them SAVE or LOAD and writes the manifest, last.

    ck = Checkpointer(node, cfg, keys, num_servers, mode)
    ck.save(path)                          # SAVE to every server, then the manifest
    ck.load(path, infos, "all")            # LOAD: each server reads the rows it now holds
    ck.before_push(keys, wait_all)         # worker 0: periodic checkpoints at step boundaries

Why a save is a consistent cut without stopping the others: a server copies its state the moment
SAVE arrives. The saving worker first waits for its own pushes, so (dist_sync) every key's round of
its last step has closed, and no later round can close without its next push, which it sends after
SAVE on the same connection. So every key is saved at the same round, while the other workers keep
pushing into the open rounds. (Async and ssp have no such cut; their periodic checkpoints are
fuzzy, as any asynchronous checkpoint; there kv.save is a collective behind a barrier, which makes
it exact. In dist_sync kv.save is this cut, with the servers holding updates back while they write.)
"""
import logging
import os
import secrets
import threading

from kvps.errors import KVPSError
from kvps.ps import checkpoint
from kvps.wire.protocol import Entry, Header, Op, dtype_code

log = logging.getLogger("kvps.worker")

LOAD_ENTRIES = 16384        # entries per LOAD message (a header stays far under MAX_HEADER_BYTES)


class Checkpointer:
    """One worker's checkpoint requests. `keys` is the kvstore's {key: KeyInfo} (read, never
    changed); the object never refers to the kvstore itself (which must stay collectable)."""

    def __init__(self, node, cfg, keys, num_servers, mode):
        self.node, self.cfg, self.keys = node, cfg, keys
        self.num_servers, self.mode = num_servers, mode
        self.optimizer = None            # the spec set_optimizer sent, recorded in the manifest
        self.step = 0                    # steps counted by before_push
        self.every = cfg.checkpoint_every if cfg.checkpoint_dir else 0
        self._this_step = set()
        self._due = False                # a periodic checkpoint is due at the next step boundary
        self._thread = None              # the periodic checkpoint being written
        self._error = None               # its failure, raised at the next step boundary
        self._resume = None              # the KVPS_RESUME manifest, read once

    # ---- saving ----
    def start_save(self, path, step=None, dump_optimizer=False, hold=False, taken=False):
        """Send SAVE to every server (they copy their state on arrival, or, with `hold`, when every
        worker waits for the save, write it as it is and hold back what would change it); returns
        finish(), which waits for the shards and writes the manifest. With `taken`, return only once
        every server has copied its state: the pushes sent next may go on other connections (the
        calling thread's lanes), which could otherwise reach a server first."""
        path = os.path.abspath(path)
        os.makedirs(path, exist_ok=True)
        previous = checkpoint.shard_files(path)
        save_id = f"{'save' if step is None else f'step{step}'}-{secrets.token_hex(6)}"
        files = [None] * self.num_servers

        def keep(server):
            def on_reply(header, payloads):
                files[server] = {"file": header.meta["file"], "bytes": header.meta["bytes"],
                                 "checksum": header.meta["checksum"], "server": server}
            return on_reply
        meta = {"path": path, "save": save_id, "hold": hold}
        if self.cfg.replicas:       # each range's shard from the head of its chain (kvps/wire/chains.py)
            items = [(self.node.server_peer(s), Header(Op.SAVE, meta=dict(meta, home=s)), (), keep(s))
                     for s in range(self.num_servers)]
        else:
            items = [(f"S{s}", Header(Op.SAVE, meta=meta), (), keep(s)) for s in range(self.num_servers)]
        handle = self.node.request_many(items, f"checkpoint to {path}")
        if taken:       # a fence after each SAVE, on the same connection
            fences = [(peer, Header(Op.SAVE, meta=dict(header.meta, taken=True)), (), None)
                      for peer, header, _, _ in items]
            self.node.request_many(fences, f"the servers to copy their state for the checkpoint to {path}").wait()
        layout = [{"key": info.key, "dtype": info.dtype.name, "shape": list(info.shape),
                   "parts": [[p.index, p.server, p.row_start, p.row_stop] for p in info.parts]}
                  for info in list(self.keys.values())]
        manifest = {"step": step, "mode": self.mode, "num_workers": len(self.node.membership["workers"]),
                    "num_servers": self.num_servers, "optimizer": self.optimizer, "dump_optimizer": dump_optimizer,
                    "files": files, "keys": layout}

        def finish():
            handle.wait()
            checkpoint.write_manifest(path, manifest)
            checkpoint.remove_stale(path, manifest, previous)
            log.info("%s: checkpoint %s written (%d keys, %d shards)", self.node.name, path, len(layout), len(files))
        return finish

    # ---- loading ----
    def check(self, path, infos):
        """The manifest of `path`, after checking it holds every key of `infos` as the job declares
        it (CheckpointError naming the file and the key)."""
        manifest = checkpoint.read_manifest(os.path.abspath(path))
        for info in infos:
            checkpoint.check_key(manifest, info.key, info.dtype, info.shape)
        return manifest

    def load(self, path, infos, what):
        """Send LOAD for every part of `infos` to the server that now holds it, and wait. `what`:
        all, values or optimizer (kvps/wire/protocol.py's LOAD)."""
        path = os.path.abspath(path)
        per_server = {}
        for info in infos:
            code = dtype_code(info.dtype)
            for part in info.parts:
                per_server.setdefault(part.server, []).append(
                    (Entry.bare(info.key, part.index, code, part.shape(info.shape)), part.row_start))
        items = []
        for server, entries in sorted(per_server.items()):
            for i in range(0, len(entries), LOAD_ENTRIES):
                chunk = entries[i:i + LOAD_ENTRIES]
                meta = {"path": path, "rows": [start for _, start in chunk], "what": what}
                if self.cfg.replicas:       # the head loads it, and its chain with it
                    meta["home"] = server
                items.append((self.node.server_peer(server), Header(Op.LOAD, keys=[e for e, _ in chunk], meta=meta),
                              (), None))
        if items:
            self.node.request_many(items, f"loading checkpoint {path}").wait()

    def resume_manifest(self):
        if self._resume is None:
            self._resume = checkpoint.read_manifest(os.path.abspath(self.cfg.resume))
            self.step = self._resume.get("step") or 0
        return self._resume

    # ---- periodic checkpoints (worker 0) ----
    def before_push(self, keys, wait_all):
        """Count steps (a step ends when a key is pushed again) and, every `every` steps, start a
        checkpoint to KVPS_CHECKPOINT_DIR before this push goes out (at a later step boundary when
        the last one is still being written); the write goes on in the background, and an error of
        the last one is raised here."""
        if self._error is not None:
            error, self._error = self._error, None
            raise KVPSError(f"the periodic checkpoint to {self.cfg.checkpoint_dir} failed: {error}") from error
        seen = self._this_step
        if not any(k in seen for k in keys):
            seen.update(keys)
            return
        seen.clear()
        seen.update(keys)
        self.step += 1
        if self.step % self.every == 0:
            self._due = True
        if not self._due:
            return
        if self._thread is not None and self._thread.is_alive():
            # the last one is still being written: take this one at the next step boundary
            # instead of holding training up (or holding two copies of the state)
            log.info("%s: step %d's checkpoint waits for the last one to be written", self.node.name, self.step)
            return
        self._due = False
        wait_all()          # this worker's pushes are in: the cut is at a step boundary
        finish = self.start_save(self.cfg.checkpoint_dir, self.step, taken=True)
        self._thread = threading.Thread(target=self._finish, args=(finish,), name="kvps-checkpoint")
        self._thread.start()

    def _finish(self, finish):
        try:
            finish()
        except Exception as exc:
            log.error("%s: periodic checkpoint failed: %s", self.node.name, exc)
            self._error = exc

    def wait(self, timeout=None):
        """Wait for a periodic checkpoint still being written (close() and save() call this)."""
        thread = self._thread
        if thread is not None:
            thread.join(self.cfg.timeout if timeout is None else timeout)
            if thread.is_alive():
                raise KVPSError(f"the periodic checkpoint to {self.cfg.checkpoint_dir} is still being written "
                                f"after {self.cfg.timeout:g} s (KVPS_TIMEOUT)")
