"""The reference trainer: three training loops sharing one checkpoint lifecycle.

* ``sft``: next-token prediction on the generated corpus.
* ``sync_rl``: generate, then train (REINFORCE on a toy reward) with the same
  TP model; sampling draws from the global RNG, which the checkpoint restores.
* ``async_rl``: a producer thread keeps generating rollouts with a full copy of
  the weights one step behind, while a trainer thread trains and requests the
  checkpoints; the main thread finalizes pending saves at the end. The rollout
  batch in flight at a checkpoint is part of the checkpoint, so a resumed run
  continues exactly.

Every loop saves every ``ckpt_interval`` steps (and at the steps listed in
``save_at``), resumes from ``resume`` and finalizes pending saves at the end of
training unconditionally. With fixed seeds on CPU a resumed run reproduces the
uninterrupted one bit for bit.

The trainer's own marker, ``<ckpt_dir>/trainer_marker.json`` (the last
committed step, its checkpoint and the data loader's position there), is
written by rank 0 in the strategy's ``on_commit`` callback: only once a save is
durable, never right after the save call, so that it cannot name a checkpoint
whose write then failed (:func:`read_marker` reads it).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nostall.errors import CheckpointCorruptError, CheckpointError
from nostall.handles import SaveHandle
from nostall.integrations.strategy import ParallelLayout, Strategy
from nostall.core.model import PerRank
from nostall.storage.locate import open_root
from nostall.tools.reference.data import Loader, make_corpus
from nostall.tools.reference.model import GPT, GPTConfig
from nostall.tools.reference.parallel import ParallelGroups, allreduce_dp_grads, gather_full_state, init_parallel

log = logging.getLogger("nostall.reference")

LOOPS = ("sft", "sync_rl", "async_rl")

MARKER = "trainer_marker.json"
_MARKER_LIMIT = 1 << 16  # bytes: a marker is a few hundred


def write_marker(ckpt_dir: str, record: Dict[str, Any], storage_options: Optional[Dict[str, Any]] = None,
                 timeout: float = 300.0) -> None:
    """Replace ``<ckpt_dir>/trainer_marker.json`` with ``record`` atomically (a rename on a filesystem,
    one PUT on object storage)."""
    data = json.dumps(record, indent=1, sort_keys=True).encode() + b"\n"
    open_root(ckpt_dir, storage_options=storage_options).write_small(MARKER, data, time.monotonic() + timeout)


def read_marker(ckpt_dir: str, storage_options: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The trainer's marker under ``ckpt_dir`` (None: none written yet)."""
    try:
        raw = open_root(ckpt_dir, storage_options=storage_options).read_small(MARKER, _MARKER_LIMIT)
    except CheckpointCorruptError:
        raise CheckpointError(f"{ckpt_dir}/{MARKER}: more than {_MARKER_LIMIT} bytes; not a trainer marker") from None
    if raw is None:
        return None
    record: Dict[str, Any] = json.loads(raw)
    return record


@dataclass
class TrainConfig:
    """Knobs of a reference run (the checkpoint ones mirror SkyRL's trainers)."""

    loop: str = "sft"
    steps: int = 40
    stop_after: Optional[int] = None  # end this run after that step, as a preempted job would
    ckpt_dir: str = "checkpoints"
    ckpt_interval: int = 10  # 0: no periodic saves
    save_at: Tuple[int, ...] = ()  # extra saves, e.g. requested by a callback
    async_save: bool = False
    overlap: bool = False  # async saves copy while the next forward/backward runs (docs/overlap.md)
    keep_last: Optional[int] = 2
    resume: str = "none"  # "none" | "latest" | a checkpoint directory
    tp: int = 2
    seed: int = 1234
    lr: float = 3e-3
    warmup: int = 5
    global_batch: int = 16
    model: GPTConfig = field(default_factory=GPTConfig)
    prompt_len: int = 8
    gen_len: int = 8
    measure_sync_save: bool = False  # after training, time one synchronous save of the same state
    timeout: float = 300.0
    storage_options: Optional[Dict[str, Any]] = None  # fsspec options when ckpt_dir is a URL (s3://...)
    local_staging_dir: Optional[str] = None  # object storage: this host's local scratch (default: under TMPDIR)

    def __post_init__(self) -> None:
        if self.loop not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, got {self.loop!r}")
        if self.ckpt_interval < 0:
            raise ValueError("ckpt_interval must be >= 0")
        if self.prompt_len + self.gen_len > self.model.seq_len:
            raise ValueError("prompt_len + gen_len must not exceed the model's seq_len")


