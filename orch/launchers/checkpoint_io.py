"""The loop's checkpoint component: where an engine writes and reads its files, and how a
checkpoint is published (its manifest) or fetched and verified from a store.

The engine writes and reads its own files (:meth:`orch.launchers.engines.base.Engine.save` and
``load``); everything around that, which is the same for every engine, is here: clearing what an
earlier attempt left under a tag, staging a URI's checkpoints on each node, digesting and uploading
each node's files, and the manifest rank 0 publishes once every rank is done.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from orch.launchers.engines.base import Engine
from orch.launchers.job import TrainJob
from orch.launchers.storage import RemoteDir, staging_dir
from orch.plans.storage.locations import is_remote, local_path


class CheckpointIO:
    """Checkpoints of one rank of a run, in ``train.checkpoint_dir`` (a path or a URI)."""

    def __init__(self, job: TrainJob, rank: int, local_rank: int, world_size: int):
        self.job, self.rank, self.local_rank, self.world_size = job, rank, local_rank, world_size
        self.location = job.train.checkpoint_dir
        self.remote = is_remote(self.location)
        self._pending: tuple | None = None
        """A checkpoint written in the background: (wait for this rank's files, step, layout)."""

    def root(self) -> str:
        """Where the engine writes and reads: ``train.checkpoint_dir``, or for a URI this node's
        staging directory (:mod:`orch.launchers.storage`)."""
        if not self.remote:
            return local_path(self.location)
        import ray

        return str(staging_dir(self.location, ray.get_runtime_context().get_node_id()))

    def save(self, engine: Engine, step: int, client_state: dict[str, Any], *, background: bool = False) -> None:
        """Write this rank's part of the checkpoint of ``step``; rank 0 publishes it once every rank
        is done. With ``background`` and an engine that can (:meth:`Engine.save_async`) the files are
        written while training goes on, and published by :meth:`finish` (the next save calls it):
        until then the checkpoint has no manifest and no resume reads it."""
        import torch.distributed as dist

        from orch.launchers.checkpoint import tag_for

        self.finish()
        root, tag = self.root(), tag_for(step)
        # What an earlier attempt left under this tag (a run resumed from an older checkpoint
        # writes the same steps again) must not end up in this checkpoint's manifest.
        if self.rank == 0:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
            if self.remote:
                RemoteDir(self.location).delete(tag)
        if self.remote and self.local_rank == 0:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
        dist.barrier()
        wait = engine.save_async(root, tag, client_state) if background else None
        if wait is not None:
            self._pending = (wait, step, client_state["layout"])
            return
        engine.save(root, tag, client_state)
        dist.barrier()
        self._publish(step, client_state["layout"])

    def finish(self) -> None:
        """Wait for a checkpoint written in the background, then publish it (every rank calls it at
        the same point of the loop: the next save, or the end of training)."""
        if self._pending is None:
            return
        import torch.distributed as dist

        wait, step, layout = self._pending
        self._pending = None
        wait()
        dist.barrier()
        self._publish(step, layout)

    def _publish(self, step: int, layout: dict) -> None:
        """Rank 0 writes the manifest of the checkpoint every rank has written; for a URI, each
        node's files are digested and uploaded first."""
        import torch.distributed as dist

        from orch.launchers.checkpoint import publish, publish_remote, tag_for
        from orch.launchers.manifest import file_digests

        spec = self.job.train
        root, tag = self.root(), tag_for(step)
        if not self.remote:
            if self.rank == 0:
                publish(root, step, self.job.run_id, spec.keep_checkpoints, layout=layout,
                        model=self.job.model_signature)
            dist.barrier()
            return
        # Each node's first worker digests and uploads what the node wrote; once every node has
        # (the gather waits for them), rank 0 publishes.
        written, folder = ({}, {}), os.path.join(root, tag)
        # (A node whose ranks write nothing, as at ZeRO stage 0 beyond rank 0, may have no folder.)
        if self.local_rank == 0 and os.path.isdir(folder):
            written = file_digests(folder)
            RemoteDir(self.location).upload(folder, tag)
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, written)
        if self.rank == 0:
            files = {name: digest for digests, _ in gathered for name, digest in digests.items()}
            sizes = {name: size for _, node_sizes in gathered for name, size in node_sizes.items()}
            publish_remote(self.location, step, self.job.run_id, spec.keep_checkpoints, files, sizes,
                           layout=layout, model=self.job.model_signature)
        dist.barrier()
        if self.local_rank == 0:  # the staging copy, and the scripts DeepSpeed copies beside its tags
            shutil.rmtree(root, ignore_errors=True)

    def restore(self, engine: Engine, tag: str) -> dict[str, Any]:
        """Load checkpoint ``tag`` into ``engine`` (fetched and verified first from a store);
        return the loop's state saved with it."""
        import torch.distributed as dist

        from orch.launchers.checkpoint import download_verified

        root = self.root()
        if not self.remote:
            return engine.load(root, tag)
        # The node's first worker downloads the tag and checks every file against the manifest
        # before any rank loads it. It removes the staged copy once every rank of the node has
        # read it, or as soon as its own load refuses it (a file the digests pass but the
        # weights-only loader does not): nothing refused stays on the node.
        try:
            if self.local_rank == 0:
                download_verified(self.location, tag, os.path.join(root, tag))
            dist.barrier()
            client_state = engine.load(root, tag)
            dist.barrier()  # every rank of the node has read its files
        finally:
            if self.local_rank == 0:
                shutil.rmtree(root, ignore_errors=True)
        return client_state
