"""The reference trainer driven over Ray actors.

    python -m nostall.tools.reference.ray_train --world 2 --tp 2 --loop sft --steps 20 --async-save

The driver owns the loop: it starts one :class:`TrainerWorker` actor per rank
(they form a gloo group), tells them to resume, to train each step and to
save when due, and finalizes pending saves on all of them at the end,
unconditionally, through :class:`~nostall.integrations.ray.WorkerDispatch`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Dict, List, Optional

import ray

from nostall.integrations.ray import Worker, WorkerDispatch
from nostall.tools.reference.train import config_from_args, parse_args
from nostall.tools.reference.trainer import RunResult, TrainConfig, Trainer

log = logging.getLogger("nostall.reference")


class TrainerWorker(Worker):
    """A rank of the reference trainer inside a Ray actor.

    ``setup(cfg)`` builds a fresh :class:`Trainer` (after any earlier one is
    closed), so one actor group can run several trainings.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.trainer: Optional[Trainer] = None

    def setup(self, cfg: TrainConfig) -> None:
        import torch

        torch.set_num_threads(1)
        self.teardown()
        self.trainer = Trainer(cfg)
        self.strategy = self.trainer.strategy

    def resume(self, where: Optional[str] = None) -> Optional[int]:
        return self._t.resume(where)

    def load_checkpoint(self, ckpt_dir: str, step: Optional[int] = None) -> int:
        got = self._t.resume(ckpt_dir if step is None else f"{ckpt_dir}/step_{step}")
        return -1 if got is None else got

    def train_step(self) -> float:
        return self._t.train_step()

    def maybe_save(self) -> Optional[Dict[str, Any]]:
        return self._t.maybe_save()

    def save_checkpoint(self, ckpt_dir: str, step: int, async_save: Optional[bool] = None,
                        driver_state: Any = None) -> Dict[str, Any]:
        t = self._t
        if driver_state is not None:
            raise ValueError("the reference worker's trainer keeps its own state (in its extra); no driver state")
        if ckpt_dir != t.cfg.ckpt_dir or step != t.step:
            raise ValueError("the reference worker saves its current step under its configured ckpt_dir")
        return t.save_checkpoint(async_save)

    def result(self) -> Dict[str, Any]:
        return self._t.result.as_dict()

    def teardown(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None

    def shutdown(self) -> None:
        self.teardown()
        super().shutdown()

    @property
    def _t(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("TrainerWorker.setup(cfg) was not called")
        return self.trainer


def run(dispatch: WorkerDispatch, cfg: TrainConfig) -> RunResult:
    """One run of the reference trainer over the dispatch's actors (the driver's loop)."""
    dispatch.call("setup", cfg)
    try:
        step = dispatch.call("resume")[0] or 0
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
        while step < end:
            losses = dispatch.call("train_step")
            step += 1
            log.info("step %4d  loss %.6f", step, losses[0])
            if cfg.loop != "async_rl":  # the async loop saves from the workers' trainer threads
                dispatch.call("maybe_save")
    finally:
        dispatch.finalize_pending_saves()  # unconditional, whatever requested the saves
    return RunResult(**dispatch.call("result")[0])


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    world = 2
    if "--world" in argv:
        i = argv.index("--world")
        world = int(argv[i + 1])
        del argv[i : i + 2]
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[driver] %(message)s")
    ray.init(num_cpus=world, include_dashboard=False, object_store_memory=200 << 20)
    try:
        dispatch = WorkerDispatch.start(TrainerWorker, world)
        try:
            result = run(dispatch, config_from_args(args))
        finally:
            dispatch.shutdown()
        if args.history:
            result.write_json(args.history)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