@dataclass
class RunResult:
    """What one run did, as seen by rank 0 (losses are DP-averaged, identical on all ranks)."""

    losses: Dict[int, float] = field(default_factory=dict)
    saves: List[Dict[str, Any]] = field(default_factory=list)
    resumed_from: Optional[int] = None
    last_step: int = 0
    sync_save_stall_s: Optional[float] = None
    world_size: int = 1
    tp: int = 1

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)


def reward(tokens: torch.Tensor) -> torch.Tensor:
    """Toy reward per sample: the fraction of generated bytes that are lowercase vowels."""
    vowels = torch.zeros(128, dtype=torch.bool)
    vowels[list(b"aeiou")] = True
    return vowels[tokens.clamp(0, 127)].float().mean(dim=1)


class RolloutProducer:
    """Generates rollout batches on its own thread from a full copy of the weights.

    ``submit(step, weights, prompts)`` queues the generation of the batch that
    step ``step`` will train on; ``take(step)`` returns it (bounded wait).
    Sampling uses a generator seeded by (seed, step, DP rank), so a batch does
    not depend on timing.
    """

    def __init__(self, cfg: TrainConfig, dp_rank: int) -> None:
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.model = GPT(cfg.model, ParallelGroups(ParallelLayout()), cfg.seed)
        self._in: "queue.Queue[Optional[Tuple[int, dict, torch.Tensor]]]" = queue.Queue()
        self._out: Dict[int, Any] = {}
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def submit(self, step: int, weights: dict, prompts: torch.Tensor) -> None:
        self._in.put((step, weights, prompts))

    def _run(self) -> None:
        while True:
            item = self._in.get()
            if item is None:
                return
            step, weights, prompts = item
            try:
                self.model.load_state_dict(weights)
                g = torch.Generator().manual_seed(self.cfg.seed * 1000003 + step * 101 + self.dp_rank)
                tokens = self.model.generate(prompts, self.cfg.gen_len, generator=g)
                result: Any = (prompts, tokens)
            except BaseException as e:  # handed to the trainer thread
                result = e
            with self._cv:
                self._out[step] = result
                self._cv.notify_all()

    def take(self, step: int, timeout: float) -> Tuple[torch.Tensor, torch.Tensor]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while step not in self._out:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise RuntimeError(f"rollout batch for step {step} not produced within {timeout}s")
                self._cv.wait(min(left, 1.0))
            result = self._out.pop(step)
        if isinstance(result, BaseException):
            raise RuntimeError(f"rollout generation for step {step} failed") from result
        return result

    def stop(self) -> None:
        self._in.put(None)
        self._thread.join(timeout=30)


