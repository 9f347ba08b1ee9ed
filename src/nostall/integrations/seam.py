"""The checkpoint methods of a training stack's strategy class, as SkyRL-style stacks call them.

Such a stack gives each worker a *strategy* object whose checkpoint half is::

    save_checkpoint(model, ckpt_dir, node_local_rank, optimizer=None, scheduler=None, tokenizer=None)
    load_checkpoint(model, ckpt_dir, optimizer=None, scheduler=None, load_module_strict=True,
                    load_optimizer_states=True, load_lr_scheduler_states=True) -> (ckpt_dir, states)
    finalize_pending_saves()

where ``ckpt_dir`` is a new directory per save (``<run>/global_step_<N>/policy``).
:class:`CheckpointingMixin` implements exactly these, so a stack adopts nostall
by inheriting it (nothing of the stack is imported here)::

    class MyStrategy(CheckpointingMixin, TheStacksStrategyBase):
        def __init__(self, cfg, ...):
            super().__init__(...)
            self.init_checkpointing(async_save=cfg.async_save, layout=nostall.ParallelLayout(...))

        def on_checkpoint_committed(self, handle):        # durable: now move the marker, prune
            if self.rank == 0:
                write_marker(handle.path)

Every save of the strategy goes through one :class:`~nostall.CheckpointManager`
without a root of its own: one background writer and one staging area for
the whole job, at most one save in flight whatever the directories, and no
``latest`` or retention (the stack owns them: do them in
:meth:`on_checkpoint_committed`, which runs only once a save is durable).
The model's Hugging Face files (config, generation config, tokenizer) are
committed with the weights under ``<ckpt_dir>/huggingface/``; the RNG states
of torch, numpy and Python's ``random`` are saved per rank.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from typing import Any, Dict, Optional, Tuple, Union

from nostall.handles import SaveHandle
from nostall.manager import CheckpointManager
from nostall.options import NOT_GIVEN, NotGiven, Options
from nostall.training import ParallelLayout, unwrap

log = logging.getLogger("nostall")

__all__ = ["CheckpointingMixin"]

HF_DIR = "huggingface"


class CheckpointingMixin:
    """``save_checkpoint`` / ``load_checkpoint`` / ``finalize_pending_saves`` for a stack's strategy class.

    Call :meth:`init_checkpointing` once (collective: every rank of
    ``process_group``), before the first save or load. Override
    :meth:`on_checkpoint_committed` for what must follow a durable save,
    and :meth:`huggingface_files` to commit other files with the weights.
    """

    _nostall: Optional[CheckpointManager] = None
    _nostall_layout: Optional[ParallelLayout] = None

    def init_checkpointing(self, *, async_save: Union[bool, NotGiven] = NOT_GIVEN,
                           layout: Optional[ParallelLayout] = None, process_group: Any = None,
                           options: Optional[Options] = None) -> CheckpointManager:
        """Create the strategy's manager (collective). ``options``: every other setting (timeout,
        overlap, object storage); ``async_save``, when given, overrides its ``async_save`` (a stack
        passes its own config's; not given: ``options``', whose default is Options'). ``keep_last`` is
        ignored: the stack owns retention."""
        changes: Dict[str, Any] = {"keep_last": None}
        if not isinstance(async_save, NotGiven):
            changes["async_save"] = async_save
        opts = (options or Options()).but(**changes)
        self._nostall = CheckpointManager(None, process_group=process_group, options=opts,
                                          on_commit=self.on_checkpoint_committed)
        self._nostall_layout = layout
        return self._nostall

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        if self._nostall is None:
            raise RuntimeError(f"{type(self).__name__}: call init_checkpointing() before saving or loading")
        return self._nostall

    # ------------------------------------------------------------------ hooks
    def on_checkpoint_committed(self, handle: SaveHandle) -> None:
        """Called on every rank once a save is committed (durable and visible), and only then.

        The place for the stack's "latest step" marker and its retention. Runs
        in the thread that learns the commit (see ``CheckpointManager``'s
        ``on_commit``); an exception is logged, the checkpoint stays.
        """

    def huggingface_files(self, model: Any, tokenizer: Any) -> Dict[str, Any]:
        """Side files committed with the weights: by default a Hugging Face model's config and
        generation config and a Hugging Face tokenizer's files, under ``huggingface/``."""
        transformers = sys.modules.get("transformers")  # a model or tokenizer of it implies it is imported
        if transformers is None:
            return {}
        files: Dict[str, bytes] = {}
        with tempfile.TemporaryDirectory(prefix="nostall-hf-") as tmp:
            inner = unwrap(model)
            if isinstance(inner, transformers.PreTrainedModel):
                inner.config.save_pretrained(tmp)
                if inner.generation_config is not None and inner.can_generate():
                    inner.generation_config.save_pretrained(tmp)
            if tokenizer is not None and isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
                tokenizer.save_pretrained(tmp)
            for dirpath, _, names in os.walk(tmp):
                for n in names:
                    full = os.path.join(dirpath, n)
                    with open(full, "rb") as f:
                        files[f"{HF_DIR}/{os.path.relpath(full, tmp)}"] = f.read()
        return files

    # ------------------------------------------------------------------ the seam
    def save_checkpoint(self, model: Any, ckpt_dir: str, node_local_rank: int, optimizer: Any = None,
                        scheduler: Any = None, tokenizer: Any = None, *, driver_state: Any = None) -> SaveHandle:
        """Save into ``ckpt_dir`` (collective). Returns once staged when saving asynchronously;
        the handle completes at the commit, after which :meth:`on_checkpoint_committed` runs.

        ``node_local_rank`` is accepted for the seam's sake: every rank writes its own pieces.
        ``driver_state`` (not part of the seam; rank 0 only): the job driver's own state (its
        data position, counters; JSON values and small tensors), committed in the same
        checkpoint; :meth:`load_checkpoint` gives it back as ``states["driver"]``.
        """
        mgr = self.checkpoint_manager
        files = self.huggingface_files(model, tokenizer) if mgr.rank == 0 else None
        return mgr.save(None, model=model, optimizer=optimizer, scheduler=scheduler, rng=True,
                        layout=self._nostall_layout, path=ckpt_dir, files=files, driver=driver_state)

    def load_checkpoint(self, model: Any, ckpt_dir: str, optimizer: Any = None, scheduler: Any = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> Tuple[str, Dict[str, Any]]:
        """Restore in place from ``ckpt_dir`` (finalizes pending saves first; collective, as the manager's load).

        Returns ``(ckpt_dir, states)``: ``states`` holds ``step`` (None: the
        seam names no step), ``rng_restored``, ``layout`` (the saving run's
        tensor- and data-parallel sizes), ``driver`` (the ``driver_state``
        saved with it, on every rank; None: none), and ``missing_keys`` and
        ``unexpected_keys``.

        ``load_module_strict`` (default True), as DeepSpeed's: the checkpoint's
        entries of what is loaded and the model's (and optimizer's) must
        match, or the load fails naming the keys; False: the entries both hold
        are loaded, the others reported in ``missing_keys`` and
        ``unexpected_keys``. The optimizer and scheduler left out by
        ``load_optimizer_states`` / ``load_lr_scheduler_states`` are not loaded
        and not an error.
        """
        mgr = self.checkpoint_manager
        loaded = mgr.load(model=model, optimizer=optimizer if load_optimizer_states else None,
                          scheduler=scheduler if load_lr_scheduler_states else None, layout=self._nostall_layout,
                          path=ckpt_dir, strict=load_module_strict)
        return loaded.path, {"step": loaded.step, "rng_restored": loaded.rng_restored, "layout": loaded.saved_layout,
                             "driver": loaded.driver, "missing_keys": loaded.missing_keys,
                             "unexpected_keys": loaded.unexpected_keys}

    def finalize_pending_saves(self, timeout: Optional[float] = None) -> None:
        """Wait (bounded) until the pending save is committed, or raise its error. Not collective;
        call it at the end of training unconditionally, and before archiving a checkpoint."""
        if self._nostall is not None:
            self._nostall.finalize_pending_saves(timeout)

    def close_checkpointing(self) -> None:
        """Finalize and release the writer (also done at interpreter exit)."""
        if self._nostall is not None:
            mgr, self._nostall = self._nostall, None
            mgr.close()