class Trainer:
    """One rank of a reference run. Call collectively on every rank.

    ``run()`` does the whole run; the step-level methods (``resume``,
    ``train_step``, ``maybe_save``, ``finalize``, ``close``) let a driver
    (the Ray example) run the same lifecycle remotely.
    """

    def __init__(self, cfg: TrainConfig, strategy: Optional[Strategy] = None) -> None:
        self.cfg = cfg
        self.groups = init_parallel(cfg.tp)
        lay = self.groups.layout
        self.layout = lay
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.model = GPT(cfg.model, self.groups, cfg.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
        warmup = max(1, cfg.warmup)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.loader = Loader(
            make_corpus(seed=cfg.seed), cfg.model.seq_len, cfg.global_batch, lay.dp_rank, lay.dp_size, cfg.seed
        )
        # TP peers draw the same samples (same RNG stream); DP ranks differ
        torch.manual_seed(cfg.seed + 7919 * lay.dp_rank)
        random.seed(cfg.seed + 7919 * lay.dp_rank)
        # what the marker will record for each save in flight, by step (see _on_commit)
        self._marks: Dict[int, Dict[str, Any]] = {}
        self._marks_lock = threading.Lock()
        self._marked = threading.Condition()  # rank 0: the newest step whose marker write has finished
        self._marked_step = -1
        # (a strategy passed in keeps its own on_commit: no trainer marker then)
        self.strategy = strategy or Strategy(
            lay, async_save=cfg.async_save, overlap=cfg.overlap, keep_last=cfg.keep_last, timeout=cfg.timeout,
            storage_options=cfg.storage_options, local_staging_dir=cfg.local_staging_dir, on_commit=self._on_commit,
        )
        self._handles: List[Tuple[Dict[str, Any], Any]] = []  # (save record, its handle)
        self.step = 0
        self.result = RunResult(world_size=lay.tp_size * lay.dp_size, tp=lay.tp_size)
        self._producer: Optional[RolloutProducer] = None
        self._rollouts: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ checkpoint lifecycle
    def _counters(self) -> Dict[str, Any]:
        """The trainer's own JSON state: step, loop and data-loader position."""
        return {"step": self.step, "loop": self.cfg.loop, "loader": self.loader.state_dict()}

    def _extra(self) -> Dict[str, Any]:
        extra: Dict[str, Any] = self._counters()
        if self.cfg.loop == "async_rl":
            prompts, tokens = self._rollouts[self.step + 1]
            extra["rollout"] = PerRank({"prompts": prompts, "tokens": tokens})
        return extra

    def _extra_template(self) -> Any:
        if self.cfg.loop != "async_rl":
            return None
        b = self.cfg.global_batch // self.layout.dp_size
        z = torch.zeros(b, self.cfg.prompt_len, dtype=torch.long)
        return {"step": None, "loop": None, "loader": None,
                "rollout": PerRank({"prompts": z, "tokens": torch.zeros(b, self.cfg.gen_len, dtype=torch.long)})}

    def save_checkpoint(self, async_save: Optional[bool] = None) -> Dict[str, Any]:
        """Save the current step (collective); returns what it cost this rank."""
        if self.cfg.loop == "async_rl" and self.step + 1 not in self._rollouts:
            # the batch in flight is part of the state: wait for it (the next step needs it anyway)
            self._rollouts[self.step + 1] = self._take(self.step + 1)
        with self._marks_lock:  # before the call: a synchronous save commits (and calls back) inside it
            self._marks[self.step] = {"step": self.step, "loop": self.cfg.loop, "loader": self.loader.state_dict()}
        t0 = time.perf_counter()
        handle = self.strategy.save_checkpoint(
            self.cfg.ckpt_dir, self.step, self.model, self.optimizer, self.scheduler, self._extra(),
            async_save=async_save,
        )
        stall = time.perf_counter() - t0
        st = handle.stats  # an async save's: provisional until it commits (finalize() takes the final ones)
        rec = {"step": self.step, "stall_s": st.stall_s if st is not None else stall,
               "async": self.cfg.async_save if async_save is None else async_save}
        if st is not None and st.total_s is not None:  # final (a sync save)
            rec["total_s"] = st.total_s
        self._handles.append((rec, handle))
        self.result.saves.append(rec)
        handle.add_done_callback(self._report)
        return rec

    def _report(self, handle: SaveHandle) -> None:
        """One line per save, once its outcome is known: the stall from the handle's final stats."""
        st = handle.stats
        if st is None:
            log.warning("rank %d: the save of step %s failed: %s", self.rank, handle.step, handle.exception(0))
            return
        log.info("rank %d: step %s checkpoint committed (%s save): training blocked %.1f ms", self.rank,
                 handle.step, "async" if st.async_save else "sync", st.stall_s * 1e3)

    def _on_commit(self, handle: SaveHandle) -> None:
        """The strategy's commit callback: the save of ``handle.step`` is durable, so rank 0 moves the
        trainer's marker to it. Runs in whatever thread learns the commit; a failed save never gets here
        and leaves the marker on the previous committed step."""
        with self._marks_lock:
            mark = self._marks.pop(handle.step, None) if handle.step is not None else None
            for older in [s for s in self._marks if handle.step is not None and s < handle.step]:
                del self._marks[older]  # saves that failed: never committed, never marked
        if self.rank != 0 or handle.step is None:
            return
        try:
            if mark is not None:
                write_marker(self.cfg.ckpt_dir, {**mark, "checkpoint": handle.path}, self.cfg.storage_options,
                             self.cfg.timeout)
                log.info("marker %s/%s: step %d", self.cfg.ckpt_dir, MARKER, mark["step"])
        finally:
            with self._marked:
                self._marked_step = max(self._marked_step, handle.step)
                self._marked.notify_all()

    def _wait_for_marker(self) -> None:
        """Rank 0: wait (bounded) until the commit callbacks of the saves that committed have finished
        with the marker: one may still be running in its handle's watcher thread when
        ``finalize_pending_saves`` returns, and a process that exits then would lose it."""
        if self.rank != 0 or self.strategy.on_commit != self._on_commit:
            return
        committed = [h.step for _, h in self._handles if h.done() and h.exception(0) is None and h.step is not None]
        if not committed:
            return
        with self._marked:
            if not self._marked.wait_for(lambda: self._marked_step >= max(committed), self.cfg.timeout):
                log.warning("the marker for step %d was not written within %.0fs", max(committed), self.cfg.timeout)

    def maybe_save(self) -> Optional[Dict[str, Any]]:
        """Save if the current step is due (every ``ckpt_interval`` steps, or listed in ``save_at``)."""
        c = self.cfg
        if (c.ckpt_interval and self.step % c.ckpt_interval == 0) or self.step in c.save_at:
            return self.save_checkpoint()
        return None

    def resume(self, resume: Optional[str] = None) -> Optional[int]:
        """Load the checkpoint named by ``resume`` (default: the config's); returns its step (None: started fresh)."""
        c = self.cfg
        resume = c.resume if resume is None else resume
        if resume == "none":
            return None
        if resume == "latest":
            if self.strategy.latest_step(c.ckpt_dir) is None:
                log.info("rank %d: no checkpoint under %s; starting fresh", self.rank, c.ckpt_dir)
                return None
            where = c.ckpt_dir
        else:
            where = resume
        loaded = self.strategy.load_checkpoint(
            where, self.model, self.optimizer, self.scheduler, extra=self._extra_template()
        )
        extra = loaded.extra
        if extra.get("loop") != c.loop:
            raise CheckpointError(f"{loaded.path}: saved by the {extra.get('loop')!r} loop, not {c.loop!r}")
        self.step = int(extra["step"])
        self.loader.load_state_dict(extra["loader"])
        if c.loop == "async_rl" and loaded.rng_restored:
            r = extra["rollout"]
            self._rollouts[self.step + 1] = (r["prompts"], r["tokens"])
        self.result.resumed_from = self.step
        log.info("rank %d: resumed from %s (step %d)", self.rank, loaded.path, self.step)
        return self.step

    def prepare(self) -> None:
        """Plan the checkpoint and allocate its staging memory now, so the first save stalls no longer than
        the others (collective). Call it once the optimizer state exists (after a step or a resume)."""
        extra = self._extra_template() or {}
        extra = {**extra, **self._counters()}
        self.strategy.prepare_checkpoint(self.cfg.ckpt_dir, self.model, self.optimizer, self.scheduler, extra)

    def finalize(self) -> None:
        """End of training: wait for every pending save, whatever triggered it, and (rank 0) for the
        marker to name the last committed one.

        Then each save's record gets its full stall: with overlap, the time the
        optimizer step waited for the copy is part of it.
        """
        self.strategy.finalize_pending_saves()
        self._wait_for_marker()
        for rec, handle in self._handles:
            if handle.done() and handle.exception() is None and handle.stats is not None:
                rec["stall_s"] = handle.stats.stall_s
                rec["total_s"] = handle.stats.total_s
        self._handles.clear()

    # ------------------------------------------------------------------ steps
    def _mean_over_dp(self, x: torch.Tensor) -> float:
        x = x.detach().clone()
        if self.layout.dp_size > 1:
            dist.all_reduce(x, group=self.groups.dp_group)
            x /= self.layout.dp_size
        return float(x)

    def _update(self, loss: torch.Tensor) -> None:
        loss.backward()
        allreduce_dp_grads(self.model, self.groups)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _policy_loss(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        r = reward(tokens)
        adv = r - r.mean()
        seq = torch.cat([prompts, tokens], dim=1)
        logits = self.model(seq[:, :-1])[:, prompts.shape[1] - 1 :]
        logp = torch.gather(F.log_softmax(logits, dim=-1), 2, tokens[:, :, None])[:, :, 0]
        return -(adv[:, None] * logp).mean()

    def _prompts(self) -> torch.Tensor:
        return self.loader.next_batch()[0][:, : self.cfg.prompt_len]

    def _take(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        assert self._producer is not None
        return self._producer.take(step, self.cfg.timeout)

    def _publish(self, for_step: int) -> None:
        """Hand the current weights and the prompts of ``for_step`` to the producer."""
        assert self._producer is not None
        self._producer.submit(for_step, gather_full_state(self.model, self.groups), self._prompts())

    def _start_producer(self) -> None:
        if self._producer is not None:
            return
        self._producer = RolloutProducer(self.cfg, self.layout.dp_rank)
        if self.step == 0:
            self._publish(1)
        elif self.step + 1 not in self._rollouts:
            # resumed on another layout: the saved in-flight batch was per-rank; regenerate it
            self._publish(self.step + 1)
        self._publish(self.step + 2)

    def train_step(self) -> float:
        """Train one step; returns its loss (averaged over DP ranks)."""
        c = self.cfg
        if c.loop == "sft":
            x, y = self.loader.next_batch()
            loss = self.model.loss(x, y)
        elif c.loop == "sync_rl":
            prompts = self._prompts()
            tokens = self.model.generate(prompts, c.gen_len)
            loss = self._policy_loss(prompts, tokens)
        else:
            self._start_producer()
            batch = self._rollouts.pop(self.step + 1, None)
            prompts, tokens = batch if batch is not None else self._take(self.step + 1)
            loss = self._policy_loss(prompts, tokens)
        self._update(loss)
        self.step += 1
        value = self._mean_over_dp(loss)
        self.result.losses[self.step] = value
        self.result.last_step = self.step
        if c.loop == "async_rl":
            self.maybe_save()
            self._publish(self.step + 2)
        return value

    # ------------------------------------------------------------------ whole run
    def _loop(self) -> None:
        end = self.cfg.steps if self.cfg.stop_after is None else min(self.cfg.steps, self.cfg.stop_after)
        prepare = self.cfg.async_save and bool(self.cfg.ckpt_interval or self.cfg.save_at)
        while self.step < end:
            loss = self.train_step()
            if prepare:  # after the first step of this run the optimizer state exists
                self.prepare()
                prepare = False
            if self.rank == 0:
                log.info("step %4d  loss %.6f", self.step, loss)
            if self.cfg.loop != "async_rl":
                self.maybe_save()

    def run(self) -> RunResult:
        """Resume, train to ``steps`` (or ``stop_after``), finalize pending saves."""
        self.resume()
        try:
            if self.cfg.loop == "async_rl":
                self._run_on_trainer_thread()
            else:
                self._loop()
        finally:
            # unconditional: saves may come from anywhere, even with ckpt_interval=0
            self.finalize()
        if self.cfg.measure_sync_save:
            self.result.sync_save_stall_s = self.measure_sync_save()
        return self.result

    def _run_on_trainer_thread(self) -> None:
        error: List[BaseException] = []

        def target() -> None:
            try:
                self._loop()
            except BaseException as e:
                error.append(e)

        t = threading.Thread(target=target, name="trainer")
        t.start()
        t.join()
        if error:
            raise error[0]

    def measure_sync_save(self) -> float:
        """Time one synchronous save of the current state into a scratch root (then removed)."""
        root = os.path.abspath(self.cfg.ckpt_dir).rstrip("/") + "-sync-reference"
        probe = Strategy(self.layout, async_save=False, timeout=self.cfg.timeout)
        extra = self._counters()
        try:
            stall = 0.0
            for _ in range(2):  # the second save is the steady state (plan cached), like the async ones
                stats = probe.save_checkpoint(root, self.step, self.model, self.optimizer, self.scheduler,
                                              extra).result()
                stall = stats.stall_s
        finally:
            probe.close()
        if self.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        return stall

    def close(self) -> None:
        """Stop the producer, close the strategy (finalizing; rank 0: the marker written) and free the
        process groups."""
        try:
            if self._producer is not None:
                self._producer.stop()
                self._producer = None
            self.strategy.close()
            self._wait_for_marker()  # (when finalize() did not run: a Ray driver finalizes the strategy itself)
        finally:
            self.groups.destroy()
